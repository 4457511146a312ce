"""The DPO and GRPO stages (chapter 12): trl trainers configured as the book needs them."""

import pytest
import torch

from marlhf_edu.errors import ConfigError


def test_reward_model_reward_scores_as_ppo_reads_and_penalises_a_missing_eos():
    from marlhf_edu.data.template import format_completion
    from marlhf_edu.data.toyworld import ToyWorld
    from marlhf_edu.loading.models import load_reward_model
    from marlhf_edu.math.scoring import score_texts
    from marlhf_edu.training.grpo import RewardModelReward

    world = ToyWorld()
    rm, tok = load_reward_model()
    p = world.eval_prompts[0]
    prompts, completions = [p.prompt] * 2, [" " + world.refusal(__import__("random").Random(0)), "no eos here"]
    ids = [tok(c)["input_ids"] + [tok.eos_token_id] for c in completions[:1]] + [tok(completions[1])["input_ids"]]
    reward = RewardModelReward(rm, tok, missing_eos_penalty=5.0)
    got = reward(prompts, completions, ids)
    want = score_texts(rm, tok, [pp + format_completion(c) for pp, c in zip(prompts, completions)])
    assert got[0] == pytest.approx(want[0].item(), abs=1e-5)
    assert got[1] == pytest.approx(want[1].item() - 5.0, abs=1e-5)
    assert reward.__name__ == "reward_model"  # trl names the logged metrics after it


def _args(stage, tmp_path, *extra):
    from marlhf_edu.training.args import parse_stage_args

    if stage == "dpo":
        from trl import DPOConfig as Config, ModelConfig

        from marlhf_edu.training.dpo import DPOScriptArguments as Script
    else:
        from trl import GRPOConfig as Config, ModelConfig

        from marlhf_edu.training.grpo import GRPOScriptArguments as Script
    return parse_stage_args((Script, Config, ModelConfig), ["--config", f"configs/tiny_{stage}.yaml",
                                                            "--output_dir", str(tmp_path), *extra])


def test_stages_refuse_what_the_book_does_not_do(tmp_path):
    from marlhf_edu.training.dpo import run_dpo
    from marlhf_edu.training.grpo import run_grpo

    with pytest.raises(ConfigError, match="use_peft"):
        run_dpo(*_args("dpo", tmp_path, "--use_peft", "false"))
    with pytest.raises(ConfigError, match="CAUSAL_LM"):
        run_grpo(*_args("grpo", tmp_path, "--lora_task_type", "SEQ_CLS"))
    with pytest.raises(ConfigError, match="reward must be one of"):
        run_grpo(*_args("grpo", tmp_path, "--reward", "judge"))
    with pytest.raises(ConfigError, match="toy world's judge"):
        run_grpo(*_args("grpo", tmp_path, "--reward", "gold", "--dataset_name", "prompts.jsonl"))
    with pytest.raises(ConfigError, match="reward_weights"):
        run_grpo(*_args("grpo", tmp_path, "--reward_weights", "1.0"))


def test_grpo_stage_optimises_the_reward_model_and_only_logs_the_judge(tmp_path):
    """The toy judge rides along with weight 0: logged as rewards/gold/mean, absent from the advantages."""
    from marlhf_edu.teaching.book import quietly
    from marlhf_edu.training.grpo import run_grpo

    script, training, model = _args("grpo", tmp_path, "--max_steps", "2", "--per_device_train_batch_size", "8",
                                    "--steps_per_generation", "1", "--num_generations", "4",
                                    "--max_completion_length", "12", "--eval_repeats", "1", "--logging_steps", "1",
                                    "--disable_tqdm", "true")
    torch.manual_seed(0)
    with quietly():
        trainer, metrics = run_grpo(script, training, model)
    assert trainer.reward_weights.tolist() == [1.0, 0.0]
    assert [f.__name__ for f in trainer.reward_funcs] == ["reward_model", "gold"]
    logged = [r for r in trainer.state.log_history if "rewards/gold/mean" in r]
    assert len(logged) == 2 and all(0 <= r["rewards/gold/mean"] <= 1 for r in logged)
    assert all(r["reward"] == pytest.approx(r["rewards/reward_model/mean"], abs=1e-4) for r in logged)
    assert (tmp_path / "adapter_model.safetensors").exists() and (tmp_path / "eval_metrics.json").exists()
    assert len(metrics["samples"]) == 68 and set(metrics) >= {"harmful_refusal_rate", "benign_accuracy", "gold"}


def test_dpo_stage_trains_a_lora_whose_disabled_adapter_is_the_sft_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from marlhf_edu.data.toyworld import ToyWorld
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.teaching.book import quietly
    from marlhf_edu.training.dpo import run_dpo

    script, training, model = _args("dpo", tmp_path, "--max_steps", "2", "--per_device_train_batch_size", "4",
                                    "--eval_repeats", "0", "--disable_tqdm", "true")
    with quietly():
        trainer, metrics = run_dpo(script, training, model, dataset=ToyWorld().preference_dataset().select(range(8)))
    assert metrics == {} and trainer.state.global_step == 2
    policy, sft = trainer.model.eval(), AutoModelForCausalLM.from_pretrained(SFT_DIR).eval()
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad(), policy.disable_adapter():
        assert torch.allclose(policy(input_ids=ids).logits, sft(input_ids=ids).logits, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(policy(input_ids=ids).logits, sft(input_ids=ids).logits, atol=1e-5)


def test_grpo_reads_a_real_dataset_and_never_drops_long_prompts_silently(capsys):
    """Issue 37 item 6: GRPO on any non-toy dataset crashed (its arguments had no drop_long_prompts)."""
    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.loading.sources import load_tokenizer
    from marlhf_edu.training.grpo import GRPOScriptArguments

    tok = load_tokenizer()
    args = GRPOScriptArguments(dataset_name="hh-rlhf-harmless-base", dataset_format="hh-rlhf", skip_bad_rows=True,
                               dataset_split="test", max_prompt_length=48, drop_long_prompts=True)
    prompts = load_prompts(args, tok)
    assert prompts and all(len(ids) <= 48 for ids in tok(prompts)["input_ids"])
    assert "prompts: using" in capsys.readouterr().out  # the drop is counted and said


def test_dpo_and_sft_apply_max_rows_and_refuse_rows_trl_would_cut(tmp_path, monkeypatch, capsys):
    """Issue 37 item 6: DPO ignored --max_rows and --max_tokens; SFT let trl cut over-long rows (EOS and all)
    silently; num_train_epochs 0 saved an untrained model with rc 0. All of it now happens before a model loads."""
    import marlhf_edu.training.dpo as dpo
    from trl import ModelConfig, SFTConfig

    from marlhf_edu.training.args import parse_stage_args
    from marlhf_edu.training.sft import SFTScriptArguments, run_sft

    class Loaded(Exception):
        pass

    def no_model(model_args):
        raise Loaded

    monkeypatch.setattr(dpo, "load_policy", no_model)
    with pytest.raises(Loaded):
        dpo.run_dpo(*_args("dpo", tmp_path, "--max_rows", "8"))
    assert "preference data: using 8 of" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="no rows left after max_tokens=3"):
        dpo.run_dpo(*_args("dpo", tmp_path, "--max_tokens", "3"))
    with pytest.raises(ConfigError, match=r"row\(s\) exceed max_length=8 tokens \(first rows: \[0, 1"):
        dpo.run_dpo(*_args("dpo", tmp_path, "--max_length", "8"))

    sft_args = ["--config", "configs/tiny_sft.yaml", "--output_dir", str(tmp_path / "sft")]
    with pytest.raises(ConfigError, match=r"row\(s\) exceed max_length=8 tokens"):
        run_sft(*parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig), sft_args + ["--max_length", "8"]))
    assert not (tmp_path / "sft").exists()
    with pytest.raises(ConfigError, match="num_train_epochs=0.0 and max_steps=-1: nothing would be trained"):
        parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig), sft_args + ["--num_train_epochs", "0"])
