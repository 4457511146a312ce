"""Stage 3, multi-adapter: the same PPO loop on one base model with adapters.

    marlhf-edu ma-ppo --config configs/tiny_ma_ppo.yaml [--key value ...] [--resume true]

Everything `marlhf-edu ppo` does (metrics, evaluation, checkpoints, resume,
config checks) holds here; only the backend differs. Taught in chapter 09.
"""

from __future__ import annotations

import json


def main(argv: list[str] | None = None):
    from marlhf_edu.ppo import PPOConfig
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
    from marlhf_edu.stages.common import parse_stage_args
    from marlhf_edu.stages.ppo import run

    (config,) = parse_stage_args((PPOConfig,), argv)
    result = run(config, backend_factory=MultiAdapterBackend.from_config)
    for key in ("before", "after"):
        if key in result:
            print(key, json.dumps({k: round(v, 4) for k, v in result[key].items()}))
    return result
