"""Multi-adapter PPO: one base model (optionally 4-bit NF4) plays all four roles.

- `policy`  — a trainable LoRA adapter (causal LM);
- value     — `shared`: a scalar head on the policy adapter's last hidden state (one forward
              gives logits and values, MA-RLHF's choice); `adapter`: its own trainable LoRA
              adapter `value` plus a head (a separate critic, a second forward);
- `reward`  — the frozen reward-model adapter of chapter 08, with its score head;
- reference — the same base with every adapter disabled.

Three library traps handled here:

1. Loading a SEQ_CLS adapter into a causal-LM model silently drops its `score`
   weights (the causal LM has no `score` module). The head is read from the
   adapter file explicitly, and loading fails if it is missing.
2. `set_adapter` changes which parameters require gradients (it marks the active
   adapter trainable and freezes the others). Every switch goes through
   `_use_adapter`, which restores the trainable set afterwards and checks it.
3. bitsandbytes repacks a 4-bit base for CPU inference on its first no-grad eval
   forward (AVX512-BF16 CPUs), after which no gradient flows through it: the
   base is guarded by `keep_nf4_trainable` before anything runs
   (`marlhf_edu.loading.quantization`).

Taught in chapter 10.
"""

from __future__ import annotations

import contextlib
import pathlib

import torch

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.adapters import RewardAdapter, check_pad_token
from marlhf_edu.loading.onednn import use_onednn
from marlhf_edu.loading.quantization import dequantize_once, keep_nf4_trainable, nf4_loading_kwargs
from marlhf_edu.loading.quiet import quiet_loading
from marlhf_edu.loading.sources import (adapter_fits, align_pad, load_tokenizer, resolve_model, resolve_zoo,
                                        same_model_path)
from marlhf_edu.math.masked import last_valid_index
from marlhf_edu.math.scoring import position_ids_from_mask
from marlhf_edu.ppo.backends import (PPOBackend, head_logits, require_fp32, response_logprobs, response_values,
                                     sample, split_causal_lm, value_head)
from marlhf_edu.ppo.checkpointing import enable_checkpointing
from marlhf_edu.ppo.config import DEFAULT_ADAPTER_RANK

VALUE_MODES = ("shared", "adapter")


#: why `old_logprobs: sampler` is refused here (`check_config`, `sampler_value_head`)
SAMPLER_NEEDS_SHARED_VALUE = ("old_logprobs: sampler reads the values from the sampler's hidden states: it needs "
                              "value_mode: shared (value_mode: adapter runs its own forward for them)")


def _check_value_options(value_mode: str, critic_init: str) -> None:
    if value_mode not in VALUE_MODES:
        raise ConfigError(f"value_mode must be one of {VALUE_MODES}, got {value_mode!r}")
    if critic_init == "reward_model" and value_mode != "adapter":
        raise ConfigError("critic_init: reward_model needs value_mode: adapter (the value adapter starts as a copy "
                          "of the reward adapter); a shared head reads the policy's features, not the reward's")


class MultiAdapterBackend(PPOBackend):
    """One (optionally quantized) base with `policy`, `reward` and optionally `value` adapters."""

    shares_base = True

    def __init__(self, base, tokenizer, reward_adapter: RewardAdapter | str | pathlib.Path, *, value_mode: str = "shared",
                 lora_r: int = 16, lora_alpha: int = 16, target_modules=None, seed: int = 0, critic_init: str = "zero",
                 merged_reward: bool = False):
        """`reward_adapter`: as `from_config` resolved and checked it, or an adapter folder (its head found and
        checked when it is read). `merged_reward`: score from the merged rollout copy with the reward adapter
        merged in (`scores`; needs `use_merged_rollout`)."""
        from peft import LoraConfig, get_peft_model

        if not isinstance(reward_adapter, RewardAdapter):
            reward_adapter = RewardAdapter(pathlib.Path(reward_adapter), base.config.name_or_path, head_key=None)

        check_pad_token(tokenizer)
        _check_value_options(value_mode, critic_init)
        # more embedding rows than tokenizer ids is common (Qwen2.5-7B pads 151,665 ids to 152,064 rows); fewer is not
        if base.config.vocab_size < len(tokenizer):
            raise ConfigError(f"the tokenizer has {len(tokenizer)} ids but the base embeds only {base.config.vocab_size}: "
                              "ids past the embedding would fail or read another row")
        self.tokenizer, self.value_mode, self.merged_reward = tokenizer, value_mode, merged_reward
        keep_nf4_trainable(base)
        base.requires_grad_(False)
        lora = dict(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0,
                    target_modules=list(target_modules or ["q_proj", "k_proj", "v_proj", "o_proj",
                                                           "gate_proj", "up_proj", "down_proj"]))
        torch.manual_seed(seed)
        self.model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **lora), adapter_name="policy")
        reward_adapter_dir = reward_adapter.folder
        with quiet_loading(), adapter_fits(reward_adapter_dir, base.config.name_or_path):
            if value_mode == "adapter" and critic_init == "reward_model":  # a trainable copy of the reward adapter
                self.model.load_adapter(str(reward_adapter_dir), adapter_name="value", is_trainable=True)
            elif value_mode == "adapter":
                self.model.add_adapter("value", LoraConfig(task_type="CAUSAL_LM", **lora))
            self.model.load_adapter(str(reward_adapter_dir), adapter_name="reward", is_trainable=False)
        hidden = base.config.hidden_size
        self.device = next(base.parameters()).device
        self.reward_head = reward_adapter.score_head(hidden).to(self.device)
        self.value_head = value_head(hidden).to(self.device)
        if critic_init == "reward_model":
            with torch.no_grad():
                self.value_head.weight.copy_(self.reward_head.weight)
        self.model.set_adapter("policy")
        self._trainable = self._expected_trainable()
        self._restore_trainable()
        self.model.eval()

    @classmethod
    def check_config(cls, config) -> None:
        if config.critic != "separate":
            raise ConfigError(f"critic: {config.critic} is a four-model option; multi-adapter PPO picks its critic with "
                              "value_mode ('shared': a head on the policy adapter, 'adapter': its own LoRA)")
        if config.merged_reward and not config.merged_rollout:
            raise ConfigError("merged_reward: multi-adapter PPO's reward adapter shares the policy's base, so it is "
                              "merged into the merged_rollout copy between samples, never into the base: it needs "
                              "merged_rollout: true")
        _check_value_options(config.value_mode, config.critic_init)
        if config.old_logprobs == "sampler" and config.value_mode != "shared":
            raise ConfigError(SAMPLER_NEEDS_SHARED_VALUE)

    @classmethod
    def resolve_reward(cls, config) -> RewardAdapter:
        """The reward adapter goes on the policy's own base: a `reward_base_path` naming another model is refused."""
        sft = resolve_zoo(config.sft_model_path)
        if config.reward_base_path and not same_model_path(config.reward_base_path, sft):
            raise ConfigError(f"reward_base_path={config.reward_base_path!r} differs from sft_model_path={str(sft)!r}: "
                              "multi-adapter PPO puts the reward adapter on the policy's own base, so a reward adapter "
                              "trained on another base would score with weights it never saw. Train the reward model on "
                              "the SFT model (or use the four-model `ppo` command, which loads the reward base separately)")
        return RewardAdapter.resolve(config.reward_adapter_path, sft, base_named=bool(config.reward_base_path))

    @classmethod
    def from_config(cls, config, reward: RewardAdapter | None = None) -> "MultiAdapterBackend":
        """One base and its adapters for `config`. `reward` is the reward adapter as `run` resolved and checked it
        before anything loaded; without one, the config is checked and the adapter resolved here."""
        from transformers import AutoModelForCausalLM

        if reward is None:
            cls.check_config(config)
            reward = cls.resolve_reward(config)
        sft = resolve_zoo(config.sft_model_path)
        device = config.resolved_device
        kwargs = nf4_loading_kwargs(device, config.double_quant, config.nf4_compute_dtype) if config.load_in_4bit else {}
        tokenizer = load_tokenizer(sft)
        with quiet_loading():
            base = align_pad(AutoModelForCausalLM.from_pretrained(resolve_model(sft), **kwargs), tokenizer)
        if not kwargs:
            base = base.to(device)
        require_fp32({"base": base}, config)
        if config.nf4_dequantize_once:
            dequantize_once(base, onednn=config.onednn_matmuls)
        if config.onednn_matmuls:  # the base's plain linears (the LM head; every layer of a dense base), adapters not yet on
            use_onednn(base)
        return cls(base, tokenizer, reward, value_mode=config.value_mode, lora_r=config.actor_lora_r or DEFAULT_ADAPTER_RANK,
                   lora_alpha=config.actor_lora_alpha, target_modules=config.lora_target_modules, seed=config.seed,
                   critic_init=config.critic_init, merged_reward=config.merged_reward)

    # ---- the trainable set, guarded ----------------------------------------------------------

    def _expected_trainable(self) -> set[str]:
        names = {n for n, _ in self.model.named_parameters() if ".lora_" in n and ".policy." in n}
        if self.value_mode == "adapter":
            names |= {n for n, _ in self.model.named_parameters() if ".lora_" in n and ".value." in n}
        return names

    def _restore_trainable(self) -> None:
        for name, p in self.model.named_parameters():
            p.requires_grad_(name in self._trainable)
        self.value_head.requires_grad_(True)
        self.reward_head.requires_grad_(False)
        self.check_trainable()

    def check_trainable(self) -> None:
        """Raise if anything but the policy (and value) adapters and the value head would train."""
        actual = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if actual != self._trainable:
            raise RuntimeError(f"trainable parameters changed: unexpected {sorted(actual - self._trainable)[:3]}, "
                               f"missing {sorted(self._trainable - actual)[:3]}")
        if not self._trainable:
            raise RuntimeError("no trainable policy adapter parameters")

    @contextlib.contextmanager
    def _use_adapter(self, name: str):
        self.model.set_adapter(name)
        try:
            yield
        finally:
            self.model.set_adapter("policy")
            self._restore_trainable()

    def enable_gradient_checkpointing(self):
        # a layer is recomputed in the backward, when `policy` is active again: replay it under the adapter that
        # was active in its forward, or the value adapter would receive gradients computed through the policy's
        self._checkpointed = (enable_checkpointing(self.model, recompute_context=self._replay_adapter),)

    def _replay_adapter(self):
        active = self.model.active_adapter
        return contextlib.nullcontext() if active == "policy" else self._use_adapter(active)

    # ---- the four questions ---------------------------------------------------------------------

    def _hidden(self, input_ids, attention_mask):
        backbone = self.model.get_base_model().model
        return backbone(input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state

    def _logits(self, hidden, n_response, temperature):
        lm_head = self.model.get_base_model().lm_head
        # divided in place: the head's (B, R, V) output is new and its backward needs only the head's input
        return head_logits(lm_head, hidden, n_response).float().div_(temperature)

    def generate(self, input_ids, attention_mask, **sampling):
        return sample(self.sampling_model(), self.tokenizer, input_ids, attention_mask, **sampling)

    def sampler_value_head(self):
        if self.value_mode != "shared":
            raise ConfigError(SAMPLER_NEEDS_SHARED_VALUE)
        return self.value_head

    def lora_policy(self):
        return self.model, "policy"

    def export_policy(self, out_dir):
        import shutil
        import tempfile

        out_dir = pathlib.Path(out_dir)
        with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
            self.model.save_pretrained(tmp, selected_adapters=["policy"])  # peft writes a named adapter to tmp/policy
            shutil.rmtree(out_dir, ignore_errors=True)
            shutil.move(str(pathlib.Path(tmp) / "policy"), str(out_dir))
        self.tokenizer.save_pretrained(str(out_dir))

    def policy_forward(self, input_ids, attention_mask, n_response, temperature, with_entropy=False):
        hidden = self._hidden(input_ids, attention_mask)  # policy adapter active
        logprobs, entropy = response_logprobs(self._logits(hidden, n_response, temperature), input_ids, with_entropy)
        if self.value_mode == "shared":
            value_hidden = hidden
        else:
            with self._use_adapter("value"):
                value_hidden = self._hidden(input_ids, attention_mask)
        values = self.value_head(value_hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        return logprobs, response_values(values, n_response), entropy

    @contextlib.contextmanager
    def adapters_off(self):
        """The base alone, for the reference: every adapter layer off, then on again with the trainable set restored.
        Turning them on goes through peft's `set_adapter` of the active adapter, which freezes every other adapter;
        peft's `disable_adapter` context stops there (the value adapter would stay frozen until the next switch),
        and first reads the status of every adapter layer: 13 ms a call against 8 ms for this one on the tiny model
        (cProfile, 5 steps)."""
        self.model.base_model.disable_adapter_layers()
        try:
            yield
        finally:
            self.model.base_model.enable_adapter_layers()
            self._restore_trainable()

    @torch.no_grad()
    def reference_logprobs(self, input_ids, attention_mask, n_response, temperature):
        with self.adapters_off():
            logits = self._logits(self._hidden(input_ids, attention_mask), n_response, temperature)
        return response_logprobs(logits, input_ids)[0]

    @torch.no_grad()
    def scores(self, input_ids, attention_mask):
        if self.merged_reward:  # the dense copy with the frozen reward adapter merged: one matmul per layer, not three
            if self._merged is None:
                raise RuntimeError("merged_reward scores from the merged rollout copy: call use_merged_rollout first")
            if self._merged.holds != "reward":
                self._merged.refresh("reward")  # the next sample merges the policy back (`sampling_model`)
            backbone, _ = split_causal_lm(self._merged.model)
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
        else:
            with self._use_adapter("reward"):
                hidden = self._hidden(input_ids, attention_mask)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = hidden[rows, last_valid_index(attention_mask)]
        return self.reward_head(last.to(self.reward_head.weight.dtype)).squeeze(-1).float()

    # ---- parameters -----------------------------------------------------------------------------

    def parameter_groups(self):
        named = dict(self.model.named_parameters())
        policy = [named[n] for n in sorted(self._trainable) if ".policy." in n]
        value = [named[n] for n in sorted(self._trainable) if ".value." in n] + list(self.value_head.parameters())
        return {"policy": policy, "value": value}

    def trainable_state_dict(self):
        named = dict(self.model.named_parameters())
        out = {f"model.{n}": named[n].detach() for n in sorted(self._trainable)}
        out.update({f"value_head.{n}": p.detach() for n, p in self.value_head.named_parameters()})
        return out

    def load_trainable_state_dict(self, state):
        current = self.trainable_state_dict()
        if set(current) != set(state):
            raise KeyError(f"checkpoint does not match the adapters: missing {sorted(set(current) - set(state))[:3]}, "
                           f"unexpected {sorted(set(state) - set(current))[:3]}")
        with torch.no_grad():
            for name, tensor in current.items():
                tensor.copy_(state[name])
        self.policy_changed()

    @property
    def policy_model(self):
        return self.model

    def models(self):
        return self._with_rollout_copy({"base+adapters": self.model, "value_head": self.value_head,
                                        "reward_head": self.reward_head})
