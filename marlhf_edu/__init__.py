"""marlhf_edu — the verified code behind the RLHF-PPO / MA-PPO textbook.

Importing the package is light: only torch is needed for the math below.
Training stages (transformers, trl, peft) live in sub-modules that are
imported on demand.
"""

from __future__ import annotations

from marlhf_edu.loading.mkl_vml import resolve_vml_dispatch
from marlhf_edu.loading.quantization import quiet_bitsandbytes_cpu_notice
from marlhf_edu.math.gae import gae_advantages, gae_advantages_reference
from marlhf_edu.math.kl import AdaptiveKLController, FixedKLController, kl_penalty, token_level_rewards
from marlhf_edu.math.logprobs import entropy_from_logits, logprobs_from_logits
from marlhf_edu.math.masked import last_valid_index, masked_mean, masked_var, masked_whiten
from marlhf_edu.math.policy_gradient import (effective_sample_size, importance_weights, leave_one_out_baseline,
                                             reinforce_loss)
from marlhf_edu.math.ppo_objective import policy_loss, ppo_loss, value_loss
from marlhf_edu.math.reward import llama2_reward_select, pairwise_reward_loss

# Before any parallel cos, exp, log, ...: oneMKL chooses each function's kernel at its first call, and a first call
# on several threads at once can compute one thread's chunk at low accuracy (loading/mkl_vml.py).
resolve_vml_dispatch()
# Before peft/trl import bitsandbytes: its CPU-kernel notice would reach stored outputs on some CPUs only.
quiet_bitsandbytes_cpu_notice()

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "last_valid_index",
    "pairwise_reward_loss",
    "llama2_reward_select",
    "logprobs_from_logits",
    "entropy_from_logits",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "token_level_rewards",
    "reinforce_loss",
    "leave_one_out_baseline",
    "importance_weights",
    "effective_sample_size",
    "gae_advantages",
    "gae_advantages_reference",
    "policy_loss",
    "value_loss",
    "ppo_loss",
]
