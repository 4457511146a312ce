"""The models behind the PPO loop, behind one interface.

The loop (`marlhf_edu.ppo.trainer`) asks four questions of its models:

- `generate`: sample responses to left-padded prompts;
- `policy_forward`: log-probs of the response tokens under the policy, the
  critic's values before each of them, and (optionally) the policy entropy,
  with the graph kept for the PPO update;
- `reference_logprobs`: log-probs under the frozen reference;
- `scores`: the reward model's score of each whole sequence.

`FourModelBackend` answers them with four separate models (actor, critic,
reward model, reference), as in classic RLHF-PPO. The multi-adapter backend of
chapter 10 answers the same questions with one base model and adapters, and
the loop does not change.

Sequences are `(B, P + R)`: P left-padded prompt tokens then R response tokens;
`attention_mask` covers real prompt tokens and the response up to and including
its first EOS. Position ids always come from the mask, so a left-padded prompt
gives the same numbers as the unpadded one.

Taught in chapter 09.
"""

from __future__ import annotations

import torch
from torch import nn

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.adapters import RewardAdapter, check_pad_token, check_same_vocabulary
from marlhf_edu.loading.models import load_reward_model
from marlhf_edu.loading.onednn import use_onednn
from marlhf_edu.loading.quiet import quiet_loading
from marlhf_edu.loading.sources import align_pad, load_tokenizer, resolve_model, resolve_zoo
from marlhf_edu.math.logprobs import entropy_from_logits, logprobs_from_logits
from marlhf_edu.math.scoring import position_ids_from_mask, sequence_scores
from marlhf_edu.ppo.checkpointing import checkpointed, enable_checkpointing
from marlhf_edu.ppo.merged_rollout import MergedPolicy, SampledLogprobs
from marlhf_edu.ppo.token_draw import TOKEN_DRAWS


#: why `old_logprobs: sampler` is refused here (`check_config`, `sampler_value_head`)
SAMPLER_NEEDS_SHARED_HEAD = ("old_logprobs: sampler reads the values from the sampler's hidden states: it needs "
                             "critic: shared_head (a separate critic runs its own backbone for them)")


def require_fp32(models: dict, config) -> None:
    """Refuse, naming the model, any of `models` (name → module) holding floating-point weights other than fp32
    when `config` turns on an option that assumes fp32 arithmetic (`old_logprobs: sampler`: the sampler's numbers
    standing in for the forward's; `onednn_matmuls`: oneDNN's fp32 products). transformers loads a checkpoint saved
    in bf16 as bf16 (its `dtype="auto"`). 4-bit weights are not floats."""
    options = [o for o, on in (("old_logprobs: sampler", config.old_logprobs == "sampler"),
                               ("onednn_matmuls", config.onednn_matmuls)) if on]
    if not options:
        return
    option = " and ".join(options)
    for name, model in models.items():
        found = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                        if p.is_floating_point() and p.dtype != torch.float32})
        if found:
            raise ConfigError(f"{option} needs fp32 weights, and the {name} holds {', '.join(found)} ones (its "
                              "checkpoint's dtype): save the model in fp32, or turn the option off")


def response_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_response: int,
                    temperature: float) -> torch.Tensor:
    """(B, R, V) logits that predict the R response tokens, divided by the sampling temperature.

    Only the R positions before each response token go through the LM head (`logits_to_keep` as positions):
    the prompt's logits are never materialised, which at V = 32000 is most of the memory of a forward pass.
    Given positions, transformers gathers those hidden states into contiguous memory, so the head runs as one
    (B·R, H) product (see `head_logits`).
    """
    length = input_ids.shape[1]
    keep = torch.arange(length - n_response - 1, length - 1, device=input_ids.device)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
                logits_to_keep=keep, use_cache=False)
    return out.logits / temperature


def head_logits(lm_head: nn.Module, hidden: torch.Tensor, n_response: int) -> torch.Tensor:
    """(B, R, V) logits that predict the R response tokens, from the (B, L, H) last hidden states.

    The R positions are copied into contiguous memory before the head: on a non-contiguous (B, R, H) slice
    `torch.matmul` runs B products against the weight expanded B times (`bmm`): 1.8x the time of one (B·R, H)
    product for SmolLM2's 49152 × 576 head on a CPU, forward (a profile showed the backward run as `bmm` too).
    """
    return lm_head(hidden[:, -n_response - 1:-1].contiguous())


def response_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, with_entropy: bool = False):
    """(B, R, V) response logits → log-probs (B, R) of the sampled tokens, and the entropy (B, R) if asked."""
    logprobs = logprobs_from_logits(logits, input_ids[:, -logits.shape[1]:])
    return logprobs, (entropy_from_logits(logits) if with_entropy else None)


def sequence_logprobs(model, input_ids, attention_mask, n_response: int, temperature: float,
                      with_entropy: bool = False):
    """Log-probs (B, R) of the response tokens under `model`, and their entropy (B, R) if asked."""
    return response_logprobs(response_logits(model, input_ids, attention_mask, n_response, temperature), input_ids,
                             with_entropy)


@torch.no_grad()
def sample(model, tokenizer, input_ids, attention_mask, *, max_new_tokens: int, temperature: float, top_k: int = 0,
           top_p: float = 1.0, with_logprobs: bool = False, with_outputs: bool = False, draw: str = "multinomial"):
    """`generate` with plain temperature sampling (top-k/top-p off unless set), pad and EOS from the tokenizer.

    Returns the (B, P + R) ids; with `with_logprobs`, `(ids, logprobs)`: also the (B, R) log-probs the sampler
    drew each new token with (`SampledLogprobs`). With `with_outputs`, `(ids, logprobs, entropy, hidden)`: also
    the (B, R) entropy of each step's distribution and the (B, R, H) last hidden state each new token was drawn
    from, the decoder's output at the step's last position (what a value head reads: `PPOConfig.old_logprobs`).
    Generation runs the model once per new token (the prompt's prefill gives the first), so step t's hidden
    state is V's input for token t, as `response_values` reads the full forward's.

    `draw`: "multinomial" (transformers' own `torch.multinomial`) or "inverse_cdf" (`token_draw`: the recorder
    draws from the same softmax(z / T) and `generate` runs greedy on its one-hot scores; needs top_k 0 and
    top_p 1, the warpers it bypasses)."""
    from transformers import LogitsProcessorList

    if draw not in TOKEN_DRAWS:
        raise ValueError(f"sample: draw must be one of {TOKEN_DRAWS}, got {draw!r}")
    own_draw = draw == "inverse_cdf"
    if own_draw and (top_k != 0 or top_p != 1.0):
        raise ValueError(f"sample: draw='inverse_cdf' draws from the full softmax(z / T); top_k={top_k}, top_p={top_p} "
                         "need draw='multinomial'")
    recorder = (SampledLogprobs(temperature, entropy=with_outputs, draw=own_draw)
                if with_logprobs or with_outputs or own_draw else None)
    # greedy on the recorder's one-hot scores: no temperature, top-k or top-p warpers, no multinomial
    mode = (dict(do_sample=False) if own_draw else
            dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p))
    hidden = []
    hook = (model.get_decoder().register_forward_hook(lambda module, args, out: hidden.append(out[0][:, -1]))
            if with_outputs else None)
    try:
        ids = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             logits_processor=LogitsProcessorList([recorder] if recorder else []), **mode)
    finally:
        if hook is not None:
            hook.remove()
    if recorder is None:
        return ids
    logprobs = recorder.finish(ids)
    if not (with_logprobs or with_outputs):
        return ids
    if not with_outputs:
        return ids, logprobs
    if len(hidden) != logprobs.shape[1]:  # one forward per new token is what generate does; refuse anything else
        raise RuntimeError(f"sample: {len(hidden)} decoder calls for {logprobs.shape[1]} new tokens; the hidden "
                           "states cannot be matched to the tokens")
    return ids, logprobs, recorder.entropy, torch.stack(hidden, dim=1)


def value_head(hidden_size: int) -> nn.Linear:
    """A zero-initialised scalar head (hidden → 1): every value is 0 before the first update."""
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class ValueModel(nn.Module):
    """Critic: a transformer backbone and a scalar value head on every position's last hidden state.

    The head starts at **zero** (weight and bias), so every value is 0 before the
    first update and no random head injects noise into the first advantages (with
    V = 0 they are the (γλ)-discounted sums of the rewards ahead). A test checks it.
    `critic_init: reward_model` instead copies the reward model's backbone and
    score head into it (`reward_model_as_critic`).
    """

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.value_head = value_head(backbone.config.hidden_size)

    def forward(self, input_ids, attention_mask):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)


def response_values(values_full: torch.Tensor, n_response: int) -> torch.Tensor:
    """(B, P + R) per-position values → (B, R): V(state before response token t), read at position P + t − 1."""
    return values_full[:, -n_response - 1:-1]


def reward_model_as_critic(reward_base, adapter_dir):
    """`(backbone, score_weight)` of the reward model, its LoRA merged into a trainable copy of its backbone.

    `critic_init: reward_model` starts the critic as the reward model (InstructGPT; trl's
    later PPO): V(s) then begins near the score the episode will get, instead of at 0.
    """
    reward, _ = load_reward_model(reward_base, adapter_dir)
    merged = reward.merge_and_unload()  # LlamaForSequenceClassification with the adapter folded in
    backbone = getattr(merged, merged.base_model_prefix)
    return backbone.requires_grad_(True), merged.score.weight.detach().clone()


class PPOBackend:
    """The interface the PPO loop uses. Subclasses hold the models.

    Attributes: `tokenizer`, `device`. Every method takes and returns tensors on `device`.
    """

    tokenizer = None
    device = torch.device("cpu")
    #: whether the reward adapter goes on the policy's own base (multi-adapter) rather than on a reward model's
    shares_base = False

    @classmethod
    def check_config(cls, config) -> None:
        """Refuse, as `ConfigError` before anything loads, an engine option this backend cannot honour."""

    @classmethod
    def resolve_reward(cls, config) -> RewardAdapter:
        """The run's reward adapter, resolved and checked once (`RewardAdapter.resolve`) against the base it is put
        on: `reward_base_path`, or the SFT model."""
        return RewardAdapter.resolve(config.reward_adapter_path, config.reward_base_path or config.sft_model_path,
                                     base_named=bool(config.reward_base_path))

    @property
    def policy_model(self) -> nn.Module:
        """The causal LM that samples (the policy adapter active, for the multi-adapter backend)."""
        raise NotImplementedError

    def generate(self, input_ids, attention_mask, *, max_new_tokens: int, temperature: float, top_k: int = 0,
                 top_p: float = 1.0, with_logprobs: bool = False, draw: str = "multinomial"):
        """Sample with the KV cache; returns (B, P + R) token ids (R ≤ max_new_tokens), and with `with_logprobs`
        also the (B, R) log-probs each new token was drawn with (`sample`, which `draw` is passed to)."""
        raise NotImplementedError

    def sampler_value_head(self) -> nn.Linear:
        """The value head that reads the policy's last hidden state, which the sampler computes while decoding
        (`generate_with_outputs`). A critic with a backbone of its own needs a forward of its own: ConfigError."""
        raise ConfigError(f"{type(self).__name__} cannot read values while sampling; use old_logprobs: recompute")

    @torch.no_grad()
    def generate_with_outputs(self, input_ids, attention_mask, *, max_new_tokens: int, temperature: float,
                              top_k: int = 0, top_p: float = 1.0, draw: str = "multinomial"):
        """`(ids, logprobs, values, entropy)`: `generate`'s ids and, recorded while decoding, what the rollout's
        no-grad `policy_forward` would return for them, each (B, R): the log-prob each token was drawn with, the
        value of the state it was drawn in (the value head on the (B, R, H) hidden state each token was drawn
        from), the entropy it was drawn from (`PPOConfig.old_logprobs: sampler`)."""
        head = self.sampler_value_head()
        ids, logprobs, entropy, hidden = sample(self.sampling_model(), self.tokenizer, input_ids, attention_mask,
                                                max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                                top_p=top_p, draw=draw, with_outputs=True)
        values = head(hidden.to(head.weight.dtype)).squeeze(-1)
        return ids, logprobs, values, entropy

    def policy_forward(self, input_ids, attention_mask, n_response: int, temperature: float,
                       with_entropy: bool = False):
        """`(logprobs, values, entropy_or_None)`, each (B, R), differentiable w.r.t. the trainable parameters."""
        raise NotImplementedError

    def reference_logprobs(self, input_ids, attention_mask, n_response: int, temperature: float) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, input_ids, attention_mask) -> torch.Tensor:
        """(B,) reward-model scores read at each row's last real token."""
        raise NotImplementedError

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Trainable parameters by group ('policy', 'value'); the optimizer gives each group its learning rate."""
        raise NotImplementedError

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every trainable tensor by a stable name (what a checkpoint saves)."""
        raise NotImplementedError

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def models(self) -> dict[str, nn.Module]:
        """The distinct modules, for memory accounting and freeze checks."""
        raise NotImplementedError

    _checkpointed: tuple = ()
    _merged = None  # a `MergedPolicy` when `merged_rollout` is on

    def lora_policy(self) -> tuple[nn.Module, str]:
        """`(peft_model, adapter_name)` of a LoRA policy, for `use_merged_rollout`."""
        raise NotImplementedError

    def use_merged_rollout(self, cache: str = "dynamic", onednn: bool = False) -> None:
        """Sample from a dense copy of the policy with its LoRA merged (`marlhf_edu.ppo.merged_rollout`), with a
        dynamic or a static KV cache (`PPOConfig.rollout_cache`), its products through oneDNN with `onednn`
        (`PPOConfig.onednn_matmuls`)."""
        self._merged = MergedPolicy(*self.lora_policy(), cache=cache, onednn=onednn)

    def export_policy(self, out_dir) -> None:
        """Save the trained policy where `marlhf-edu merge` / `generate` and every model reference can read it:
        a LoRA adapter (`adapter_config.json` + safetensors) or, for a fully trained actor, the whole model."""
        raise NotImplementedError

    def _with_rollout_copy(self, models: dict) -> dict:
        return {**models, "rollout copy": self._merged.model} if self._merged is not None else models

    def policy_changed(self) -> None:
        """The trainable weights changed (an update, a loaded checkpoint): the merged copy must be rebuilt."""
        if self._merged is not None:
            self._merged.stale = True

    def sampling_model(self) -> nn.Module:
        """The model `generate` samples from: the merged copy (refreshed if stale) or the policy itself."""
        if self._merged is None:
            return self.policy_model
        if self._merged.stale:  # after an update, or while it holds another adapter (merged_reward)
            self._merged.refresh()
        return self._merged.model

    def enable_gradient_checkpointing(self) -> None:
        """Recompute the trainable models' decoder layers in the backward of `policy_forward` (see
        `marlhf_edu.ppo.checkpointing`); takes effect inside `training_forward()`."""
        raise NotImplementedError

    def training_forward(self):
        """The context of a `policy_forward` whose graph a backward will use: checkpointed layers, if enabled."""
        return checkpointed(*self._checkpointed)


def split_causal_lm(model) -> tuple[nn.Module, nn.Module]:
    """`(backbone, lm_head)` of a causal LM (or a peft model around one): hidden states, then logits."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix), base.get_output_embeddings()


class FourModelBackend(PPOBackend):
    """Actor, critic, reward model and reference as four separate models (classic RLHF-PPO).

    - actor: the SFT model, trainable (all weights, or a LoRA adapter when `actor_lora_r > 0`);
    - critic: `ValueModel` on a second copy of the SFT backbone, trained like the actor (all weights,
      or its own LoRA adapter of the same rank), zero-initialised head; or, with `critic: shared_head`,
      only a zero-initialised `nn.Linear` head on the actor's last hidden state (trl 0.11's
      `AutoModelForCausalLMWithValueHead`: one forward gives log-probs and values, and the value loss
      trains the actor's backbone too);
    - reference: a third copy of the SFT model, frozen;
    - reward: the reward model (backbone + LoRA adapter + score head), frozen.

    All four stay in eval mode: dropout off, so a re-computed log-prob equals the rollout's.
    """

    def __init__(self, actor, critic: ValueModel | nn.Linear, reference, reward, tokenizer, reward_tokenizer=None):

        check_pad_token(tokenizer)
        self.shared_head = isinstance(critic, nn.Linear)
        check_same_vocabulary(tokenizer, reward_tokenizer)
        others = (("reference", reference), ("reward model", reward)) + (() if self.shared_head else (("critic", critic.backbone),))
        for name, m in others:
            if m.config.vocab_size != actor.config.vocab_size:
                raise ConfigError(f"the {name}'s vocabulary ({m.config.vocab_size}) differs from the actor's "
                                  f"({actor.config.vocab_size})")
        self.actor, self.critic, self.reference, self.reward = actor, critic, reference, reward
        self.tokenizer = tokenizer
        self.device = next(actor.parameters()).device
        for frozen in (reference, reward):
            frozen.requires_grad_(False)
        for m in self.models().values():
            m.eval()

    @classmethod
    def check_config(cls, config) -> None:
        if config.old_logprobs == "sampler" and config.critic != "shared_head":
            raise ConfigError(SAMPLER_NEEDS_SHARED_HEAD)
        if config.merged_rollout and config.actor_lora_r == 0:
            raise ConfigError("merged_rollout needs a LoRA policy (actor_lora_r > 0): a fully fine-tuned actor already "
                              "samples from dense weights")

    @classmethod
    def from_config(cls, config, reward: RewardAdapter | None = None) -> "FourModelBackend":
        """The four models for `config`. `reward` is the reward adapter as `run` resolved and checked it before
        anything loaded; without one, the config is checked and the adapter resolved here."""
        if reward is None:
            cls.check_config(config)
            reward = cls.resolve_reward(config)
        with quiet_loading():
            return cls._from_config(config, reward)

    @classmethod
    def _from_config(cls, config, reward: RewardAdapter) -> "FourModelBackend":
        from transformers import AutoModel, AutoModelForCausalLM

        sft = resolve_zoo(config.sft_model_path)
        adapter, reward_base = reward.folder, reward.base
        device = config.resolved_device
        tokenizer = load_tokenizer(sft)
        sft = resolve_model(sft)  # a GGUF file or an SFT adapter becomes a directory once, in the cache
        actor = align_pad(AutoModelForCausalLM.from_pretrained(sft), tokenizer).to(device)
        if config.critic == "shared_head":
            backbone, head = None, None
        elif config.critic_init == "reward_model":
            backbone, head = reward_model_as_critic(reward_base, adapter)
        else:
            backbone, head = AutoModel.from_pretrained(str(sft)), None
        if backbone is not None:
            backbone = backbone.to(device)
        if config.actor_lora_r > 0:  # the critic follows the actor's recipe: a LoRA on its own backbone
            from peft import LoraConfig, get_peft_model

            lora = dict(r=config.actor_lora_r, lora_alpha=config.actor_lora_alpha, lora_dropout=0.0,
                        target_modules=list(config.lora_target_modules))
            actor = get_peft_model(actor, LoraConfig(task_type="CAUSAL_LM", **lora))
            if backbone is not None:
                backbone = get_peft_model(backbone, LoraConfig(task_type="FEATURE_EXTRACTION", **lora))
        critic = value_head(actor.config.hidden_size).to(device) if backbone is None else ValueModel(backbone)
        if head is not None:
            with torch.no_grad():
                critic.value_head.weight.copy_(head)  # the reward model's score head; its bias stays 0
        reference = align_pad(AutoModelForCausalLM.from_pretrained(sft), tokenizer).to(device)
        reward, reward_tokenizer = load_reward_model(reward_base, adapter)
        if config.merged_reward:  # its own fp32 copy of the base: W + BA once, not x·W + x·A·B at every scoring
            reward = reward.merge_and_unload().eval()
        require_fp32({"actor": actor, "reference": reference, "reward model": reward}, config)
        if config.onednn_matmuls:  # the two frozen models: every product through oneDNN, no gradient through them;
            for frozen in (reference, reward):  # the actor and critic train their weights (a merged copy: the trainer)
                use_onednn(frozen, backward=False)
        return cls(actor, critic, reference, reward.to(device), tokenizer, reward_tokenizer)

    def models(self):
        return self._with_rollout_copy({"actor": self.actor, "critic": self.critic, "reference": self.reference,
                                        "reward": self.reward})

    def enable_gradient_checkpointing(self):
        self._checkpointed = (enable_checkpointing(self.actor),) + (
            () if self.shared_head else (enable_checkpointing(self.critic.backbone),))

    @property
    def policy_model(self):
        return self.actor

    def lora_policy(self):

        if not hasattr(self.actor, "peft_config"):
            raise ConfigError("merged_rollout needs a LoRA policy (actor_lora_r > 0): a fully fine-tuned actor "
                              "already samples from dense weights")
        return self.actor, self.actor.active_adapter

    def generate(self, input_ids, attention_mask, **sampling):
        return sample(self.sampling_model(), self.tokenizer, input_ids, attention_mask, **sampling)

    def sampler_value_head(self):
        if not self.shared_head:
            raise ConfigError(SAMPLER_NEEDS_SHARED_HEAD)
        return self.critic

    def export_policy(self, out_dir):
        self.actor.save_pretrained(str(out_dir))  # a peft actor writes its adapter, a full actor the whole model
        self.tokenizer.save_pretrained(str(out_dir))

    def policy_forward(self, input_ids, attention_mask, n_response, temperature, with_entropy=False):
        if self.shared_head:  # one pass through the actor's backbone: logits for the response, a value everywhere
            backbone, lm_head = split_causal_lm(self.actor)
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
            logits = head_logits(lm_head, hidden, n_response).div_(temperature)  # in place: the head's output is new
            logprobs, entropy = response_logprobs(logits, input_ids, with_entropy)
            values_full = self.critic(hidden.to(self.critic.weight.dtype)).squeeze(-1)
        else:
            logprobs, entropy = sequence_logprobs(self.actor, input_ids, attention_mask, n_response, temperature,
                                                  with_entropy)
            values_full = self.critic(input_ids, attention_mask)
        return logprobs, response_values(values_full, n_response), entropy

    @torch.no_grad()
    def reference_logprobs(self, input_ids, attention_mask, n_response, temperature):
        return sequence_logprobs(self.reference, input_ids, attention_mask, n_response, temperature)[0]

    @torch.no_grad()
    def scores(self, input_ids, attention_mask):
        return sequence_scores(self.reward, input_ids, attention_mask)

    def parameter_groups(self):
        return {"policy": [p for p in self.actor.parameters() if p.requires_grad],
                "value": [p for p in self.critic.parameters() if p.requires_grad]}

    def trainable_state_dict(self):
        out = {}
        for prefix, module in (("actor.", self.actor), ("critic.", self.critic)):
            out.update({prefix + n: p.detach() for n, p in module.named_parameters() if p.requires_grad})
        return out

    def load_trainable_state_dict(self, state):
        current = self.trainable_state_dict()
        missing, unexpected = set(current) - set(state), set(state) - set(current)
        if missing or unexpected:
            raise KeyError(f"checkpoint does not match the models: missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]}")
        with torch.no_grad():
            for name, tensor in current.items():
                tensor.copy_(state[name])
        self.policy_changed()


class ScoredPolicy:
    """A trained policy and the reward model that scores its answers: what `sample_toy` and `evaluate_toy` ask
    of a backend (`generate`, `scores`, `tokenizer`, `device`), for policies trained outside the PPO loop
    (trl's DPO and GRPO in chapter 12). No critic, no reference: it cannot be trained by `PPOTrainer`."""

    def __init__(self, policy, reward, tokenizer, reward_tokenizer=None):
        check_pad_token(tokenizer)
        check_same_vocabulary(tokenizer, reward_tokenizer, reward, policy)
        self.policy, self.reward, self.tokenizer = policy, reward, tokenizer
        self.device = next(policy.parameters()).device

    def generate(self, input_ids, attention_mask, **sampling):
        was_training = self.policy.training
        self.policy.eval()  # no dropout while sampling, as in the PPO engine
        try:
            return sample(self.policy, self.tokenizer, input_ids, attention_mask, **sampling)
        finally:
            self.policy.train(was_training)

    @torch.no_grad()
    def scores(self, input_ids, attention_mask):
        return sequence_scores(self.reward, input_ids, attention_mask)
