"""`marlhf-edu pipeline` and the 7B-shaped smoke run.

The smoke run takes the 7B recipe (configs/llama2_7b/pipeline.yaml: SFT → RM → MA-PPO, NF4 with double
quantization, bf16 compute, LoRA r = 64 / 32 on q/k/v/o, gradient checkpointing) through every stage on CPU,
on a random model with Llama-2-7B's widths (hidden 4096, MLP 11008, 32 heads, a 32,000-token vocabulary) and
2 layers. Only what a CPU needs is overridden: the model and data (local: the gated model and PKU-SafeRLHF cannot
be downloaded here; rows in PKU-SafeRLHF's schema written in the synthetic tokenizer's words), `use_cpu` /
`device`, steps, batch shapes and sequence lengths. `test_the_smoke_run_keeps_the_recipe` checks that nothing
else differs from the 7B configs. Planned vs measured memory at this width: tests/test_memory_plan.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

from marlhf_edu.errors import ConfigError
from marlhf_edu.stages.pipeline import MARKER, resume_argv
from marlhf_edu.training.pipeline_file import load_pipeline, split_cli, wire
from marlhf_edu.training.smoke import smoke_overrides, write_pipeline, write_smoke_pipeline

ROOT = pathlib.Path(__file__).resolve().parents[1]
PIPELINE = "configs/llama2_7b/pipeline.yaml"
# what the smoke run may change, per stage (everything else must be the 7B recipe)
ALLOWED = {
    "sft": {"model_name_or_path", "dataset_name", "use_cpu", "max_steps", "per_device_train_batch_size",
            "gradient_accumulation_steps", "max_length", "max_tokens", "output_dir", "save_steps", "logging_steps"},
    "rm": {"dataset_name", "use_cpu", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
           "per_device_eval_batch_size", "eval_pairs", "max_length", "max_tokens", "output_dir", "save_steps",
           "logging_steps", "model_name_or_path"},
    "ma-ppo": {"dataset_name", "device", "total_steps", "batch_size", "mini_batch_size", "micro_batch_size",
               "forward_batch_size", "max_new_tokens", "output_dir", "sft_model_path", "reward_adapter_path"},
}


def run_cli(*args, cache, timeout=900):
    """The CLI in a subprocess, its merged-adapter cache in `cache` (the smoke run's own 1.4 GB, deleted with it)."""
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "MARLHF_EDU_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-m", "marlhf_edu.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The whole 7B recipe, SFT → RM → MA-PPO, at Llama-2-7B's widths with 2 layers, on CPU."""
    root = tmp_path_factory.mktemp("smoke7b")
    smoke = write_smoke_pipeline(root, num_layers=2, repo=ROOT)
    return {**smoke, "root": root, "log": run_cli("pipeline", "--config", str(smoke["pipeline"]),
                                                    cache=root / "cache")}


@pytest.mark.slow
def test_the_7b_shaped_pipeline_runs_end_to_end(smoke):
    out = smoke["out"]
    for stage, sub in (("sft", "sft"), ("rm", "rm"), ("ma-ppo", "ma_ppo")):
        marker = json.loads((out / sub / MARKER).read_text())
        assert marker["stage"] == stage and marker["status"] == "ran"
    sft = json.loads((out / "sft" / "adapter_config.json").read_text())
    assert sft["r"] == 64 and sft["lora_alpha"] == 8 and set(sft["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    rm = json.loads((out / "rm" / "adapter_config.json").read_text())
    assert rm["r"] == 32 and rm["task_type"] == "SEQ_CLS" and "score" in rm["modules_to_save"]
    assert rm["base_model_name_or_path"] != str(smoke["model"])  # the reward model starts from the SFT model
    assert json.loads((out / "rm" / "eval_metrics.json").read_text())["n"] == 4
    records = [json.loads(line) for line in (out / "ma_ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(abs(v) < 1e6 for r in records for v in r.values())  # finite, nothing exploded
    policy = json.loads((out / "ma_ppo" / "policy" / "adapter_config.json").read_text())
    assert policy["r"] == 64
    assert "pipeline: rm.model_name_or_path = " + str(out / "sft") in smoke["log"]
    # trl casts QLoRA trainables to bf16 under `bf16: true`; the stages keep adapters and the score head fp32 (issue 34)
    from safetensors import safe_open

    for sub in ("sft", "rm"):
        with safe_open(str(out / sub / "adapter_model.safetensors"), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}, sub


@pytest.mark.slow
def test_the_smoke_run_keeps_the_recipe(smoke):
    """Every stage's parsed config equals the 7B config's, except the keys a CPU smoke run must change."""
    import copy

    stages, _ = load_pipeline(str(ROOT / PIPELINE), [])
    smoke_stages, _ = load_pipeline(str(smoke["pipeline"]), [])
    wire(smoke_stages)
    cpu = {"sft": ["--use_cpu", "true"], "rm": ["--use_cpu", "true"], "ma-ppo": []}
    for plain, changed in zip(stages, smoke_stages):
        plain = copy.copy(plain)
        plain.argv = plain.argv + cpu[plain.name]  # bf16 does not parse on a machine without a GPU otherwise
        a = [dataclasses.asdict(x) for x in plain.parse()]
        b = [dataclasses.asdict(x) for x in changed.parse()]
        differ = {k for x, y in zip(a, b) for k in x if x[k] != y[k]}
        assert differ <= ALLOWED[plain.name] | {"resume_from_checkpoint"}, (plain.name, differ - ALLOWED[plain.name])
        if plain.name == "sft":
            assert b[2]["load_in_4bit"] and b[2]["use_bnb_nested_quant"] and b[1]["bf16"] and b[1]["gradient_checkpointing"]
        if plain.name == "ma-ppo":
            assert b[0]["load_in_4bit"] and b[0]["gradient_checkpointing"] and b[0]["actor_lora_r"] == 64


@pytest.mark.slow
def test_preflight_checks_the_smoke_model(smoke, capsys):
    """The meta-device build of the smoke model's config.json has the parameters the planner counts and the model has."""
    import math

    from safetensors import safe_open

    from marlhf_edu.stages.preflight import main as preflight

    with safe_open(str(smoke["model"] / "model.safetensors"), "pt") as f:
        saved = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    result = preflight(["--config", "configs/llama2_7b/ma_ppo.yaml", "--model_shape", str(smoke["model"]),
                        "--weight_dtype", "bfloat16", "--reward_lora_r", "32", "--reward_target_modules", "q_proj",
                        "k_proj", "v_proj", "o_proj", "--gpu_memory_gib", "24"])
    assert result["meta_params"] == saved == smoke["shape"].n_params
    assert result["fits"]


@pytest.mark.slow
def test_a_stopped_stage_resumes_and_finished_ones_are_skipped(smoke, tmp_path):
    """SFT finished, the reward model stopped after its first checkpoint: the pipeline skips SFT and resumes RM."""
    out = tmp_path / "run"
    shutil.copytree(smoke["out"] / "sft", out / "sft")
    (out / "rm").mkdir(parents=True)
    shutil.copytree(smoke["out"] / "rm" / "checkpoint-1", out / "rm" / "checkpoint-1")
    path = write_pipeline(tmp_path / "pipeline.yaml", smoke_overrides(smoke["model"], smoke["data"], out), ROOT)
    log = run_cli("pipeline", "--config", str(path), "--stages", "sft", "rm", cache=smoke["root"] / "cache")
    assert "pipeline: sft finished earlier" in log
    assert f"pipeline: rm resumes from {out / 'rm' / 'checkpoint-1'}" in log
    marker = json.loads((out / "rm" / MARKER).read_text())
    assert marker["status"] == "resumed"
    state = json.loads((out / "rm" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert log.count("{'loss'") == 1  # it trained step 2 only (trl logs every step here); a fresh start logs two
    assert not (out / "ma_ppo").exists()  # --stages sft rm: the PPO stage was left alone


# ---- the pipeline file and its options, without training ---------------------------------------

def test_the_7b_pipeline_is_wired_and_every_stage_parses():
    stages, rest = load_pipeline(PIPELINE, ["--sft.use_cpu", "true", "--rm.use_cpu", "true", "--ma-ppo.total_steps", "5"])
    assert [s.name for s in stages] == ["sft", "rm", "ma-ppo"] and rest == []
    wiring = wire(stages)
    assert wiring == {"rm.model_name_or_path": "runs/llama2_7b/sft", "ma-ppo.sft_model_path": "runs/llama2_7b/sft",
                      "ma-ppo.reward_adapter_path": "runs/llama2_7b/rm"}
    config = stages[2].parse()[0]
    assert config.total_steps == 5 and config.rollout_seeding == "per_chunk"


def test_a_split_over_ranks_that_ma_ppo_refuses_fails_when_the_stages_parse(monkeypatch):
    """Under `accelerate launch` (WORLD_SIZE set) the MA-PPO stage's split over the ranks is checked when the
    pipeline parses its stages, not after SFT and the reward model have trained: the 7B config's 16 rollouts on 4
    ranks are 4 rows of a 16-row forward chunk, which per_chunk seeding cannot split."""
    monkeypatch.setenv("WORLD_SIZE", "4")  # what accelerate launch sets in every rank
    stages, _ = load_pipeline(PIPELINE, [])
    with pytest.raises(ConfigError, match=r"forward_batch_size \(16\) must divide each rank's share"):
        stages[2].parse()  # the pipeline parses every stage before SFT starts (the test below)
    stages, _ = load_pipeline(PIPELINE, ["--ma-ppo.batch_size", "64"])
    assert stages[2].parse()[0].batch_size == 64  # 16 a rank: one whole chunk


def test_a_mistake_in_the_last_stage_fails_before_any_work(tmp_path):
    from marlhf_edu.stages.pipeline import main

    with pytest.raises(ConfigError, match=r"--totl_steps.*did you mean 'total_steps'"):
        main(["--config", PIPELINE, "--sft.use_cpu", "true", "--rm.use_cpu", "true", "--ma-ppo.totl_steps", "5",
              "--sft.output_dir", str(tmp_path / "sft")])
    assert not (tmp_path / "sft").exists()


def test_a_later_stages_data_file_is_read_before_any_work(tmp_path):
    """Issue 37: the pipeline checked every stage's config and output folder up front but not its data, so a missing
    or malformed prompt file of the PPO stage was found after SFT and the reward model had trained."""
    from marlhf_edu.stages.pipeline import main

    base = ["--config", PIPELINE, "--sft.use_cpu", "true", "--rm.use_cpu", "true", "--sft.output_dir", str(tmp_path / "sft")]
    with pytest.raises(ConfigError, match=r"pipeline: ma-ppo.dataset_name: .*no_such\.jsonl.*nothing was run"):
        main([*base, "--ma-ppo.dataset_name", str(tmp_path / "no_such.jsonl")])
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"pipeline: ma-ppo.dataset_name: .*prompts\.jsonl.*line 2"):
        main([*base, "--ma-ppo.dataset_name", str(bad)])
    with pytest.raises(ConfigError, match=r"pipeline: rm.extra_pairs_file: .*pairs\.jsonl"):
        main([*base, "--rm.extra_pairs_file", str(tmp_path / "pairs.jsonl")])
    with pytest.raises(ConfigError, match=r"pipeline: sft.extra_rows_file: .*rows\.jsonl"):
        main([*base, "--sft.extra_rows_file", str(tmp_path / "rows.jsonl")])
    assert not (tmp_path / "sft").exists()


@pytest.mark.parametrize("spec, match", [
    ({"stages": {"sft": "a.yaml", "dpo": "b.yaml"}}, "unknown stage"),
    ({"stages": {"rm": "a.yaml", "sft": "b.yaml"}}, "run in the order"),
    ({"stages": {"ppo": "a.yaml", "ma-ppo": "b.yaml"}}, "one PPO stage"),
    ({"stages": {"sft": "a.yaml"}, "overrides": {"rm": {"x": 1}}}, "does not run"),
    ({"stage": {"sft": "a.yaml"}}, "a 'stages' mapping"),
])
def test_bad_pipeline_files_are_refused(tmp_path, spec, match):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(ConfigError, match=match):
        load_pipeline(str(path), [])


def test_command_line_overrides_go_to_their_stage():
    per_stage, rest = split_cli(["--sft.max_steps", "3", "--stages", "sft", "rm", "--rm.lora_target_modules", "q_proj",
                                 "v_proj"], ["sft", "rm"])
    assert per_stage == {"sft": ["--max_steps", "3"], "rm": ["--lora_target_modules", "q_proj", "v_proj"]}
    assert rest == ["--stages", "sft", "rm"]
    with pytest.raises(ConfigError, match="no stage 'ppo'"):
        split_cli(["--ppo.total_steps", "1"], ["sft", "rm"])


def test_resume_options_per_stage(tmp_path):
    from marlhf_edu.training.pipeline_file import Stage

    sft, ppo = Stage("sft", "x.yaml", []), Stage("ma-ppo", "y.yaml", [])
    assert resume_argv(sft, tmp_path) == [] and resume_argv(ppo, tmp_path) == []
    for n in (2, 10, 9):
        (tmp_path / f"checkpoint-{n}").mkdir()
        (tmp_path / f"checkpoint-{n}" / "trainer_state.json").write_text("{}")
        (tmp_path / f"checkpoint-{n}" / "adapter_model.safetensors").write_text("")
    assert resume_argv(sft, tmp_path) == ["--resume_from_checkpoint", str(tmp_path / "checkpoint-10")]  # by number
    # killed while saving checkpoint-11 (trl writes trainer_state.json last), and checkpoint-10's state cut short
    (tmp_path / "checkpoint-11").mkdir()
    (tmp_path / "checkpoint-11" / "adapter_model.safetensors").write_text("")
    (tmp_path / "checkpoint-10" / "trainer_state.json").write_text('{"global_step": 1')
    said = []
    assert resume_argv(sft, tmp_path, said.append) == ["--resume_from_checkpoint", str(tmp_path / "checkpoint-9")]
    assert len(said) == 2 and "checkpoint-11 is incomplete (no complete trainer_state.json" in said[0]
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-000002")
    assert resume_argv(ppo, tmp_path) == ["--resume", "true"]


@pytest.mark.slow
def test_evaluate_the_smoke_policy_with_the_keyword_judge(smoke):
    """`marlhf-edu evaluate` on the 7B-shaped run's exported policy and reward adapter (its base read from the
    adapter): the keyword judge's requests and benign questions, every answer scored and written."""
    from marlhf_edu.data.keyword_judge import BENIGN_QUESTIONS

    out = smoke["out"] / "eval"
    run_cli("evaluate", "--model", str(smoke["out"] / "ma_ppo" / "policy"), "--reward_adapter",
            str(smoke["out"] / "rm"), "--prompts", "2", "--repeats", "1", "--max_new_tokens", "4",
            "--output_dir", str(out), cache=smoke["root"] / "cache")
    metrics = json.loads((out / "eval_metrics.json").read_text())
    assert metrics["judge"] == "keyword" and metrics["n_harmful"] == 2 and metrics["n_benign"] == len(BENIGN_QUESTIONS)
    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == metrics["answers"] == 2 + len(BENIGN_QUESTIONS)
    assert all(isinstance(s["reward_model_score"], float) for s in samples)
