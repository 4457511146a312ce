"""The toy world, the tokenizer, the shipped tiny models and the stage commands."""

import json
import pathlib

import pytest
import torch

from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR, SFT_DIR
from marlhf_edu.loading.models import load_reward_model, load_sft_model
from marlhf_edu.loading.sources import load_tokenizer
from marlhf_edu.math.scoring import score_texts, sequence_scores


@pytest.fixture(scope="module")
def world():
    return ToyWorld()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def reward_model():
    return load_reward_model()


def test_world_is_deterministic_and_split(world):
    again = ToyWorld()
    assert again.sft_rows() == world.sft_rows() and again.pku_rows() == world.pku_rows()
    assert ToyWorld(ToyWorldConfig(seed=1)).sft_rows() != world.sft_rows()
    train = {p.question for p in world.train_prompts}
    assert not train & {p.question for p in world.eval_prompts}
    assert {p.kind for p in world.eval_prompts} == {"lookup", "sum", "harmful"}


def test_sft_mix_leaves_something_to_fix(world):
    rows = world.sft_rows()
    harmful = [r for r in rows if "without getting caught" in r["prompt"] or "my " in r["prompt"].split("###Question:")[1]]
    complied = sum(r["completion"].startswith(" Sure") for r in harmful) / len(harmful)
    assert 0.45 < complied < 0.65


def test_judge(world):
    benign = next(p for p in world.eval_prompts if p.kind == "sum")
    harmful = next(p for p in world.eval_prompts if p.harmful)
    assert world.judge(benign, benign.answer + " Anything after.") == "correct"
    assert world.judge(benign, "1 plus 1 is 3.") == "wrong"
    assert world.judge(benign, "I can't help with that.") == "refusal"
    assert world.judge(harmful, world.compliance(harmful)) == "complied"
    perfect = world.evaluate(lambda ps: [next(p for p in world.eval_prompts if p.prompt == x).answer or
                                         "I can't help with that." for x in ps])
    assert perfect["benign_accuracy"] == 1 and perfect["harmful_refusal_rate"] == 1
    assert perfect["benign_over_refusal_rate"] == 0


def test_tokenizer_round_trip_and_special_tokens(tokenizer, world):
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    for text in [r["prompt"] + r["completion"] for r in world.sft_rows()[:50]] + ["ünïcödé ✓ 123\n\ttabs"]:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_completion_only_mask_covers_exactly_the_answer(tokenizer):
    from trl import SFTConfig, SFTTrainer

    from marlhf_edu.data import load_sft
    from marlhf_edu.loading.models import tiny_llama

    rows = load_sft([{"instruction": "What is 2 plus 3?", "input": "", "output": "2 plus 3 is 5."}], "alpaca")
    args = SFTConfig(output_dir="/tmp/marlhf-edu-test-sft", max_steps=1, report_to="none", use_cpu=True, bf16=False)
    trainer = SFTTrainer(model=tiny_llama(tokenizer), args=args, train_dataset=rows, processing_class=tokenizer)
    example = trainer.train_dataset[0]
    ids = example["input_ids"]
    labels = example.get("labels") or [i if m else -100 for i, m in zip(ids, example["completion_mask"])]
    trained = [i for i, label in zip(ids, labels) if label != -100]
    assert tokenizer.decode(trained) == " 2 plus 3 is 5.</s>"
    prompt_len = len(tokenizer(rows[0]["prompt"])["input_ids"])
    assert all(label == -100 for label in labels[:prompt_len]) and all(label != -100 for label in labels[prompt_len:])


def test_reward_read_at_last_token_any_padding(reward_model):
    model, tok = reward_model
    texts = ["###System: x\n###Question: What is 1 plus 1?\n###Answer: 1 plus 1 is 2.",
             "###Question: hi\n###Answer: I can't help with that.",
             "short"]
    single = torch.stack([score_texts(model, tok, [t])[0] for t in texts])
    right = score_texts(model, tok, texts, padding_side="right")
    left = score_texts(model, tok, texts, padding_side="left")
    assert torch.allclose(right, single, atol=1e-5) and torch.allclose(left, single, atol=1e-5)
    # and equal to transformers' own pooling (by pad id) on the right-padded batch
    enc = tok([t + tok.eos_token for t in texts], return_tensors="pt", padding=True)
    with torch.no_grad():
        pooled = model(**enc).logits.squeeze(-1)
        assert torch.allclose(sequence_scores(model, enc["input_ids"], enc["attention_mask"]), pooled, atol=1e-5)


def test_shipped_models_meet_quality_targets(world, reward_model):
    metrics = json.loads((SFT_DIR.parent / "zoo_metrics.json").read_text())
    assert metrics["sft"]["benign_accuracy"] >= 0.8
    assert 0.4 <= metrics["sft"]["harmful_compliance_rate"] <= 0.7
    assert metrics["reward_model"]["accuracy"] >= 0.95
    assert metrics["reward_model"]["mean_gap_margin_3"] > metrics["reward_model"]["mean_gap_margin_1"]
    # re-measure the reward model here (loosely), so the stored numbers cannot drift from the shipped files
    from marlhf_edu.training.reward import evaluate_reward_model

    model, tok = reward_model
    fresh = evaluate_reward_model(model, tok, world.eval_pairs(200))
    assert fresh["accuracy"] >= 0.93 and fresh["mean_gap_margin_3"] > fresh["mean_gap_margin_1"]


def test_shipped_sizes():
    total = sum(f.stat().st_size for d in (SFT_DIR, REWARD_ADAPTER_DIR) for f in d.iterdir())
    assert total <= 25 * 2**20


def test_shipped_adapter_names_its_base_relatively(tmp_path):
    import json
    import shutil

    from marlhf_edu.stages.zoo import relative_base_path

    recorded = json.loads((REWARD_ADAPTER_DIR / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert not pathlib.Path(recorded).is_absolute()  # no build machine's path in the package
    assert (REWARD_ADAPTER_DIR / recorded).resolve() == SFT_DIR.resolve()
    # what `zoo rebuild` writes
    shutil.copytree(REWARD_ADAPTER_DIR, tmp_path / "adapter")
    assert relative_base_path(tmp_path / "adapter", tmp_path / "sft") == "../sft"


def test_sft_model_samples_like_the_targets(world):
    from marlhf_edu.stages.zoo import evaluate_sft

    model, tok = load_sft_model()
    metrics = evaluate_sft(model, tok, world, repeats=2)
    assert metrics["benign_accuracy"] >= 0.75 and 0.3 <= metrics["harmful_compliance_rate"] <= 0.8


def test_config_errors_are_clear(tmp_path):
    from trl import ModelConfig, SFTConfig

    from marlhf_edu.cli import main
    from marlhf_edu.errors import ConfigError
    from marlhf_edu.training.args import parse_stage_args
    from marlhf_edu.training.sft import SFTScriptArguments

    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rat: 0.1\noutput_dir: /tmp/x\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'learning_rat'.*did you mean 'learning_rate'"):
        parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig), ["--config", str(bad)])
    with pytest.raises(ConfigError, match="--lora_rank"):
        parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig), ["--output_dir", "/tmp/x", "--lora_rank", "4"])
    with pytest.raises(ConfigError, match="not found"):
        parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig), ["--config", str(tmp_path / "none.yaml")])
    assert main(["sft", "--config", str(bad)]) == 2
    assert main(["nope"]) == 2


def test_reward_stage_refuses_lora_without_trained_head(tmp_path):
    from trl import ModelConfig, RewardConfig

    from marlhf_edu.errors import ConfigError
    from marlhf_edu.training.args import parse_stage_args
    from marlhf_edu.training.reward import RMScriptArguments, run_rm

    args = parse_stage_args((RMScriptArguments, RewardConfig, ModelConfig),
                            ["--config", "configs/tiny_rm.yaml", "--output_dir", str(tmp_path),
                             "--model_name_or_path", str(SFT_DIR), "--lora_modules_to_save", "lm_head"])
    with pytest.raises(ConfigError, match="must include 'score'"):
        run_rm(*args)


@pytest.mark.slow
def test_qlora_is_a_config_switch(tmp_path):
    """The same SFT stage, with load_in_4bit + LoRA, trains on CPU through bitsandbytes."""
    import json

    from trl import ModelConfig, SFTConfig

    from marlhf_edu.loading.assets import TOKENIZER_DIR
    from marlhf_edu.loading.sources import load_tokenizer
    from marlhf_edu.training.args import parse_stage_args
    from marlhf_edu.training.rows import select_rows, load_sft_data
    from marlhf_edu.training.sft import SFTScriptArguments, run_sft

    extra = tmp_path / "extra_rows.jsonl"  # and the stage reads extra_rows_file: one more row than the config's
    args = parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig), [
        "--config", "configs/tiny_sft.yaml", "--model_name_or_path", str(SFT_DIR), "--output_dir", str(tmp_path / "out"),
        "--load_in_4bit", "true", "--use_peft", "true", "--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj",
        "--max_steps", "2", "--logging_steps", "1", "--dtype", "float32", "--extra_rows_file", str(extra)])
    tok = load_tokenizer(TOKENIZER_DIR)
    rows = select_rows(load_sft_data(args[0], tok), tok, args[0], "SFT")
    extra.write_text(json.dumps(rows[0]) + "\n")
    trainer = run_sft(*args)
    assert len(trainer.train_dataset) == len(rows) + 1
    import bitsandbytes as bnb

    assert any(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules())
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
    # the stage guards its 4-bit base: trl's no-grad evaluation passes cannot repack it for CPU inference
    linear4 = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert all(m.support_avx512bf16_for_cpu is False for m in linear4)


@pytest.mark.slow
def test_an_interrupted_zoo_rebuild_leaves_the_installed_assets_as_they_were(tmp_path, monkeypatch):
    """Issue 37 item 15: the rebuild builds beside the assets and swaps at the end."""
    import shutil

    from marlhf_edu.stages import zoo

    out = tmp_path / "assets"
    for name in ("tokenizer", "tiny_sft", "tiny_reward_adapter"):
        shutil.copytree(zoo.ASSETS / name, out / name)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # the reward stage is stopped after the tokenizer and SFT model were rebuilt

    monkeypatch.setattr(zoo, "run_rm", interrupted)  # the reward stage, as the rebuild runs it
    with pytest.raises(KeyboardInterrupt):
        zoo.rebuild(pathlib.Path(__file__).resolve().parent.parent / "configs", out, tmp_path / "work")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir()) == ["tiny_reward_adapter", "tiny_sft", "tokenizer"]


def test_staged_install_swaps_every_entry(tmp_path):
    from marlhf_edu.stages.zoo import staged_install

    out = tmp_path / "assets"
    (out / "a").mkdir(parents=True)
    (out / "a" / "old.txt").write_text("old")
    (out / "keep.txt").write_text("untouched")
    with staged_install(out) as staging:
        (staging / "a").mkdir()
        (staging / "a" / "new.txt").write_text("new")
        (staging / "m.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["a", "keep.txt", "m.json"]
    assert [p.name for p in (out / "a").iterdir()] == ["new.txt"]


def test_a_second_rebuild_of_the_same_assets_is_refused_while_the_first_runs(tmp_path):
    """Issue 37 item 7: two `zoo rebuild`s of one folder removed each other's staging folder."""
    from marlhf_edu.errors import ConfigError
    from marlhf_edu.stages.zoo import staged_install

    out = tmp_path / "assets"
    with staged_install(out) as staging:
        (staging / "a.txt").write_text("first")
        with pytest.raises(ConfigError, match="is being rebuilt by another process"):
            with staged_install(out):
                pass
        assert (staging / "a.txt").read_text() == "first"  # the first rebuild's work is untouched
    assert (out / "a.txt").read_text() == "first" and sorted(p.name for p in out.iterdir()) == ["a.txt"]
    with staged_install(out):  # released at the end: the next rebuild goes ahead
        pass
