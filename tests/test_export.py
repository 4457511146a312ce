"""A PPO run leaves its trained policy as a model reference; `merge` folds it into its base, checked; `generate`
answers with it."""

import json

import pytest
import torch

from marlhf_edu.cli import main as cli
from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR
from marlhf_edu.loading.models import load_sft_model
from marlhf_edu.ppo import FourModelBackend, PPOConfig, run as ppo_stage
from marlhf_edu.ppo.backends import sequence_logprobs
from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
from marlhf_edu.stages.generate import main as generate
from marlhf_edu.stages.merge import main as merge

SMALL = dict(batch_size=8, mini_batch_size=8, micro_batch_size=8, forward_batch_size=8, max_new_tokens=12,
             total_steps=2, actor_lora_r=8, actor_lora_alpha=16, device="cpu", eval_repeats=0, learning_rate=1e-2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("ma_ppo") / "run"
    config = PPOConfig(output_dir=str(out), load_in_4bit=False, save_steps=1, **SMALL)
    result = ppo_stage.run(config, MultiAdapterBackend.from_config, progress=False)
    return out, result["trainer"]


def test_each_checkpoint_holds_the_policy_at_its_step_as_a_model_reference(trained):
    """A run's answers can be read at any checkpoint, while it runs or after it stopped: `checkpoints/step-N/policy`
    is written as the finished run's `policy/` is, is covered by the checkpoint's checksums, and loads as a model."""
    from safetensors.torch import load_file

    from marlhf_edu.ppo.run_files import verify_checkpoint

    out, trainer = trained
    ckpts = out / "checkpoints"
    weights = {step: load_file(str(ckpts / f"step-{step:06d}" / "policy" / "adapter_model.safetensors"))
               for step in (1, 2)}
    final = load_file(str(out / "policy" / "adapter_model.safetensors"))
    assert weights[2].keys() == final.keys() and all(torch.equal(weights[2][k], final[k]) for k in final)
    assert any(not torch.equal(weights[1][k], final[k]) for k in final)  # step 1's policy, not the final one
    config = json.loads((ckpts / "step-000001" / "policy" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "zoo"
    state = verify_checkpoint(ckpts / "step-000001")
    assert {"policy/adapter_model.safetensors", "policy/adapter_config.json"} <= set(state["sha256"])
    model, _ = load_sft_model(str(ckpts / "step-000001" / "policy"))  # what `generate --model` loads
    assert sum(p.numel() for p in model.parameters()) > 0
    victim = ckpts / "step-000001" / "policy" / "adapter_model.safetensors"
    victim.write_bytes(victim.read_bytes()[:-8] + bytes(8))
    with pytest.raises(ValueError, match="policy/adapter_model.safetensors does not match its recorded sha256"):
        verify_checkpoint(ckpts / "step-000001")


def test_the_run_exports_its_policy_as_an_adapter_on_its_sft_model(trained):
    out, trainer = trained
    policy = out / "policy"
    config = json.loads((policy / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "zoo" and config["task_type"] == "CAUSAL_LM"
    assert (policy / "tokenizer_config.json").exists()
    # as a model reference it is the trained policy: the same log-probs as the training path
    model, _ = load_sft_model(str(policy))
    r = trainer.rollout(trainer.batch_prompts(5))
    with torch.no_grad():
        expected, _, _ = trainer.backend.policy_forward(r.input_ids, r.attention_mask, r.n_response, 1.0)
        got, _ = sequence_logprobs(model, r.input_ids, r.attention_mask, r.n_response, 1.0)
        untrained, _ = sequence_logprobs(load_sft_model()[0], r.input_ids, r.attention_mask, r.n_response, 1.0)
    assert float(((got - expected) * r.response_mask).abs().max()) < 1e-4
    assert float(((untrained - expected) * r.response_mask).abs().max()) > 1e-2  # the run did change the policy


def test_four_model_lora_run_exports_too(tmp_path):
    config = PPOConfig(output_dir=str(tmp_path / "run"), **{**SMALL, "total_steps": 1})
    ppo_stage.run(config, FourModelBackend.from_config, progress=False)
    assert json.loads((tmp_path / "run" / "policy" / "adapter_config.json").read_text())["base_model_name_or_path"] == "zoo"


def test_merge_checks_then_writes(trained, tmp_path, capsys, monkeypatch):
    out, _ = trained
    fp32 = merge(["--adapter", str(out / "policy"), "--output_dir", str(tmp_path / "fp32"), "--dtype", "float32"])
    assert fp32["agreement"] == 1.0 and fp32["max_logprob_gap"] < 1e-4
    assert (tmp_path / "fp32" / "model.safetensors").exists()
    bf16 = merge(["--adapter", str(out / "policy"), "--output_dir", str(tmp_path / "bf16")])
    assert bf16["agreement"] >= 0.95 and bf16["max_logprob_gap"] > fp32["max_logprob_gap"]
    assert "same most likely next token" in capsys.readouterr().out
    # the check can fail: a merge that went wrong (here its output layer negated) is refused and nothing is written
    from peft.tuners.lora import LoraModel

    real_merge = LoraModel.merge_and_unload  # what PeftModel.merge_and_unload reaches

    def wrong_merge(self, *args, **kwargs):
        merged = real_merge(self, *args, **kwargs)
        with torch.no_grad():
            merged.get_output_embeddings().weight.mul_(-1)
        return merged

    monkeypatch.setattr(LoraModel, "merge_and_unload", wrong_merge)
    with pytest.raises(ConfigError, match="disagrees with the adapter"):
        merge(["--adapter", str(out / "policy"), "--output_dir", str(tmp_path / "strict"), "--dtype", "float32"])
    assert not (tmp_path / "strict").exists()
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="--min_agreement in"):  # a demand no merge can meet: refused up front
        merge(["--adapter", str(out / "policy"), "--output_dir", str(tmp_path / "strict"), "--min_agreement", "1.01"])
    with pytest.raises(ConfigError, match="SEQ_CLS adapter is not a language model"):
        merge(["--adapter", str(REWARD_ADAPTER_DIR), "--output_dir", str(tmp_path / "rm")])


def test_generate_answers_with_the_trained_policy(trained, capsys):
    out, _ = trained
    answers = generate(["--model", str(out / "policy"), "--prompt", "What is the capital of France?",
                        "How do I pick a lock?", "--max_new_tokens", "12"])
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    assert "Q: How do I pick a lock?" in capsys.readouterr().out
    assert cli(["generate", "--model", "zoo"]) == 2  # no prompt: a clear error, exit code 2


@pytest.mark.slow
def test_evaluate_a_trained_policy_as_the_engine_evaluates_it(trained, tmp_path):
    """`marlhf-edu evaluate` on the exported policy gives the numbers the engine's own evaluation gives for the
    trained policy (same judge, seed and sampling), and writes every answer."""
    from marlhf_edu.data.toyworld import ToyWorld
    from marlhf_edu.ppo.trainer import evaluate_toy
    from marlhf_edu.stages.evaluate import main as evaluate

    out, trainer = trained
    engine = evaluate_toy(trainer.backend, ToyWorld(), repeats=2, max_new_tokens=12)
    result = evaluate(["--model", str(out / "policy"), "--repeats", "2", "--max_new_tokens", "12",
                       "--output_dir", str(tmp_path / "eval")])
    assert result["judge"] == "toy"  # the toy tokenizer: the toy world judges
    for key in ("harmful_refusal_rate", "benign_accuracy", "benign_over_refusal_rate"):
        assert result[key] == engine[key], key
    assert result["reward_model_score"] == pytest.approx(engine["reward_model_score"], abs=1e-5)
    written = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())
    assert written["answers"] == len((tmp_path / "eval" / "eval_samples.jsonl").read_text().splitlines()) == 136
    with pytest.raises(ConfigError, match="--judge must be one of"):
        evaluate(["--judge", "gold"])


def test_merge_never_overwrites_a_base_named_by_reference(trained, tmp_path, monkeypatch):
    """The policy records its base as `zoo` (the shipped tiny SFT model), not as a path: the merge resolves the
    reference, so the shipped model's folder is refused as output too, --overwrite or not (issue 37 item 8). The
    shipped folder is a copy here, so a broken check cannot damage the real one."""
    import shutil

    from marlhf_edu.loading import sources
    from marlhf_edu.stages.merge import merge_inputs

    out, _ = trained
    policy = out / "policy"
    copy = tmp_path / "tiny_sft"
    shutil.copytree(sources.SFT_DIR, copy)
    monkeypatch.setattr(sources, "SFT_DIR", copy)  # where `zoo` is resolved
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}
    assert merge_inputs(policy) == {policy.resolve(), copy.resolve()}
    with pytest.raises(ConfigError, match="is the adapter or its base"):
        merge(["--adapter", str(policy), "--output_dir", str(copy), "--overwrite", "true", "--dtype", "float32"])
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()} == before


def test_merge_never_overwrites_unless_asked_and_never_its_inputs(trained, tmp_path):
    """Issue 37 item 8: a non-empty output folder is refused without --overwrite, the adapter or its base always;
    the merge is written beside the target and renamed, so no temporary folder is left."""
    out, _ = trained
    policy = out / "policy"
    target = tmp_path / "merged"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not empty; pass --overwrite true"):
        merge(["--adapter", str(policy), "--output_dir", str(target)])
    assert (target / "notes.txt").read_text() == "mine"
    before = {p.name: p.read_bytes() for p in policy.iterdir() if p.is_file()}
    for inside in (policy, policy / "sub", out):  # the adapter, a folder inside it, the run folder holding it
        with pytest.raises(ConfigError, match="is the adapter or its base"):
            merge(["--adapter", str(policy), "--output_dir", str(inside), "--overwrite", "true"])
    assert {p.name: p.read_bytes() for p in policy.iterdir() if p.is_file()} == before
    merge(["--adapter", str(policy), "--output_dir", str(target), "--overwrite", "true", "--dtype", "float32"])
    assert (target / "model.safetensors").exists() and not (target / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no temporary or old folder left beside it
