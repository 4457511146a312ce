"""The diagrams of `marlhf_edu.teaching.diagrams` name what the code really has, and their numbers are the package's.

Each test reads the names from the code a diagram pictures (the trainer's phases and rollout fields, the adapters
the multi-adapter backend loads, the 7B configs' stages and folders), so renaming one there fails here until the
diagram says it too.
"""

import dataclasses
import inspect
import pathlib
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from marlhf_edu.math.gae import gae_advantages_reference
from marlhf_edu.teaching import diagrams
from marlhf_edu.teaching.diagrams import GIB, figure_texts

ROOT = pathlib.Path(__file__).resolve().parent.parent


def words(fig) -> set[str]:
    """Every identifier-like word on the figure (`time/score_s`, `ref_logprobs`, `runs/llama2_7b/rm/` stay whole)."""
    return {w for text in figure_texts(fig) for w in re.findall(r"[\w./-]+", text)}


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("name", ["ppo_iteration", "adapter_switching", "memory_budget", "gae_recursion",
                                  "pipeline_7b"])
def test_each_diagram_is_a_figure_named_to_its_chapter(name):
    fn = getattr(diagrams, name)
    assert re.search(r"Taught in chapter (05|09|10|15)\.", inspect.getdoc(fn))
    fig = fn()
    assert isinstance(fig, Figure) and figure_texts(fig)
    # drawn twice, the same picture: no randomness
    assert figure_texts(fn()) == figure_texts(fig)


def test_ppo_iteration_names_the_trainers_phases_fields_and_functions():
    from marlhf_edu.ppo.backends import PPOBackend
    from marlhf_edu.ppo.trainer import PHASES, PPOTrainer, Rollout

    fig = diagrams.ppo_iteration()
    shown = words(fig)
    assert [s[0].split(". ")[0] for s in diagrams.PPO_STEPS] == [str(i) for i in range(1, 8)]
    for phase in PHASES:  # every timed phase of a step, as the record names it
        assert f"time/{phase}_s" in shown, phase
    fields = {f.name for f in dataclasses.fields(Rollout)}
    for tensor in ("input_ids", "response_mask", "raw_scores", "scores", "logprobs", "ref_logprobs", "values",
                   "rewards", "kls", "advantages", "returns"):
        assert tensor in fields and tensor in shown, tensor
    source = inspect.getsource(PPOTrainer)
    for fn in ("token_level_rewards", "gae_advantages", "masked_whiten", "ppo_loss", "transform_scores",
               "kl_controller.update"):
        assert fn in source and fn in shown, fn
    for method in ("rollout", "update", "step"):
        assert callable(getattr(PPOTrainer, method)) and f"PPOTrainer.{method}" in shown, method
    for method in ("scores", "policy_forward", "reference_logprobs"):
        assert callable(getattr(PPOBackend, method)) and any(method in w for w in shown), method


def test_adapter_switching_shows_the_adapters_and_switches_the_backend_uses():
    from marlhf_edu.ppo.multi_adapter import VALUE_MODES, MultiAdapterBackend

    init = inspect.getsource(MultiAdapterBackend.__init__)
    loaded = set(re.findall(r'adapter_name="(\w+)"', init)) | set(re.findall(r'add_adapter\("(\w+)"', init))
    assert loaded == set(diagrams.ADAPTERS)
    fig = diagrams.adapter_switching()
    text = "\n".join(figure_texts(fig))
    for adapter in diagrams.ADAPTERS:
        assert adapter in words(fig)
    for mode in VALUE_MODES:
        assert f"value_mode: {mode}" in text or f"if {mode}" in text, mode
    # each forward switches as the diagram says, in the method that runs it
    forward_of = {"policy forward": MultiAdapterBackend.policy_forward,
                  "value forward": MultiAdapterBackend.policy_forward,
                  "reward forward": MultiAdapterBackend.scores,
                  "reference forward": MultiAdapterBackend.reference_logprobs}
    for title, active, how, _, _ in diagrams.FORWARDS:
        call = how.split("\n")[0]
        assert call in text
        if active == "policy":  # the default: every other switch returns to it
            assert 'set_adapter("policy")' in inspect.getsource(MultiAdapterBackend._use_adapter)
        else:
            assert call.removesuffix("()") in inspect.getsource(forward_of[title]), (title, call)
    # trained heads and adapters as drawn: the value head trains, the reward adapter and score head do not
    restore = inspect.getsource(MultiAdapterBackend._restore_trainable)
    assert "self.value_head.requires_grad_(True)" in restore and "self.reward_head.requires_grad_(False)" in restore


def test_memory_budget_draws_the_planners_bytes():
    from marlhf_edu.memory.plan import LLAMA_2_7B, plan_multi_adapter
    from marlhf_edu.memory.settings import MemoryArguments, settings_and_shape
    from marlhf_edu.ppo import PPOConfig
    from marlhf_edu.training.args import parse_stage_args

    plans = diagrams.memory_budget_plans()
    four, ma = plans["four full models"], plans["MA-PPO"]
    # the MA-PPO bar is the 7B config's recipe as `marlhf-edu memory` plans it
    config = parse_stage_args((PPOConfig,), ["--config", str(ROOT / "configs/llama2_7b/ma_ppo.yaml")])[0]
    shape, s = settings_and_shape(config, MemoryArguments(model_shape="llama-2-7b", weight_dtype="bfloat16",
                                                          reward_lora_r=32, reward_target_modules=list(diagrams.QKVO)))
    assert shape == LLAMA_2_7B and plan_multi_adapter(shape, s).model_state == ma.model_state
    assert four.settings.policy_lora_r == four.settings.value_lora_r == 0 and not four.settings.load_in_4bit

    fig = diagrams.memory_budget()
    top, bottom = fig.axes
    bars = [p for p in top.patches if isinstance(p, Rectangle)]  # one rectangle per segment of the two bars
    widths = {round(p.get_y() + p.get_height() / 2): [] for p in bars}
    for p in sorted(bars, key=lambda p: p.get_x()):
        widths[round(p.get_y() + p.get_height() / 2)].append(p.get_width())
    for y, plan in ((1, four), (0, ma)):
        expected = [nbytes / GIB for _, nbytes, _ in diagrams.memory_segments(plan)]
        assert widths[y] == pytest.approx(expected, rel=1e-12)
        assert sum(widths[y]) == pytest.approx(plan.model_state / GIB, rel=1e-12)
    segments = diagrams.memory_segments(four)
    assert [name for name, _, _ in segments[:4]] == ["actor", "critic", "reference", "reward"]
    assert segments[-2][1] == four.parts["gradients"] and segments[-1][1] == four.parts["optimizer"]
    text = "\n".join(figure_texts(fig))
    for total in (four.model_state, ma.model_state):
        assert f"{total / GIB:.1f} GiB" in text
    assert f"{ma.model_state / GIB:.2f} GiB" in text
    assert "r=64" in text and "r=32" in text and LLAMA_2_7B.name in text


def test_gae_recursion_prints_what_the_backward_loop_computes():
    ex = diagrams.GAE_EXAMPLE
    values, rewards = torch.tensor([ex["values"]]), torch.tensor([ex["rewards"]])
    mask = torch.ones_like(values)
    # the loop form, an implementation of its own: λ = 0 gives the TD errors
    deltas, _ = gae_advantages_reference(values, rewards, mask, gamma=ex["gamma"], lam=0.0)
    advantages, returns = gae_advantages_reference(values, rewards, mask, gamma=ex["gamma"], lam=ex["lam"])
    out = diagrams.gae_example()
    assert out["deltas"] == pytest.approx(deltas[0].tolist(), abs=1e-6)
    assert out["advantages"] == pytest.approx(advantages[0].tolist(), abs=1e-6)
    shown = figure_texts(diagrams.gae_recursion())
    for d, a in zip(deltas[0].tolist(), advantages[0].tolist()):
        assert f"{d:+.3f}" in shown and f"{a:+.3f}" in shown
    assert ", ".join(f"{r:.3f}" for r in returns[0].tolist()) in "\n".join(shown)
    # the order of computation runs from the last token back
    order = [t for t in shown if t.startswith("computed ")]
    assert order[-1] == "computed 1st" and order[0] == f"computed {len(ex['rewards'])}th"


def test_pipeline_7b_shows_the_configs_stages_folders_and_markers():
    from marlhf_edu.stages.pipeline import MARKER, STARTED
    from marlhf_edu.training.pipeline_file import STAGES

    spec = yaml.safe_load((ROOT / "configs/llama2_7b/pipeline.yaml").read_text())
    fig = diagrams.pipeline_7b()
    text = "\n".join(figure_texts(fig))
    assert [s[0] for s in diagrams.PIPELINE_STAGES] == list(spec["stages"])
    for i, (stage, config_path) in enumerate(spec["stages"].items()):
        assert stage in STAGES
        assert f"{i + 1}. {stage}" in text and f"marlhf-edu {stage}\n{config_path}" in text
        output_dir = yaml.safe_load((ROOT / config_path).read_text())["output_dir"]
        assert f"{output_dir}/" in text, output_dir
    for name in (MARKER, STARTED, ".lock"):
        assert name in text
    # what the MA-PPO stage writes, by the names the engine uses
    trainer = (ROOT / "marlhf_edu/ppo/trainer.py").read_text()
    assert '"metrics.jsonl"' in trainer and '"checkpoints"' in trainer
    assert 'out / "policy"' in (ROOT / "marlhf_edu/ppo/run.py").read_text()
    for name in ("metrics.jsonl", "checkpoints/", "policy/"):
        assert name in text
    # evaluate and merge: their commands' own example folders and the files evaluate writes
    evaluate = (ROOT / "marlhf_edu/stages/evaluate.py").read_text()
    merge = (ROOT / "marlhf_edu/stages/merge.py").read_text()
    assert "--output_dir runs/llama2_7b/eval" in evaluate and "--output_dir runs/llama2_7b/merged" in merge
    for name in ("eval_metrics.json", "eval_samples.jsonl"):
        assert f'"{name}"' in evaluate and name in text
    assert "runs/llama2_7b/eval/" in text and "runs/llama2_7b/merged/" in text
