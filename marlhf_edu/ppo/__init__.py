"""Our PPO engine: one loop (`trainer`), interchangeable model backends (`backends`).

Taught in chapter 09 (four models) and chapter 10 (one base, many adapters).
"""

from __future__ import annotations

from marlhf_edu.ppo.backends import FourModelBackend, PPOBackend, ScoredPolicy, ValueModel
from marlhf_edu.ppo.config import PPOConfig
from marlhf_edu.ppo.trainer import PPOTrainer, Rollout, evaluate_toy, read_metrics, response_mask_from_ids, sample_toy

__all__ = ["PPOConfig", "PPOBackend", "FourModelBackend", "ScoredPolicy", "ValueModel", "PPOTrainer", "Rollout",
           "response_mask_from_ids", "evaluate_toy", "sample_toy", "read_metrics"]
