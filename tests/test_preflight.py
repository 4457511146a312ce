"""`marlhf-edu preflight`: the meta-device check, the per-GPU verdict and the launch it prints, in seconds on CPU."""

import pytest

from marlhf_edu.cli import main as cli
from marlhf_edu.errors import ConfigError
from marlhf_edu.memory.plan import ModelShape
from marlhf_edu.stages import preflight as preflight_module
from marlhf_edu.stages.preflight import main, meta_parameter_count

SEVEN_B = ["--config", "configs/llama2_7b/ma_ppo.yaml", "--model_shape", "llama-2-7b", "--weight_dtype", "bfloat16",
           "--reward_lora_r", "32", "--reward_target_modules", "q_proj", "k_proj", "v_proj", "o_proj"]


def test_meta_device_count_matches_the_planner_with_gqa_and_tied_embeddings():
    smollm2 = ModelShape.from_config({"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                                      "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                                      "tie_word_embeddings": True}, name="smollm2")
    assert meta_parameter_count(smollm2) == smollm2.n_params == 134_515_008
    assert meta_parameter_count(ModelShape.resolve("llama-2-7b")) == 6_738_415_616


def test_7b_recipe_fits_a_24_gb_gpu_and_prints_its_launch(capsys):
    out = main(SEVEN_B + ["--gpu_memory_gib", "24", "--tokens_per_s", "1000"])
    text = capsys.readouterr().out
    assert out["fits"] and out["plan"].peak < 0.9 * 24 * 2**30
    assert out["tokens_per_step"] == 16 * (64 + 256)
    assert ("launch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True marlhf-edu ma-ppo --config "
            "configs/llama2_7b/ma_ppo.yaml") in text  # the cache slack planned assumes expandable segments
    assert "about 5 s a step" in text and "1.4 h for the run" in text  # 5120 tokens / 1000 per s, 1000 steps


def test_the_launch_line_repeats_the_run_settings_given_beside_the_config(capsys):
    # the plan used --micro_batch_size 2 and --max_new_tokens 128: the printed launch must run that, not the file's
    main(SEVEN_B + ["--gpu_memory_gib", "80", "--micro_batch_size", "2", "--max_new_tokens=128", "--output_dir",
                    "runs/my run"])
    launch = [line for line in capsys.readouterr().out.splitlines() if line.startswith("launch:")]
    assert launch == ["launch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True marlhf-edu ma-ppo --config "
                      "configs/llama2_7b/ma_ppo.yaml --micro_batch_size 2 "
                      "--max_new_tokens=128 --output_dir 'runs/my run'"]  # preflight's own options are not repeated


def test_too_small_a_gpu_fails_naming_the_largest_parts(capsys):
    with pytest.raises(ConfigError, match=r"stage ma-ppo needs .* usable on one GPU; its peak is in sampling: lower "
                                          r"forward_batch_size or max_new_tokens \(the KV cache\)"):
        main(SEVEN_B + ["--gpu_memory_gib", "6"])
    assert cli(["preflight", *SEVEN_B, "--gpu_memory_gib", "6"]) == 2


def test_per_rank_plan_and_the_data_parallel_launch_for_several_gpus(capsys):
    one = main(SEVEN_B + ["--gpu_memory_gib", "80"])
    with pytest.raises(ConfigError, match=r"forward_batch_size \(16\) must divide each rank's share of the batch \(8 rows"):
        main(SEVEN_B + ["--gpu_memory_gib", "80", "--num_gpus", "2"])  # per_chunk seeds whole chunks of 16
    two = main(SEVEN_B + ["--gpu_memory_gib", "80", "--num_gpus", "2", "--forward_batch_size", "8"])
    text = capsys.readouterr().out
    assert "8 rollouts per rank" in text
    assert ("launch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True accelerate launch --config_file "
            "configs/accelerate/ddp_4gpu.yaml --num_processes 2 "
            "-m marlhf_edu.cli ma-ppo --config configs/llama2_7b/ma_ppo.yaml") in text
    assert two["plan"].parts["kv_cache"] == one["plan"].parts["kv_cache"] // 2  # each rank samples half the batch
    with pytest.raises(ConfigError, match="split evenly"):
        main(SEVEN_B + ["--gpu_memory_gib", "80", "--num_gpus", "3"])
    with pytest.raises(ConfigError, match="needs rollout_seeding: per_chunk"):
        main(SEVEN_B + ["--gpu_memory_gib", "80", "--num_gpus", "2", "--rollout_seeding", "stream"])


def test_a_shape_the_model_disagrees_with_is_refused(monkeypatch):
    monkeypatch.setattr(preflight_module, "meta_parameter_count", lambda shape: shape.n_params + 1)
    with pytest.raises(ConfigError, match="the meta-device model has"):
        main(SEVEN_B + ["--gpu_memory_gib", "24"])


def _checkpoint(path, vocab_size, pad=None, eos="</s>"):
    """A folder with a tiny Llama config.json and a word-level tokenizer (no weights: preflight reads neither)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "hello", "world"] if pad is None or pad == eos else ["<s>", "</s>", pad, "a"]
    if eos != "</s>":
        words = ["<s>", eos, "a", "b"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=eos,
                                   **({"pad_token": pad} if pad else {}))
    path.mkdir()
    fast.save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size, "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32}))
    return path


def test_preflight_checks_the_real_checkpoint_against_the_plan_and_the_tokenizer(tmp_path, capsys):
    """Issue 34 item 3: the meta-device build only checks the planner against itself. When the checkpoint the run
    loads can be read, its own config.json must have the planned shape and its tokenizer a pad ≠ EOS and no id
    past the embedding; more embedding rows than tokenizer ids (Qwen2.5: 152,064 for 151,665) are fine."""
    base = SEVEN_B + ["--gpu_memory_gib", "24"]
    main(base)  # configs/llama2_7b: runs/llama2_7b/sft is not written yet
    assert "cannot be read here" in capsys.readouterr().out
    ok = _checkpoint(tmp_path / "ok", vocab_size=32000)
    main(base + ["--sft_model_path", str(ok)])
    assert "pad token '<unk>' (not EOS), 5 tokenizer ids within 32000 embedding rows" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="hidden_size: the checkpoint's config.json says 192, the plan 4096"):
        main(base + ["--sft_model_path", "zoo"])  # the shipped tiny model planned as 7B
    short = _checkpoint(tmp_path / "short", vocab_size=4)
    with pytest.raises(ConfigError, match="the tokenizer has 5 tokens but the model embeds 4"):
        main(base + ["--sft_model_path", str(short), "--model_shape", str(short)])
    no_pad = _checkpoint(tmp_path / "no_pad", vocab_size=32000, eos="</eos>")
    with pytest.raises(ConfigError, match="no pad token distinct from EOS"):
        main(base + ["--sft_model_path", str(no_pad)])


def test_preflight_picks_the_largest_micro_batch_that_fits(capsys):
    """The update's rows per forward/backward: the largest divisor of the minibatch whose planned PPO stage fits the
    GPU with the headroom (fewer passes over the weights; on an H100 at 7B one update took 8.2 s at 1, 2.4 s at 4).
    With 4-row sampling forwards the 7B stage needs 7.50 GiB at micro-batch 1, 7.68 at 2 and 8.05 at 4."""
    small = ["--forward_batch_size", "4"]
    picked = {gib: main(SEVEN_B + small + ["--gpu_memory_gib", str(gib)])["micro_batch_size"] for gib in (8.0, 8.3, 80)}
    assert picked == {8.0: 1, 8.3: 2, 80: 4}
    text = capsys.readouterr().out
    assert "micro_batch_size: 1, the largest that divides the minibatch and fits" in text
    assert "micro_batch_size: up to 4 fits (8.05 GiB), the config has 1: pass --micro_batch_size 4" in text
    # only divisors of the minibatch: a 3-row micro-batch would leave a remainder
    need = type("Need", (), {})

    def plan(m):
        n = need()
        n.device = 10 * m
        return n

    assert preflight_module.largest_micro_batch(plan, 6, usable=35)[0] == 3
    assert preflight_module.largest_micro_batch(plan, 4, usable=35)[0] == 2
    assert preflight_module.largest_micro_batch(plan, 4, usable=5)[0] == 1  # nothing fits: 1, and preflight fails


def test_preflight_prints_the_fast_launch_where_it_fits(capsys):
    """The fast sampler (merged copy, compiled static cache, TIS) at the largest micro-batch, planned with the slack
    its CUDA graphs' pool took on an H100 (2.7 GiB, `COMPILED_SAMPLER`): printed for a 40 or 80 GB card, not for a
    24 GB one, and launched under the default allocator it was measured with."""
    from marlhf_edu.stages.preflight import FAST_SAMPLER

    out = main(SEVEN_B + ["--gpu_memory_gib", "80"])
    fast = [line for line in capsys.readouterr().out.splitlines() if line.startswith("launch, fast:")]
    assert out["fast_launch"] == [*FAST_SAMPLER, "--micro_batch_size", "4"]
    assert fast == ["launch, fast: marlhf-edu ma-ppo --config configs/llama2_7b/ma_ppo.yaml --merged_rollout true "
                    "--rollout_cache static --tis_cap 2.0 --micro_batch_size 4"]
    assert main(SEVEN_B + ["--gpu_memory_gib", "24"])["fast_launch"] is None  # 23.2 GiB needed, 22.8 usable
    assert "launch, fast:" not in capsys.readouterr().out
    # a run that already samples so is not offered it again
    assert main(SEVEN_B + ["--gpu_memory_gib", "80", *FAST_SAMPLER])["fast_launch"] is None
