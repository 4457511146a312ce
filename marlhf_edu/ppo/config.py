"""Configuration of a PPO run: one dataclass, read from YAML with command-line overrides.

    marlhf-edu ppo --config configs/tiny_ppo.yaml --total_steps 50

Defaults follow trl 0.11's `PPOConfig` where it had one (vf_coef 0.1,
cliprange 0.2, ratio_threshold 10, adaptive KL init 0.2 / target 6 /
horizon 10000, gamma 1, lam 0.95). `validate` checks everything that can be
checked before a model is loaded; the engines check the rest (pad ≠ EOS,
vocabularies) right after loading, before the first step.

Taught in chapter 09.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading import onednn
from marlhf_edu.loading.cpu_products import native_low_precision_products
from marlhf_edu.loading.quantization import NF4_COMPUTE_DTYPES
from marlhf_edu.math.kl import KL_KINDS
from marlhf_edu.math.ppo_objective import LOSS_AGGREGATIONS
from marlhf_edu.math.scoring import TRUNCATED_SCORING
from marlhf_edu.ppo.token_draw import TOKEN_DRAWS

#: Estimators usable per sampled token ('full' needs whole distributions, which the loop does not keep).
TOKEN_KL_KINDS = tuple(k for k in KL_KINDS if k != "full")
#: How PPO reads prompts from a dataset (`load_prompts` in marlhf_edu.ppo.run).
PROMPT_FORMATS = ("prompt", "hh-rlhf")
#: What PPO optimises (`PPOConfig.reward`).
REWARDS = ("reward_model", "keyword_judge", "canonical_refusal", "sentiment", "reward_model_shuffled")
#: The shipped prompts whose held-out split the sentiment judge (VADER, chapter 13) evaluates.
SENTIMENT_DATASET = "everyday-prompts"
#: KV caches the merged rollout copy can sample with (`PPOConfig.rollout_cache`, `merged_rollout.MergedPolicy`).
ROLLOUT_CACHES = ("dynamic", "static")
#: Where the rollout's old log-probs, values and entropy come from (`PPOConfig.old_logprobs`).
OLD_LOGPROBS = ("recompute", "sampler")
#: Settings a resume may change freely: they do not define what has been trained so far.
RESUME_FREE = ("total_steps", "save_steps", "resume", "resume_overrides", "report_to", "output_dir", "device",
               "nf4_dequantize_once", "onednn_matmuls", "old_logprobs",
               "eval_repeats", "eval_prompts", "eval_every", "eval_every_prompts")
#: Settings a resume may change only when `resume_overrides` names them; the new value is then applied for real.
RESUME_OVERRIDABLE = ("learning_rate", "critic_learning_rate", "kl_coef", "cliprange", "cliprange_value", "vf_coef",
                      "entropy_coef", "max_grad_norm", "ratio_threshold", "early_stopping", "early_stopping_target_kl")


@dataclass
class PPOConfig:
    # ---- models ---------------------------------------------------------------------------
    sft_model_path: str = field(default="zoo", metadata={"help": "SFT model directory; 'zoo' = the shipped tiny one"})
    reward_adapter_path: str = field(default="zoo", metadata={"help": "reward LoRA adapter (with score head); 'zoo' = shipped"})
    reward_base_path: str = field(default="", metadata={"help": "base of the reward adapter; empty = sft_model_path"})
    actor_lora_r: int = field(default=0, metadata={"help": "LoRA rank of the actor; 0 = train all its weights"})
    actor_lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha of the actor (its update is scaled by alpha / r)"})
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"],
                                           metadata={"help": "the linear layers that get LoRA adapters (a YAML list)"})
    critic_init: str = field(default="zero", metadata={"help": "'zero': the critic is the SFT backbone with a zero head; 'reward_model': the critic starts as the reward model (its backbone, adapter and score head), as InstructGPT does (MA-RLHF, through trl 0.11's value head, starts a random head on the policy)"})
    critic: str = field(default="separate", metadata={"help": "four-model only: 'separate' (a critic with its own backbone, chapter 09) or 'shared_head' (a value head on the actor's last hidden state, trl 0.11's AutoModelForCausalLMWithValueHead: one forward, one backbone less)"})
    merged_rollout: bool = field(default=False, metadata={"help": "sample rollouts from a dense copy of the policy with its LoRA merged (NF4 bases dequantized), refreshed after every update; log-probs still come from the training path (unless old_logprobs: sampler). Needs a LoRA policy; costs one dense copy of the model"})
    rollout_cache: str = field(default="dynamic", metadata={"help": "merged_rollout only: 'dynamic' (a KV cache that grows token by token) or 'static' (one preallocated KV cache of max_prompt_length + max_new_tokens; prompts are left-padded to max_prompt_length so every step samples in one shape, and on CUDA transformers compiles the decode step into CUDA graphs). The samples follow the same distribution; on CUDA the compiled kernels round differently (rollout/logprob_gap shows it)"})
    tis_cap: float = field(default=0.0, metadata={"help": "truncated importance sampling: each answer token's policy loss is weighted by min(π_train/π_sampler, tis_cap), π_sampler recorded as each token was drawn; the correction for tokens drawn from a sampler that is not exactly the training forward: a merged copy (merged_rollout), or the policy decoding in bf16, whose one-token steps round differently (verl's and OpenRLHF's for vLLM; 2 is common); 0 = off"})
    old_logprobs: str = field(default="recompute", metadata={"help": "where the rollout's old log-probs, values and entropy come from: 'recompute' (a no-grad forward of the policy over the sampled rows, trl 0.11's way) or 'sampler' (recorded while decoding: the log-prob each token was drawn with, the value head on the hidden state it was drawn from; one forward of the model fewer a step). A value head on the policy (multi-adapter value_mode: shared, four-model critic: shared_head), fp32 products on a CPU, tis_cap: 0; the same numbers up to fp32 rounding (the sampler's one-token steps, the merged copy's folded weights); the update's first minibatch, at the rollout's weights, logs their gap to the training path (rollout/logprob_gap)"})
    merged_reward: bool = field(default=False, metadata={"help": "score with the reward LoRA merged into dense weights (one matmul per layer instead of three; scores equal to float rounding): four-model, into the reward model's own fp32 copy of its base; multi-adapter, into the merged_rollout copy between samples (needs merged_rollout: true; the copy is rebuilt twice a step, the base never changes). Off by default so that stored runs replay exactly"})
    value_mode: str = field(default="shared", metadata={"help": "multi-adapter only: 'shared' (head on the policy adapter) or 'adapter' (own LoRA + head)"})
    load_in_4bit: bool = field(default=False, metadata={"help": "multi-adapter only: NF4 base (bitsandbytes; runs on CPU too)"})
    double_quant: bool = field(default=True, metadata={"help": "NF4 double quantization of the scales"})
    nf4_compute_dtype: str = field(default="auto", metadata={"help": "with load_in_4bit: 'auto' (bf16 on CUDA, fp32 on CPU), 'float32' (fp32 on CUDA too, with an fp32 residual stream, as on the CPU) or 'bfloat16'"})
    nf4_dequantize_once: bool = field(default=False, metadata={"help": "CPU, with load_in_4bit: each 4-bit layer dequantizes its frozen weight once and keeps it, in its compute dtype, instead of on every forward and backward: the same outputs and gradients bit for bit, the layers' weights held again densely (2 or 4 bytes each)"})
    onednn_matmuls: bool = field(default=False, metadata={"help": "CPU, fp32: the frozen dense weights (multi-adapter: the base's layers, with load_in_4bit those nf4_dequantize_once keeps, and the LM head; four-model: the reference's and the reward model's; either engine: the merged_rollout copy's, again after each refresh) are reordered once for oneDNN and multiplied there instead of by MKL's sgemm (1.9-4.7x as fast as MKL on an AMD EPYC, chapter 09): the same function up to fp32 rounding, not bit for bit; each reordered weight held again (twice where a backward needs the input gradient)"})
    # ---- data -----------------------------------------------------------------------------
    dataset_name: str = field(default="toy", metadata={"help": "'toy' or a .json/.jsonl/.parquet file / hub dataset with a 'prompt' column"})
    dataset_split: str = field(default="train", metadata={"help": "split of a hub dataset to read prompts from (files have one)"})
    dataset_format: str = field(default="prompt", metadata={"help": "'prompt' (a 'prompt' column) or 'hh-rlhf' (the dialogue before the last assistant turn; repeated prompts kept once)"})
    apply_template: bool = field(default=True, metadata={"help": "render each 'prompt' with the template (the tokenizer's chat template if it has one, else the book's)"})
    max_prompt_length: int = field(default=64, metadata={"help": "longer prompts are an error, never truncated silently"})
    drop_long_prompts: bool = field(default=False, metadata={"help": "instead of the error, drop prompts longer than max_prompt_length and say how many"})
    skip_bad_rows: bool = field(default=False, metadata={"help": "skip (and count) rows that cannot be converted"})
    max_prompts: int = field(default=0, metadata={"help": "use the first N prompts (after drop_long_prompts); 0 = all"})
    helpful_prompt_share: float = field(default=0.0, metadata={"help": "share of the training prompts that are the book's harmless questions (keyword_judge.HELPFUL_ANSWERS, cycled), mixed in after the dataset's, so that PPO on red-team prompts also sees questions it should answer; 0 = none"})
    toy_seed: int = field(default=0, metadata={"help": "seed of the toy world (its prompts, judge and tokenizer), apart from the run's seed"})
    # ---- batch shape ----------------------------------------------------------------------
    total_steps: int = field(default=100, metadata={"help": "PPO steps (one batch of rollouts each)"})
    batch_size: int = field(default=64, metadata={"help": "rollouts per step"})
    mini_batch_size: int = field(default=16, metadata={"help": "rollouts per optimizer step"})
    micro_batch_size: int = field(default=16, metadata={"help": "rollouts per forward/backward (gradient accumulation)"})
    forward_batch_size: int = field(default=64, metadata={"help": "rollouts per no-grad forward (scoring, old/ref log-probs)"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each batch of rollouts"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute each decoder layer in the update's backward instead of keeping its activations (less memory, one more forward of compute)"})
    # ---- sampling -------------------------------------------------------------------------
    max_new_tokens: int = field(default=32, metadata={"help": "answer length limit; an answer cut off here has no EOS (see truncated_scoring, missing_eos_penalty)"})
    temperature: float = field(default=1.0, metadata={"help": "divides the logits in sampling and in scoring alike"})
    top_k: int = field(default=0, metadata={"help": "must stay 0 (off) for training: see validate()"})
    top_p: float = field(default=1.0, metadata={"help": "must stay 1.0 (off) for training: see validate()"})
    token_draw: str = field(default="multinomial", metadata={"help": "how the sampler draws each token from softmax(z / T): 'multinomial' (transformers' torch.multinomial, an exponential race that makes B x V random numbers a decode step: 14-15 ms a step with its softmax at SmolLM2's 16 x 49,152 on a 2-core AMD EPYC) or 'inverse_cdf' (one fp64 uniform a row against the fp64 cumulative probabilities: 0.8 ms there; the same distribution up to fp64 rounding, from another random stream, so a run's samples differ from multinomial's). CPU only; rollouts only (evaluation samples with multinomial)"})
    rollout_seeding: str = field(default="stream", metadata={"help": "'stream': one random stream samples the whole batch, chunk after chunk; 'per_chunk': each forward chunk of the global batch is sampled from its own seed (seed, step, chunk), so the samples do not depend on how many ranks share the batch. Data-parallel runs need per_chunk"})
    # ---- scores ---------------------------------------------------------------------------
    truncated_scoring: str = field(default="append_eos", metadata={"help": "how the reward model reads a response cut off at max_new_tokens (no EOS): 'append_eos' (default) scores it with EOS appended, as the reward model was trained on EOS-terminated texts, and missing_eos_penalty then charges the truncation; 'last_token' reads it at its last generated token, mid-sentence, out of the reward model's training distribution (the trap chapter 13 shows)"})
    missing_eos_penalty: float | None = field(default=None, metadata={"help": "subtracted from the score of a response without EOS"})
    reward: str = field(default="reward_model", metadata={"help": "what PPO optimises: 'reward_model' (the reward adapter's score); on hh-rlhf data also a positive control (chapter 13), with the book's harmless training questions paid 1 for a right answer: 'canonical_refusal' (on a red-team prompt the share of a canonical refusal said from the first word, 1 only for the whole answer being one: keyword_rewards.canonical_refusal_score) or 'keyword_judge' (1 for any refusal by the judge's keywords that is not a hollow apology: gamed by 'I can't think of ...'); on any data 'sentiment', VADER's compound score of the answer in [-1, 1] (sentiment_judge.sentiment_reward, chapter 13's positive control for the sentiment experiment); and 'reward_model_shuffled', a negative control (chapter 13): the reward model's scores permuted among the answers of each forward chunk at every step, so that PPO gets their scale and spread but not which answer earned which. The reward model's score is logged either way (score/reward_model_mean)"})
    score_baseline: float = field(default=0.0, metadata={"help": "subtracted from every score"})
    rollouts_per_prompt: int = field(default=1, metadata={"help": "answers sampled to each prompt of a batch (batch_size must be a multiple): batch_size / k distinct prompts, each k times"})
    group_baseline: bool = field(default=False, metadata={"help": "subtract from each score the mean score of the other answers to its prompt (leave-one-out, as RLOO): the reward model is only asked which answer to a prompt is better. Needs rollouts_per_prompt > 1"})
    whiten_scores: bool = field(default=False, metadata={"help": "whiten scores across the batch"})
    score_clip: float | None = field(default=None, metadata={"help": "clip scores to ±score_clip (after the above)"})
    # ---- KL -------------------------------------------------------------------------------
    kl_coef: float = field(default=0.2, metadata={"help": "β, or its initial value when adaptive"})
    adaptive_kl: bool = field(default=True, metadata={"help": "adapt β towards adaptive_kl_target (Ziegler et al.); false = a fixed kl_coef"})
    adaptive_kl_target: float = field(default=6.0, metadata={"help": "target KL (summed over a response)"})
    adaptive_kl_horizon: float = field(default=10000.0, metadata={"help": "how slowly β adapts: its relative change per batch is (KL / target − 1, clipped to ±0.2) × batch_size / horizon"})
    kl_estimator: str = field(default="k1", metadata={"help": "estimator in the per-token penalty: " + ", ".join(TOKEN_KL_KINDS)})
    early_stopping: bool = field(default=False, metadata={"help": "stop the PPO epochs when policykl > 1.5 × early_stopping_target_kl"})
    early_stopping_target_kl: float = field(default=1.0, metadata={"help": "the policykl early_stopping compares against (× 1.5)"})
    early_stopping_check: str = field(default="epoch", metadata={"help": "'epoch': after each PPO epoch, on its last minibatch's policykl (trl 0.11); 'minibatch': after every optimizer step"})
    # ---- PPO ------------------------------------------------------------------------------
    gamma: float = field(default=1.0, metadata={"help": "discount γ of GAE (1: a response is one short episode)"})
    lam: float = field(default=0.95, metadata={"help": "λ of GAE: 0 = one-step TD (the critic's bias), 1 = Monte Carlo returns (the rewards' variance)"})
    cliprange: float = field(default=0.2, metadata={"help": "ε of the clipped policy objective: the ratio is clipped to [1 − ε, 1 + ε]"})
    cliprange_value: float = field(default=0.2, metadata={"help": "how far a new value may move from the rollout's value before its loss is clipped"})
    vf_coef: float = field(default=0.1, metadata={"help": "weight of the value loss beside the policy loss"})
    entropy_coef: float = field(default=0.0, metadata={"help": "weight of an entropy bonus (0 = none, as trl 0.11)"})
    loss_aggregation: str = field(default="token-mean", metadata={"help": "policy loss over tokens: 'token-mean' (trl 0.11) or 'sequence-mean' (see chapter 06's length bias)"})
    ratio_threshold: float = field(default=10.0, metadata={"help": "skip a minibatch whose mean ratio exceeds this"})
    whiten_advantages: bool = field(default=True, metadata={"help": "whiten advantages over the batch's response tokens before the loss"})
    learning_rate: float = field(default=1e-5, metadata={"help": "actor learning rate (AdamW)"})
    critic_learning_rate: float | None = field(default=None, metadata={"help": "defaults to learning_rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    adam_eps: float = field(default=1e-8, metadata={"help": "AdamW ε"})
    max_grad_norm: float | None = field(default=1.0, metadata={"help": "clip the gradient norm to this; null = no clipping"})
    # ---- run ------------------------------------------------------------------------------
    output_dir: str = field(default="runs/ppo", metadata={"help": "the run's folder: metrics, checkpoints, evaluation, exported policy; a folder holding a run is refused unless resume"})
    seed: int = field(default=0, metadata={"help": "seed of the run: sampling, minibatch order, adapter initialisation"})
    device: str = field(default="auto", metadata={"help": "'auto' (cuda if available), 'cpu' or 'cuda'"})
    save_steps: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = only at the end)"})
    resume: bool = field(default=False, metadata={"help": "continue from output_dir's latest checkpoint; the settings that define the run must equal the checkpoint's (total_steps, save_steps, device, report_to and the evaluation settings may change)"})
    resume_overrides: list[str] = field(default_factory=list, metadata={"help": "with resume: settings that may differ from the checkpoint's and then take effect (" + ", ".join(RESUME_OVERRIDABLE) + "); learning rates are set on the restored optimizer, kl_coef on the restored KL controller"})
    report_to: str = field(default="none", metadata={"help": "'none' or a tracker accelerate knows ('tensorboard', 'wandb', ...)"})
    eval_repeats: int = field(default=4, metadata={"help": "evaluate the policy before and after, each prompt asked N times (0 = skip): "
                                                           "the toy world's judge, or for hh-rlhf data the keyword judge of chapter 13"})
    eval_prompts: int = field(default=64, metadata={"help": "hh-rlhf data: held-out red-team requests the keyword judge asks (0 = all that fit)"})
    eval_every: int = field(default=0, metadata={"help": "every N steps, log a held-out evaluation in the step's record (eval/*): one answer to each of the first eval_every_prompts judge prompts, scored by the reward model with EOS appended, as it was trained (0 = off)"})
    eval_every_prompts: int = field(default=32, metadata={"help": "prompts of the periodic held-out evaluation (eval_every), taken evenly from the judge's harmful and benign prompts"})

    def validate(self) -> "PPOConfig":
        """Raise `ConfigError` naming the first inconsistent setting."""
        def need(ok, message):
            if not ok:
                raise ConfigError(message)

        for name in ("total_steps", "batch_size", "mini_batch_size", "micro_batch_size", "forward_batch_size",
                     "ppo_epochs", "max_new_tokens", "max_prompt_length"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.rollouts_per_prompt >= 1 and self.batch_size % self.rollouts_per_prompt == 0,
             f"batch_size ({self.batch_size}) must be a multiple of rollouts_per_prompt ({self.rollouts_per_prompt})")
        need(not self.group_baseline or self.rollouts_per_prompt > 1,
             "group_baseline compares the answers to one prompt: it needs rollouts_per_prompt > 1")
        need(self.batch_size % self.mini_batch_size == 0,
             f"batch_size ({self.batch_size}) must be a multiple of mini_batch_size ({self.mini_batch_size})")
        need(self.mini_batch_size % self.micro_batch_size == 0,
             f"mini_batch_size ({self.mini_batch_size}) must be a multiple of micro_batch_size ({self.micro_batch_size})")
        need(0 < self.temperature < float("inf"), f"temperature must be a finite number > 0, got {self.temperature}")
        for name in ("max_grad_norm", "score_clip", "critic_learning_rate"):
            value = getattr(self, name)
            need(value is None or value > 0, f"{name} must be > 0 or null (off), got {value}")
        need(self.vf_coef >= 0 and self.entropy_coef >= 0 and self.ratio_threshold > 0,
             f"need vf_coef >= 0, entropy_coef >= 0 and ratio_threshold > 0, got {self.vf_coef}, "
             f"{self.entropy_coef}, {self.ratio_threshold}")
        need(self.top_k >= 0 and 0 < self.top_p <= 1, f"need top_k >= 0 and 0 < top_p <= 1, got {self.top_k}, {self.top_p}")
        # PPO scores every sampled token with log softmax(z / T) over the whole vocabulary; top-k/top-p sample from a
        # truncated, renormalised distribution instead, so the stored log-probs would not be the sampler's and every
        # ratio would be off-policy from the first step
        need(self.top_k == 0 and self.top_p == 1.0,
             f"top_k={self.top_k}, top_p={self.top_p}: PPO needs the log-probs of the distribution it sampled from, and "
             "the engine scores tokens under the full softmax(z / T); set top_k: 0 and top_p: 1.0 for training "
             "(use them only for sampling outside PPO)")
        need(self.token_draw in TOKEN_DRAWS, f"token_draw must be one of {TOKEN_DRAWS}, got {self.token_draw!r}")
        # a GPU's parallel cumulative sum need not be monotone (token_draw's guarantees assume the CPU's ordered one),
        # and there the draw was never measured or tested
        need(self.token_draw == "multinomial" or self.resolved_device == "cpu",
             f"token_draw: inverse_cdf is for a CPU (device {self.resolved_device}); use multinomial on a GPU")
        need(self.rollout_seeding in ("stream", "per_chunk"),
             f"rollout_seeding must be 'stream' or 'per_chunk', got {self.rollout_seeding!r}")
        need(self.early_stopping_check in ("epoch", "minibatch"),
             f"early_stopping_check must be 'epoch' or 'minibatch', got {self.early_stopping_check!r}")
        need(self.loss_aggregation in LOSS_AGGREGATIONS,
             f"loss_aggregation must be one of {LOSS_AGGREGATIONS}, got {self.loss_aggregation!r}")
        need(self.critic_init in ("zero", "reward_model"),
             f"critic_init must be 'zero' or 'reward_model', got {self.critic_init!r}")
        need(self.critic in ("separate", "shared_head"),
             f"critic must be 'separate' or 'shared_head', got {self.critic!r}")
        need(not (self.critic == "shared_head" and self.critic_init == "reward_model"),
             "critic: shared_head reads the actor's features; critic_init: reward_model needs critic: separate")
        need(self.kl_estimator in TOKEN_KL_KINDS, f"kl_estimator must be one of {TOKEN_KL_KINDS}, got {self.kl_estimator!r}")
        need(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
        need(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, f"gamma and lam must lie in [0, 1], got {self.gamma}, {self.lam}")
        need(self.cliprange > 0 and self.cliprange_value > 0, "cliprange and cliprange_value must be > 0")
        need(self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate}")
        need(self.adam_eps > 0 and self.weight_decay >= 0,
             f"need adam_eps > 0 and weight_decay >= 0 (AdamW's), got {self.adam_eps} and {self.weight_decay}")
        need(self.adaptive_kl_target > 0 and self.adaptive_kl_horizon > 0,
             f"adaptive_kl_target and adaptive_kl_horizon must be > 0 (β's relative change divides by both), got "
             f"{self.adaptive_kl_target} and {self.adaptive_kl_horizon}")
        need(self.early_stopping_target_kl > 0,
             f"early_stopping_target_kl must be > 0, got {self.early_stopping_target_kl}")
        need(self.actor_lora_r >= 0, f"actor_lora_r must be >= 0, got {self.actor_lora_r}")
        need(self.value_mode in ("shared", "adapter"), f"value_mode must be 'shared' or 'adapter', got {self.value_mode!r}")
        need(self.dataset_format in PROMPT_FORMATS,
             f"dataset_format must be one of {PROMPT_FORMATS}, got {self.dataset_format!r}")
        need(self.max_prompts >= 0, f"max_prompts must be >= 0, got {self.max_prompts}")
        need(0 <= self.helpful_prompt_share < 1, f"helpful_prompt_share must lie in [0, 1), got {self.helpful_prompt_share}")
        need(not (self.helpful_prompt_share and self.dataset_name == "toy"),
             "helpful_prompt_share mixes the book's harmless questions into a real dataset's prompts; the toy world has its own")
        need(self.eval_repeats >= 0 and self.eval_prompts >= 0,
             f"eval_repeats and eval_prompts must be >= 0, got {self.eval_repeats} and {self.eval_prompts}")
        need(self.save_steps >= 0, f"save_steps must be >= 0, got {self.save_steps}")
        bad = [k for k in self.resume_overrides if k not in RESUME_OVERRIDABLE]
        need(not bad, f"resume_overrides: {', '.join(map(repr, bad))} cannot be changed on resume; only "
                      f"{', '.join(RESUME_OVERRIDABLE)} can")
        need(not self.resume_overrides or self.resume, "resume_overrides needs resume: true")
        need(self.truncated_scoring in TRUNCATED_SCORING,
             f"truncated_scoring must be one of {TRUNCATED_SCORING}, got {self.truncated_scoring!r}")
        need(self.missing_eos_penalty is None or self.missing_eos_penalty >= 0,
             f"missing_eos_penalty must be >= 0 (it is subtracted), got {self.missing_eos_penalty}")
        need(self.reward in REWARDS, f"reward must be one of {REWARDS}, got {self.reward!r}")
        need(self.reward in ("reward_model", "sentiment", "reward_model_shuffled") or self.dataset_format == "hh-rlhf",
             f"reward: {self.reward} judges refusals of red-team requests: it needs dataset_format: hh-rlhf")
        need(self.dataset_name != SENTIMENT_DATASET or self.dataset_split == "train",
             f"dataset_name: {SENTIMENT_DATASET} trains on its train split (its held_out split is the sentiment "
             f"judge's evaluation), got dataset_split: {self.dataset_split!r}")
        need(not self.eval_every or self.dataset_name in ("toy", SENTIMENT_DATASET) or self.dataset_format == "hh-rlhf",
             f"eval_every: {self.eval_every} needs a judge with held-out prompts, the toy world's, the keyword "
             f"judge's (dataset_format: hh-rlhf) or the sentiment judge's (dataset_name: {SENTIMENT_DATASET}); set "
             "eval_every: 0 for this data")
        need(self.eval_every >= 0 and self.eval_every_prompts >= 2,
             f"eval_every must be >= 0 and eval_every_prompts >= 2, got {self.eval_every} and {self.eval_every_prompts}")
        need(self.tis_cap == 0 or self.tis_cap >= 1,
             f"tis_cap weights each token by min(π_train/π_sampler, cap): the cap must be >= 1 (or 0 = off), "
             f"got {self.tis_cap}")
        need(self.rollout_cache in ROLLOUT_CACHES,
             f"rollout_cache must be one of {ROLLOUT_CACHES}, got {self.rollout_cache!r}")
        need(self.rollout_cache == "dynamic" or self.merged_rollout,
             "rollout_cache: static compiles the sampling model's decode step; it needs merged_rollout: true (the "
             "dense copy: a LoRA on a 4-bit base does not compile into one graph)")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        need(not self.nf4_dequantize_once or (self.load_in_4bit and self.resolved_device == "cpu"),
             "nf4_dequantize_once keeps a CPU run's 4-bit weights dequantized: it needs load_in_4bit: true and the "
             f"CPU (got load_in_4bit {self.load_in_4bit}, device {self.resolved_device}); on a GPU bitsandbytes' own "
             "kernels run and the 4-bit memory is the point")
        need(not self.onednn_matmuls or (self.resolved_device == "cpu" and self.nf4_compute_dtype != "bfloat16"
                                         and (self.nf4_dequantize_once or not self.load_in_4bit)),
             "onednn_matmuls multiplies a CPU run's frozen fp32 weights through oneDNN: it needs the CPU, fp32 products "
             "(not nf4_compute_dtype: bfloat16) and, with load_in_4bit, nf4_dequantize_once: true (the dense weights "
             f"it reorders); got device {self.resolved_device}, nf4_compute_dtype {self.nf4_compute_dtype}, "
             f"load_in_4bit {self.load_in_4bit}, nf4_dequantize_once {self.nf4_dequantize_once}")
        need(not self.onednn_matmuls or onednn.available(),
             "onednn_matmuls: this PyTorch build has no oneDNN linear product (torch.ops.mkldnn._linear_pointwise, "
             "_reorder_linear_weight); set onednn_matmuls: false")
        need(self.old_logprobs in OLD_LOGPROBS, f"old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        # the sampler's numbers stand in for the training path's only where both compute in fp32: a bf16 decode
        # differs from the forward by 0.013-0.06 nats a token (chapter 09), which the recomputed forward and
        # tis_cap exist to measure and correct
        need(self.old_logprobs == "recompute" or (self.resolved_device == "cpu" and self.nf4_compute_dtype != "bfloat16"
                                                  and self.tis_cap == 0),
             "old_logprobs: sampler takes the rollout's old log-probs from the sampler itself: it needs fp32 products on "
             "the CPU (not nf4_compute_dtype: bfloat16) and tis_cap: 0 (the PPO ratio is then already taken against "
             f"the sampler); got device {self.resolved_device}, nf4_compute_dtype {self.nf4_compute_dtype}, "
             f"tis_cap {self.tis_cap}")
        need(self.nf4_compute_dtype in NF4_COMPUTE_DTYPES,
             f"nf4_compute_dtype must be one of {NF4_COMPUTE_DTYPES}, got {self.nf4_compute_dtype!r}")
        need(not (self.nf4_dequantize_once and self.nf4_compute_dtype == "bfloat16")
             or native_low_precision_products(torch.bfloat16),
             "nf4_dequantize_once with nf4_compute_dtype: bfloat16 runs the 4-bit layers as plain bf16 matmuls, and "
             "this CPU's PyTorch has no bf16 matrix kernels (AVX2 only): their backward would take PyTorch's scalar "
             "loop. Compute in fp32 here (nf4_compute_dtype: auto, e.g. configs/smollm2/ma_ppo.yaml)")
        return self

    def validate_data_parallel(self, world_size: int) -> "PPOConfig":
        """Raise `ConfigError` unless the global batch shapes split over `world_size` ranks (chapter 14)."""
        if world_size <= 1:
            return self
        if self.rollout_seeding != "per_chunk":
            raise ConfigError(f"a data-parallel run ({world_size} ranks) needs rollout_seeding: per_chunk, so that a "
                              "rollout's samples do not depend on how many ranks share the batch (a 2-rank run then "
                              "equals a 1-process run on the same batch); set it in the config or pass --rollout_seeding per_chunk")
        if self.batch_size % world_size:
            raise ConfigError(f"batch_size ({self.batch_size}) is global and must split evenly over {world_size} ranks")
        if self.mini_batch_size % (world_size * self.micro_batch_size):
            raise ConfigError(f"mini_batch_size ({self.mini_batch_size}) is global and must split over {world_size} ranks "
                              f"into whole micro-batches of micro_batch_size ({self.micro_batch_size}) each")
        shard = self.batch_size // world_size
        if shard % self.forward_batch_size:
            # per_chunk seeds each forward chunk of the *global* batch by its index: a rank whose rows are not whole
            # chunks would seed its rows as chunks one process never forms, and sample other answers, silently
            raise ConfigError(f"forward_batch_size ({self.forward_batch_size}) must divide each rank's share of the "
                              f"batch ({shard} rows: batch_size {self.batch_size} over {world_size} ranks), so that "
                              f"the ranks sample the forward chunks one process would; lower forward_batch_size or "
                              f"raise batch_size")
        return self

    def resume_differences(self, saved: dict) -> list[str]:
        """The settings that differ from a checkpoint's (`saved`: its `state.json["config"]`) and may not:
        one line each, `key: checkpoint X, now Y`. Free settings (`RESUME_FREE`) and overridable ones named in
        `resume_overrides` are left out; a setting the checkpoint predates is compared with its default."""
        from dataclasses import fields

        out = []
        for f in fields(self):
            if f.name in RESUME_FREE or f.name in self.resume_overrides:
                continue
            now = getattr(self, f.name)
            then = saved[f.name] if f.name in saved else (f.default_factory() if callable(f.default_factory)
                                                           else f.default)
            if isinstance(now, tuple):
                now = list(now)
            if now != then:
                hint = " (or name it in resume_overrides)" if f.name in RESUME_OVERRIDABLE else ""
                out.append(f"{f.name}: checkpoint {then!r}, now {now!r}{hint}")
        return out

    @property
    def resolved_device(self) -> str:
        """The device this process trains on: in a data-parallel run on GPUs, rank r's local GPU (`cuda:LOCAL_RANK`),
        as `accelerate launch` numbers them; each rank holds its own base there."""
        import os

        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        return device


#: LoRA rank of the policy and value adapters when the config leaves `actor_lora_r` at 0 (full fine-tuning).
DEFAULT_ADAPTER_RANK = 16
