"""Stage 3, multi-adapter: the same PPO loop on one base model with adapters.

    marlhf-edu ma-ppo --config configs/tiny_ma_ppo.yaml [--key value ...] [--resume true]

Everything `marlhf-edu ppo` does (metrics, evaluation, checkpoints, resume,
config checks) holds here; only the backend differs. Taught in chapter 10.
"""

from __future__ import annotations


def main(argv: list[str] | None = None, progress: bool = True):
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
    from marlhf_edu.stages import ppo

    return ppo.main(argv, backend_factory=MultiAdapterBackend.from_config, progress=progress)
