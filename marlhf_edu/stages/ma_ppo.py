"""Stage 3, multi-adapter: the same PPO loop on one base model with adapters.

    marlhf-edu ma-ppo --config configs/tiny_ma_ppo.yaml [--key value ...] [--resume true]

Everything `marlhf-edu ppo` does (metrics, evaluation, checkpoints, resume,
config checks) holds here; only the backend differs. Taught in chapter 10.
"""

from __future__ import annotations

from marlhf_edu.ppo.config import PPOConfig
from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
from marlhf_edu.ppo.run import print_evaluation, run
from marlhf_edu.training.args import parse_stage_args


def main(argv: list[str] | None = None, progress: bool = True):
    (config,) = parse_stage_args((PPOConfig,), argv)
    result = run(config, MultiAdapterBackend, progress=progress)
    print_evaluation(result, config)
    return result
