"""Memory: measure what tensors really hold (`measure`) and plan it before loading anything (`plan`).

Taught in chapter 02 (log-prob memory), chapter 09 (four models) and chapter 10 (planner vs measurement).
"""

from __future__ import annotations

from marlhf_edu.memory.measure import (cache_bytes, cuda_peak_bytes, decoder_layers, is_adapter_parameter,
                                       layer_state_bytes, logprob_workload, model_state_bytes, ppo_memory,
                                       quant_state_tensors, run_isolated, state_bytes_by_kind, storage_bytes)
from marlhf_edu.memory.plan import (LLAMA_2_7B, MemoryPlan, MemorySettings, ModelShape, PARTS, STATE_PARTS,
                                    memory_table, plan_both, plan_dpo_lora, plan_four_model, plan_grpo_lora,
                                    plan_lora_ppo, plan_multi_adapter)

__all__ = ["cache_bytes", "decoder_layers", "layer_state_bytes", "ppo_memory", "cuda_peak_bytes", "is_adapter_parameter", "logprob_workload", "model_state_bytes", "quant_state_tensors",
           "run_isolated", "state_bytes_by_kind", "storage_bytes", "LLAMA_2_7B", "PARTS", "STATE_PARTS", "MemoryPlan",
           "MemorySettings", "ModelShape", "memory_table", "plan_both", "plan_four_model", "plan_lora_ppo", "plan_multi_adapter", "plan_dpo_lora", "plan_grpo_lora"]
