"""Stage 3: PPO on the SFT model against the reward model.

    marlhf-edu ppo --config configs/tiny_ppo.yaml [--key value ...] [--resume true]

Builds the backend (four separate models here; `ma-ppo` builds one base with
adapters), checks the configuration before any work, evaluates the policy
before and after on the toy world, and trains with `PPOTrainer`: one JSONL
record per step in `output_dir/metrics.jsonl`, checkpoints every `save_steps`.

Taught in chapter 09.
"""

from __future__ import annotations

from marlhf_edu.ppo.config import PPOConfig
from marlhf_edu.ppo.judging import evaluation_table
from marlhf_edu.ppo.run import run
from marlhf_edu.training.args import parse_stage_args


def main(argv: list[str] | None = None, backend_factory=None, progress: bool = True):
    """`marlhf-edu ppo` (four models); `marlhf-edu ma-ppo` runs the same with `MultiAdapterBackend`
    (`backend_factory`, as `ppo.run.run` takes it)."""
    (config,) = parse_stage_args((PPOConfig,), argv)
    result = run(config, backend_factory, progress=progress)
    if result["trainer"].dp.is_main and ("before" in result or "after" in result):
        print(evaluation_table(result.get("before", {}), result.get("after", {})))
        print(f"(the held-out evaluation, and the answers it read: {config.output_dir}/eval.json, eval_samples.jsonl)")
    return result
