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
from marlhf_edu.ppo.run import print_evaluation, run
from marlhf_edu.training.args import parse_stage_args


def main(argv: list[str] | None = None, backend_factory=None, progress: bool = True):
    """`marlhf-edu ppo` (four models); `marlhf-edu ma-ppo` runs the same with `MultiAdapterBackend`
    (`backend_factory`, as `ppo.run.run` takes it)."""
    (config,) = parse_stage_args((PPOConfig,), argv)
    result = run(config, backend_factory, progress=progress)
    print_evaluation(result, config)
    return result
