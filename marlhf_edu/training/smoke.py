"""The 7B recipe at Llama-2-7B's widths on a CPU: what CI (tests/test_pipeline_7b.py) and chapter 15 run.

`write_smoke_pipeline(root)` saves a random bf16 model of Llama-2-7B's widths with `num_layers` layers (and its
32,000-token synthetic tokenizer), rows in PKU-SafeRLHF's schema written in that tokenizer's words, and a pipeline
file that runs `configs/llama2_7b/pipeline.yaml`'s three stage configs with `smoke_overrides`: only the model and
data (the gated model and PKU-SafeRLHF cannot be downloaded offline), the CPU switches, steps, batch shapes and
lengths change. Everything else — NF4 with double quantization, bf16 compute, LoRA r = 64 / 32 on q/k/v/o,
gradient checkpointing, the learning rates — is the recipe. Taught in chapter 15.
"""

from __future__ import annotations

import json
import pathlib
import random
from dataclasses import replace

from marlhf_edu.memory.check import build_random_llama
from marlhf_edu.memory.plan import LLAMA_2_7B


def pku_schema_rows(n: int, seed: int = 0, vocab_size: int = 32000, prompt_words: tuple[int, int] = (5, 20),
                    answer_words: tuple[int, int] = (3, 20)) -> list[dict]:
    """`n` rows with PKU-SafeRLHF's fields, their texts made of the synthetic tokenizer's words (`w4` … ); each
    prompt and answer has a number of words drawn from `range(*prompt_words)` / `range(*answer_words)`."""
    rng = random.Random(seed)

    def words(k):
        return " ".join(f"w{rng.randrange(4, vocab_size)}" for _ in range(k))

    rows = []
    for _ in range(n):
        safe = [rng.random() < 0.6, rng.random() < 0.6]
        rows.append({"prompt": words(rng.randrange(*prompt_words)), "response_0": words(rng.randrange(*answer_words)),
                     "response_1": words(rng.randrange(*answer_words)), "prompt_source": "synthetic",
                     "response_0_source": "synthetic", "response_1_source": "synthetic",
                     "is_response_0_safe": safe[0], "is_response_1_safe": safe[1],
                     "response_0_severity_level": 0 if safe[0] else 2, "response_1_severity_level": 0 if safe[1] else 1,
                     "better_response_id": rng.randrange(2), "safer_response_id": rng.randrange(2)})
    return rows


def smoke_overrides(model_dir, data, out) -> dict:
    """Per stage, the keys a CPU smoke run changes in the 7B configs (2 steps each, small batches, short texts)."""
    cpu_train = dict(dataset_name=str(data), use_cpu=True, max_steps=2, per_device_train_batch_size=2,
                     gradient_accumulation_steps=1, max_length=64, max_tokens=64, save_steps=1, logging_steps=1)
    out = pathlib.Path(out)
    return {
        "sft": dict(model_name_or_path=str(model_dir), output_dir=str(out / "sft"), **cpu_train),
        "rm": dict(output_dir=str(out / "rm"), per_device_eval_batch_size=4, eval_pairs=4, **cpu_train),
        "ma-ppo": dict(dataset_name=str(data), device="cpu", total_steps=2, batch_size=2, mini_batch_size=2,
                       micro_batch_size=1, forward_batch_size=2, max_new_tokens=8, output_dir=str(out / "ma_ppo")),
    }


def write_pipeline(path, overrides: dict, repo=".", pipeline: str = "configs/llama2_7b/pipeline.yaml") -> pathlib.Path:
    """`pipeline` (its stage configs made absolute under `repo`) with `overrides`, written to `path`."""
    import yaml

    repo = pathlib.Path(repo).resolve()
    spec = yaml.safe_load((repo / pipeline).read_text())
    spec["stages"] = {name: str(repo / config) for name, config in spec["stages"].items()}
    spec["overrides"] = overrides
    path = pathlib.Path(path)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))  # the stage order is the run order
    return path


def write_smoke_pipeline(root, num_layers: int = 2, rows: int = 24, repo=".") -> dict:
    """Model, data and pipeline file of the smoke run under `root`; returns their paths (`model`, `data`, `out`,
    `pipeline`), the `overrides` and the model's `shape`."""
    import torch

    root = pathlib.Path(root)
    shape = replace(LLAMA_2_7B, name=f"llama-2-7b, {num_layers} layers", num_layers=num_layers)
    model_dir, _ = build_random_llama(shape, root, reward=False, dtype=torch.bfloat16)
    data = root / "pku_saferlhf.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pku_schema_rows(rows)))
    overrides = smoke_overrides(model_dir, data, root / "run")
    path = write_pipeline(root / "pipeline.yaml", overrides, repo)
    return {"model": model_dir, "data": data, "out": root / "run", "pipeline": path, "overrides": overrides,
            "shape": shape}
