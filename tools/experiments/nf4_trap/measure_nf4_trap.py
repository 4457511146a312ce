"""Measure bitsandbytes' CPU repacking trap on the engine, with and without `keep_nf4_trainable`.

    python tools/experiments/nf4_trap/measure_nf4_trap.py [--out benchmarks/nf4_trap.json]

The tiny MA-PPO backend (NF4, value adapter) runs one 16-rollout no-grad rollout, then the PPO loss of that
batch is backpropagated; its LoRA gradients are compared with those of a backend that never ran the rollout
(same batch). Without the guard, on a CPU with AVX512-BF16, bitsandbytes has repacked the 4-bit weights during
the rollout and gradients through them are cut. On other CPUs both runs agree: the file records which CPU it was.
Chapter 10 and site/engine.md quote the numbers.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import tempfile
from unittest import mock

ROOT = pathlib.Path(__file__).resolve().parents[3]  # tools/experiments/<experiment>/<script>.py
WATCHED = ("layers.0.mlp.gate_proj.lora_B.policy", "layers.0.mlp.down_proj.lora_B.policy",
           "layers.3.self_attn.q_proj.lora_B.policy")


def gradient_norms(guard: bool) -> dict:
    import torch

    import marlhf_edu.ppo.multi_adapter as ma
    from marlhf_edu.data.toyworld import ToyWorld
    from marlhf_edu.ppo import PPOConfig, PPOTrainer
    from marlhf_edu.teaching.book import quietly

    config = PPOConfig(load_in_4bit=True, value_mode="adapter", batch_size=16, mini_batch_size=16,
                       micro_batch_size=16, forward_batch_size=16, max_new_tokens=16, device="cpu", eval_repeats=0,
                       output_dir=tempfile.mkdtemp())
    prompts = [p.prompt for p in ToyWorld().train_prompts]

    def norms(rollout=None):
        torch.manual_seed(0)
        with quietly():
            backend = ma.MultiAdapterBackend.from_config(config)
        trainer = PPOTrainer(backend, config, prompts)
        if rollout is None:
            rollout = trainer.rollout(trainer.batch_prompts(0))
        loss, _ = trainer.micro_batch_loss(rollout, slice(None))
        loss.backward()
        return rollout, {n: p.grad.norm().item() for n, p in backend.model.named_parameters() if p.grad is not None}

    with mock.patch.object(ma, "keep_nf4_trainable", (lambda model: 0) if not guard else ma.keep_nf4_trainable):
        rollout, after = norms()  # this backend ran the no-grad rollout
        _, fresh = norms(rollout)  # this one never ran a no-grad forward
    off = sum(abs(after[n] - fresh[n]) > 0.01 * fresh[n] for n in fresh)
    return {"watched": {w: {"fresh": fresh[n], "after_rollout": after[n]} for w in WATCHED
                        for n in fresh if w in n},
            "lora_gradients": len(fresh), "more_than_1pct_off": int(off)}


def main() -> None:
    import bitsandbytes
    import bitsandbytes.functional as F
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "nf4_trap.json"))
    args = parser.parse_args()
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "avx512bf16": bool(F.has_avx512bf16()),
                          "torch": torch.__version__, "bitsandbytes": bitsandbytes.__version__},
              "unguarded": gradient_norms(guard=False), "guarded": gradient_norms(guard=True)}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
