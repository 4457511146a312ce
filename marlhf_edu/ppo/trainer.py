"""The PPO loop of RLHF, on any backend (four models, or one base with adapters).

One step, top to bottom (`PPOTrainer.step`):

1. rollout   — sample responses to a batch of left-padded prompts (KV cache);
               the response mask keeps the first EOS and drops everything after;
2. score     — one batched reward-model call per chunk, read at the last real token;
               a response cut off before EOS is scored with EOS appended, as the
               reward model was trained (`append_missing_eos`), then charged the
               missing-EOS penalty; baseline, whitening, clipping;
3. old log-probs, values (policy + critic) and reference log-probs, no grad;
4. rewards   — `token_level_rewards`: −β·KL on every token, the score on the last;
5. advantages— `gae_advantages`, then `masked_whiten`;
6. update    — `ppo_epochs` passes over shuffled minibatches, each accumulated over
               micro-batches, `ppo_loss` (with its ratio-threshold skip), gradient
               clipping (a minibatch skipped by the ratio threshold takes no optimizer
               step), optional early stop when policykl > 1.5 × target (checked after
               each epoch as trl 0.11 does, or after each minibatch);
7. KL controller update with the batch's mean KL.

Every formula comes from the foundation modules; this file only schedules them.
Taught in chapter 09. Launched on several ranks (`accelerate launch`), each rank rolls out its shard of the batch
and the experience is gathered before step 2, so every batch statistic is global (`distributed.py`, chapter 14).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import shutil
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch

from marlhf_edu.data.template import template_for
from marlhf_edu.errors import ConfigError
from marlhf_edu.math.gae import gae_advantages
from marlhf_edu.math.kl import AdaptiveKLController, FixedKLController, kl_penalty, token_level_rewards
from marlhf_edu.math.masked import masked_mean, masked_var, masked_whiten
from marlhf_edu.math.ppo_objective import ppo_loss
from marlhf_edu.math.scoring import append_missing_eos, penalise_missing_eos, score_texts_with
from marlhf_edu.ppo.backends import PPOBackend
from marlhf_edu.ppo.config import PPOConfig
from marlhf_edu.ppo.distributed import DataParallel, chunk_seed, left_pad_to
from marlhf_edu.ppo.run_files import (CHECKPOINT_POLICY, check_run_folder, export_policy, fsync_path,
                                      keep_records_up_to, load_data, read_jsonl, seal_checkpoint,
                                      set_aside_stopped_run)
from marlhf_edu.ppo.used_columns import packed, right_aligned, unpacked

#: Phases of a step timed separately (`time/<phase>_s`): sampling, the reward model's scores, the rollout's
#: no-grad policy/critic forward, the reference forward, and the PPO update.
PHASES = ("generate", "score", "policy", "reference", "update")
#: Keys of a step record that measure time; everything else is a deterministic function of the run.
TIMING_KEYS = ("time/step_s", "time/rollout_s", "time/update_s", "time/tokens_per_s",
               "time/generate_tokens_per_s") + tuple(f"time/{p}_s" for p in PHASES if p != "update")


class PhaseTimer:
    """Wall-clock seconds per named phase, summed over a step (`with timer("score"): ...`).

    On CUDA it synchronises at each boundary, so a phase is charged for its own kernels, not the next one's.
    """

    def __init__(self, device):
        self.sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        self.seconds = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[phase] += time.perf_counter() - start


def shuffled_order(n: int, seed: int, step: int, chunk: int) -> torch.Tensor:
    """The permutation `reward: reward_model_shuffled` applies to the `n` scores of forward chunk `chunk` (counted
    over the global batch) at step `step`: drawn from its own generator, so the same on any number of ranks and
    after a resume, and no other random draw of the run moves."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(chunk_seed(seed, step, chunk) + 7919))


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, R) ids → (B, R) bool mask: every token up to and including the first EOS.

    Tokens after the first EOS (padding from `generate`, or anything else) are
    out; a response that never emits EOS keeps all R tokens.
    """
    is_eos = response_ids == eos_token_id
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS strictly before t
    return eos_before == 0


@dataclass
class Rollout:
    """One batch of experience. Token tensors are (B, P + R); per-response-token tensors are (B, R)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    raw_scores: torch.Tensor  # (B,) the reward's scores (the reward model's, or `reward_fn`'s)
    scores: torch.Tensor  # (B,) after penalty / baseline / whitening / clipping: what PPO optimises
    has_eos: torch.Tensor  # (B,)
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    entropy: torch.Tensor
    rewards: torch.Tensor
    kls: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    reward_model_scores: torch.Tensor | None = None  # (B,) the reward model's, when `reward_fn` is the reward
    logprob_gap: torch.Tensor | None = None  # mean |log π_sampler − log π_train| per response token (merged_rollout)
    tis_weights: torch.Tensor | None = None  # (B, R) min(π_train/π_sampler, tis_cap) per response token (tis_cap)

    @property
    def n_response(self) -> int:
        return self.response_mask.shape[1]

    def texts(self, tokenizer) -> tuple[list[str], list[str]]:
        """Decoded (prompts, responses), special tokens dropped."""
        prompt = self.input_ids[:, :-self.n_response]
        response = torch.where(self.response_mask, self.input_ids[:, -self.n_response:], tokenizer.pad_token_id)
        return (tokenizer.batch_decode(prompt, skip_special_tokens=True),
                tokenizer.batch_decode(response, skip_special_tokens=True))


def leave_one_out(scores: torch.Tensor, k: int) -> torch.Tensor:
    r"""(B,) scores in consecutive groups of k answers to one prompt → each minus the mean of the other k − 1.

    .. math:: s_i - \frac{1}{k-1}\sum_{j \ne i} s_j

    An unbiased baseline (it does not depend on answer i), as RLOO uses: what is left is how much better an
    answer is than its prompt's other answers, so prompts that are easy or hard to score well on stop adding
    noise. Taught in chapter 13.
    """
    if k < 2 or scores.numel() % k:
        raise ValueError(f"leave_one_out: need k >= 2 dividing the batch, got k={k} for {scores.numel()} scores")
    groups = scores.view(-1, k)
    others = (groups.sum(1, keepdim=True) - groups) / (k - 1)
    return (groups - others).reshape(-1)


def eos_split_scores(scores: torch.Tensor, has_eos: torch.Tensor) -> dict[str, float]:
    """`score/mean_eos` and `score/mean_no_eos`: the mean score of the answers that ended with EOS and of those
    cut off, each only when the batch has some. A large gap between them that the policy closes by ending earlier
    is a reward driven by EOS status, not content (`watch.check_run`'s `eos_driven_score`, chapter 13)."""
    out = {}
    for key, rows in (("score/mean_eos", has_eos), ("score/mean_no_eos", ~has_eos)):
        if bool(rows.any()):
            out[key] = float(scores[rows].mean())
    return out


def check_prompt_lengths(prompts: list[str], tokenizer, max_prompt_length: int) -> None:
    """`ConfigError` when there are no prompts or some exceed `max_prompt_length` tokens (naming the first rows):
    checked by the stage with the tokenizer alone before any model loads, and again by the trainer."""
    if not prompts:
        raise ConfigError("no prompts to train on")
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    too_long = [i for i, n in enumerate(lengths) if n > max_prompt_length]
    if too_long:
        raise ConfigError(f"{len(too_long)} prompt(s) exceed max_prompt_length={max_prompt_length} tokens "
                          f"(first rows: {too_long[:5]}, longest {max(lengths)}); raise it or filter them")


def cuts_policy_forwards(micro_batch_size: int, device: torch.device) -> bool:
    """Whether the policy's forwards read their rows packed (`used_columns.packed`, `PPOTrainer._policy_forward`)."""
    return micro_batch_size == 1 or torch.device(device).type == "cpu"


def splits_no_grad_forwards(device: torch.device) -> bool:
    """Whether the rollout's reward-model and reference forwards take the policy's rows per forward (a micro-batch
    of the sorted chunk, packed) rather than a whole chunk. On a CPU the narrower forwards are faster (the tiny
    model's reference phase, benchmarks/speed_vs_trl_amd_epyc_avx512bf16_at_7e372e7.json against the _at_659a7c1
    record; rows of like length pad less, and the rest was not profiled). A GPU keeps the whole chunk in one forward."""
    return torch.device(device).type == "cpu"


def _in_row_order(order: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """Outputs of chunks taken over the rows `order[0], order[1], …`, concatenated, back in the batch's row order."""
    out = torch.cat(parts)
    back = torch.empty_like(out)
    back[order] = out
    return back


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(1)


def _abs_gap_parts(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(2,): Σ abs(a − b) over the (B, R) `mask`'s tokens, and their count; summed over pieces and ranks, then
    divided (`PPOTrainer._per_token`), the mean absolute gap per token that `rollout/logprob_gap` logs."""
    return torch.stack([_masked_sum((a - b).abs(), mask).sum(), mask.sum().float()])


class PPOTrainer:
    """Runs PPO on `backend` over `prompts` (already rendered with the template)."""

    #: what `check_run_folder` found, when the caller checked the run folder before loading the models
    #: (`ppo.run.run`: `(checkpoint, state)` for a resume, True for a fresh run); None = `train` checks it
    run_folder_checked = None

    def __init__(self, backend: PPOBackend, config: PPOConfig, prompts: list[str], gold_reward_fn=None,
                 reward_fn=None, eval_fn=None):
        """`gold_reward_fn(prompts, responses) -> rewards`, optional: a judge PPO never optimises, only logs
        (`gold/mean` per step). The toy world has one (chapter 11 plots it against the reward model's score).

        `reward_fn(prompts, responses) -> rewards`, optional: what PPO optimises instead of the reward model
        (chapter 13's positive controls, `reward: canonical_refusal` or `keyword_judge`); the reward model's score is still logged.
        `eval_fn(backend) -> dict`, optional: a held-out evaluation, run before training and after every
        `eval_every` updates; each result goes to `eval_curve.jsonl` and into that step's record as `eval/*`."""
        self.backend, self.config, self.tokenizer = backend, config.validate(), backend.tokenizer
        self.gold_reward_fn, self.reward_fn, self.eval_fn = gold_reward_fn, reward_fn, eval_fn
        check_prompt_lengths(prompts, self.tokenizer, config.max_prompt_length)
        self.prompts = list(prompts)
        self.dp = DataParallel.from_environment(backend.device)
        config.validate_data_parallel(self.dp.world_size)
        if config.gradient_checkpointing:
            backend.enable_gradient_checkpointing()
        if config.merged_rollout:
            backend.use_merged_rollout(cache=config.rollout_cache, onednn=config.onednn_matmuls)
        groups = backend.parameter_groups()
        self.dp.broadcast_parameters([p for params in groups.values() for p in params])  # one starting point
        lrs = {"policy": config.learning_rate, "value": config.critic_learning_rate or config.learning_rate}
        self.optimizer = torch.optim.AdamW(
            [{"params": params, "lr": lrs[name], "name": name} for name, params in groups.items() if params],
            lr=config.learning_rate, eps=config.adam_eps, weight_decay=config.weight_decay)
        self.kl_controller = (AdaptiveKLController(config.kl_coef, config.adaptive_kl_target, config.adaptive_kl_horizon)
                              if config.adaptive_kl else FixedKLController(config.kl_coef))
        self.shuffle = torch.Generator().manual_seed(config.seed)
        self.step_index = 0
        self.output_dir = pathlib.Path(config.output_dir)
        self.timer = PhaseTimer(backend.device)

    # ---- data ---------------------------------------------------------------------------

    def batch_prompts(self, step: int) -> list[str]:
        """The prompts of step `step`: a deterministic function of (seed, step), so resuming needs only the step.

        Prompts are visited in a fresh seeded permutation per pass over the data. With `rollouts_per_prompt` = k,
        a step takes batch_size / k prompts and repeats each k times in a row (a group).
        """
        n, k = len(self.prompts), self.config.rollouts_per_prompt
        bs = self.config.batch_size // k
        out = []
        for i in range(step * bs, (step + 1) * bs):
            epoch = i // n
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.config.seed * 100003 + epoch))
            out += [self.prompts[int(order[i % n])]] * k
        return out

    # ---- rollout ------------------------------------------------------------------------

    def _chunks(self, n: int, size: int):
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def _sample(self, prompt_ids, prompt_mask, chunk: int, outputs: str):
        """Sampled (b, P + r) ids of one forward chunk and what the sampler recorded while drawing them: `outputs`
        'ids' (nothing: None), 'logprobs' (`(logprobs,)`, the (b, r) log-probs it drew them with) or 'all'
        (`(logprobs, values, entropy)`, `generate_with_outputs`); `chunk` counts chunks over the global batch."""
        cfg = self.config
        sampling = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                        draw=cfg.token_draw)
        extra = 0
        if cfg.rollout_cache == "static":  # one prompt width for every step: one cache shape, one compiled decode step
            extra = max(0, cfg.max_prompt_length - prompt_ids.shape[1])
            prompt_ids, prompt_mask = left_pad_to(prompt_ids, prompt_mask, cfg.max_prompt_length,
                                                  self.tokenizer.pad_token_id)

        def draw():
            if outputs == "all":
                ids, *recorded = self.backend.generate_with_outputs(prompt_ids, prompt_mask, **sampling)
                return ids, tuple(recorded)
            if outputs == "logprobs":
                ids, logprobs = self.backend.generate(prompt_ids, prompt_mask, with_logprobs=True, **sampling)
                return ids, (logprobs,)
            return self.backend.generate(prompt_ids, prompt_mask, **sampling), None

        if cfg.rollout_seeding == "stream":
            ids, recorded = draw()
        else:
            with fork_all_rngs():
                torch.manual_seed(chunk_seed(cfg.seed, self.step_index, chunk))
                ids, recorded = draw()
        return ids[:, extra:], recorded

    @torch.no_grad()
    def rollout(self, prompts: list[str]) -> Rollout:
        """Experience for the global batch `prompts`. This rank samples, scores and evaluates its shard; the shards
        are gathered (padded to common widths first), and the statistics are computed on the whole batch."""
        cfg, tok, be, dp = self.config, self.tokenizer, self.backend, self.dp
        enc = tok(dp.shard(prompts), return_tensors="pt", padding=True, padding_side="left").to(be.device)
        P = dp.max_int(enc["input_ids"].shape[1])
        prompt_ids, prompt_mask = left_pad_to(enc["input_ids"], enc["attention_mask"], P, tok.pad_token_id)
        B = prompt_ids.shape[0]
        chunks = self._chunks(B, cfg.forward_batch_size)
        first_chunk = dp.rank * len(chunks)

        from_sampler = cfg.old_logprobs == "sampler"
        with self.timer("generate"):  # (a stale merged copy is rebuilt here)
            # sampled from a separate copy (merged_rollout), or corrected by tis_cap: keep the log-probs each token
            # was drawn with, π_sampler. The policy decoding itself differs from its own full forward too, by how the
            # kernels round a one-token step against a whole sequence: under 1e-4 in fp32 (the tiny model's tests),
            # 0.013-0.018 nats/token in bf16 (SmolLM2, chapter 09). old_logprobs: sampler keeps values and entropy too
            record_sampler = not from_sampler and (be.sampling_model() is not be.policy_model or cfg.tis_cap > 0)
            outputs = "all" if from_sampler else "logprobs" if record_sampler else "ids"
            drawn = [self._sample(prompt_ids[c], prompt_mask[c], first_chunk + i, outputs)
                     for i, c in enumerate(chunks)]
        responses = [ids[:, P:] for ids, _ in drawn]
        R = dp.max_int(max(r.shape[1] for r in responses))
        response = torch.cat([torch.nn.functional.pad(r, (0, R - r.shape[1]), value=tok.pad_token_id) for r in responses])
        response_mask = response_mask_from_ids(response, tok.eos_token_id)
        response = torch.where(response_mask, response, tok.pad_token_id)
        input_ids = torch.cat([prompt_ids, response], dim=1)
        attention_mask = torch.cat([prompt_mask.bool(), response_mask], dim=1).long()

        has_eos = ((response == tok.eos_token_id) & response_mask).any(dim=1)
        # the policy's no-grad forwards take the update's rows per forward (micro_batch_size, below); on a CPU the
        # reward model's and the reference's take them too (`splits_no_grad_forwards`)
        micro = [slice(c.start + m.start, c.start + m.stop) for c in chunks
                 for m in self._chunks(c.stop - c.start, cfg.micro_batch_size)]
        no_grad_rows = micro if splits_no_grad_forwards(be.device) else chunks
        with self.timer("score"):
            # the reward model was trained on texts that end with EOS: a response cut off at max_new_tokens is read
            # with EOS appended (the policy's tokens are unchanged), and the truncation is charged explicitly by
            # missing_eos_penalty (transform_scores). 'last_token' reads it mid-sentence: chapter 13's trap.
            score_ids, score_mask = (append_missing_eos(input_ids, attention_mask, has_eos, tok.eos_token_id,
                                                        tok.pad_token_id)
                                     if cfg.truncated_scoring == "append_eos" else (input_ids, attention_mask))
            # the no-grad forwards take each chunk's rows shortest first, each row's prompt and response together
            # at the right (`packed`, `right_aligned`): rows of like length share a forward, and only the shapes
            # change. Sorting within a chunk keeps every chunk's rows what they were (a rank's shard is its chunks
            # on one process too). The reward model reads the last token alone
            lengths = attention_mask.sum(dim=1)
            order = torch.cat([c.start + torch.argsort(lengths[c], stable=True) for c in chunks])
            raw_scores = _in_row_order(order, [be.scores(*right_aligned(score_ids[order[c]], score_mask[order[c]]))
                                               for c in no_grad_rows]).float()
            rm_scores = None
            if self.reward_fn is not None:  # the positive control: PPO optimises this, the reward model is logged
                texts = [t.strip() for t in tok.batch_decode(response, skip_special_tokens=True)]
                rm_scores = raw_scores
                raw_scores = torch.tensor(self.reward_fn(dp.shard(prompts), texts), dtype=torch.float32,
                                          device=raw_scores.device)
            elif cfg.reward == "reward_model_shuffled":  # the negative control: which answer earned which score is lost
                rm_scores = raw_scores
                raw_scores = torch.cat([raw_scores[c][shuffled_order(c.stop - c.start, cfg.seed, self.step_index,
                                                                     first_chunk + i)]
                                        for i, c in enumerate(chunks)])

        # the old log-probs in the update's own rows per forward (micro_batch_size), since the first minibatch's
        # ratio is exp(new - old): GPU kernels can round differently for different batch shapes. On an H100 at 7B,
        # 16 rows vs 1 differed by 0.033 per token on average (0.16 at most) once the LoRA was not zero; with these
        # rows the difference measured 0.0 (benchmarks/gpu_check.json)
        def recorded(k):  # the sampler's k-th (b, r) record of every chunk, in row order, R columns, 0 after each answer
            return torch.cat([torch.nn.functional.pad(out[k], (0, R - out[k].shape[1])) for _, out in drawn]).float()

        if from_sampler:  # as each token was drawn: no policy forward (the update's first minibatch logs the gap)
            logprobs, values, entropy = (recorded(k) * response_mask for k in range(3))
        else:
            logprobs, values, entropy = [], [], []
            for rows in micro:
                with self.timer("policy"):
                    lp, v, ent = self._policy_forward(input_ids[order[rows]], attention_mask[order[rows]], R,
                                                      with_entropy=True)
                logprobs.append(lp); values.append(v); entropy.append(ent)
            logprobs, values, entropy = (_in_row_order(order, x).float() for x in (logprobs, values, entropy))
        ref_logprobs = []
        for c in no_grad_rows:
            with self.timer("reference"):
                ids, mask, r, lengths = packed(input_ids[order[c]], attention_mask[order[c]], R)
                ref_logprobs.append(unpacked(be.reference_logprobs(ids, mask, r, cfg.temperature), lengths, R))
        ref_logprobs = _in_row_order(order, ref_logprobs).float()
        logprob_gap = tis_weights = None
        if record_sampler:
            sampled = recorded(0)
            # the training-inference mismatch: tokens drawn from the sampler, trained on as if from the policy
            logprob_gap = self._per_token([_abs_gap_parts(sampled, logprobs, response_mask)])
            if cfg.tis_cap:  # truncated importance sampling: E_sampler[w · g] = E_policy[g] where w is not capped
                tis_weights = dp.gather(torch.where(response_mask, (logprobs - sampled).exp().clamp(max=cfg.tis_cap),
                                                    0.0))
        # from here on: the global batch, the same on every rank (one process: the tensors as they are)
        input_ids, attention_mask, response_mask, raw_scores, has_eos, logprobs, values, entropy, ref_logprobs = (
            dp.gather(x) for x in (input_ids, attention_mask, response_mask, raw_scores, has_eos, logprobs, values,
                                   entropy, ref_logprobs))
        rm_scores = None if rm_scores is None else dp.gather(rm_scores)
        scores = self.transform_scores(raw_scores, has_eos)

        rewards, _, kls = token_level_rewards(scores, logprobs, ref_logprobs, response_mask, self.kl_controller.value,
                                              cfg.kl_estimator)
        advantages, returns = gae_advantages(values, rewards, response_mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = masked_whiten(advantages, response_mask)
        return Rollout(input_ids, attention_mask, response_mask, raw_scores, scores, has_eos, logprobs, ref_logprobs,
                       values, entropy, rewards, kls, advantages, returns, rm_scores, logprob_gap, tis_weights)

    def transform_scores(self, raw: torch.Tensor, has_eos: torch.Tensor) -> torch.Tensor:
        """Missing-EOS penalty, baseline, group baseline, whitening, clipping — in that order, each only if configured."""
        cfg = self.config
        scores = penalise_missing_eos(raw.clone(), has_eos, cfg.missing_eos_penalty)
        scores = scores - cfg.score_baseline
        if cfg.group_baseline:  # rows k·g … k·g + k − 1 answer one prompt (`batch_prompts`)
            scores = leave_one_out(scores, cfg.rollouts_per_prompt)
        if cfg.whiten_scores and scores.numel() > 1:
            scores = masked_whiten(scores[None], torch.ones_like(scores, dtype=torch.bool)[None])[0]
        if cfg.score_clip is not None:
            scores = scores.clamp(-cfg.score_clip, cfg.score_clip)
        return scores

    # ---- update -------------------------------------------------------------------------

    def update(self, r: Rollout) -> dict[str, float]:
        """`ppo_epochs` passes of minibatch PPO on one rollout; returns mean statistics."""
        cfg = self.config
        B = r.input_ids.shape[0]
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        acc, skipped, epochs_run, stop = defaultdict(list), 0, 0, False
        self.minibatch_stats = []  # one dict per minibatch of this update, skipped or not (the tests read them)
        # old_logprobs: sampler: the first minibatch runs at the rollout's weights, so its new log-probs are the
        # training path's old ones, and |new − old| there is the sampler's gap (its tokens' sum and count)
        gap = [] if cfg.old_logprobs == "sampler" else None
        for _ in range(cfg.ppo_epochs):
            epochs_run += 1
            for mb in torch.randperm(B, generator=self.shuffle).to(r.input_ids.device).split(cfg.mini_batch_size):
                self.optimizer.zero_grad(set_to_none=True)
                mine = self.dp.shard(mb)  # this rank's part of the minibatch (all of it on one process)
                micro_stats = []
                for micro in mine.split(cfg.micro_batch_size):
                    loss, stats = self.micro_batch_loss(r, micro, gap=gap if gap is not None and not acc else None)
                    (loss * (len(micro) / len(mine))).backward()
                    micro_stats.append({k: float(v) for k, v in stats.items()})
                mb_stats = self._global_micro_stats(micro_stats)
                if any(mb_stats["skipped"]):
                    # a ratio beyond the threshold: no optimizer step at all. A zero loss alone is not enough,
                    # AdamW's momentum and weight decay would still move the weights.
                    skipped += 1
                else:
                    self.dp.average_gradients(params)  # every rank now holds the minibatch's mean gradient
                    if cfg.max_grad_norm is not None:
                        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                    self.optimizer.step()
                self.minibatch_stats.append({k: (max(v) if k == "policy/ratio_max" else sum(v) / len(v))
                                             for k, v in mb_stats.items()})
                for k, v in mb_stats.items():
                    acc[k].append(max(v) if k == "policy/ratio_max" else sum(v) / len(v))
                if cfg.early_stopping and cfg.early_stopping_check == "minibatch" and self._kl_too_far(acc):
                    stop = True
                    break
            # trl 0.11 checks once per epoch, on the policykl of the epoch's last minibatch
            if stop or (cfg.early_stopping and cfg.early_stopping_check == "epoch" and self._kl_too_far(acc)):
                stop = True
                break
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.policy_changed()  # a merged rollout copy is rebuilt before the next sample
        out = {k: (max(v) if k == "policy/ratio_max" else sum(v) / len(v)) for k, v in acc.items() if k != "skipped"}
        if gap is not None:
            out["rollout/logprob_gap"] = float(self._per_token(gap))
        out["ppo/skipped_minibatches"] = skipped  # minibatches whose optimizer step was skipped
        out["ppo/epochs"] = epochs_run
        out["ppo/early_stopped"] = float(stop)
        return out

    def _per_token(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Σ of `_abs_gap_parts`' sums over `parts` and every rank, over Σ of their counts."""
        total, count = self.dp.gather(torch.stack(parts).sum(0)[None]).sum(0)
        return total / count.clamp_min(1.0)

    def _global_micro_stats(self, micro_stats: list[dict[str, float]]) -> dict[str, list[float]]:
        """key → its value in every micro-batch of the minibatch, on all ranks in rank order: the list one process
        would have made, so the skip and early-stop decisions and the logged means are the same on every rank."""
        keys = list(micro_stats[0])
        if self.dp.enabled:
            table = torch.tensor([[s[k] for k in keys] for s in micro_stats], dtype=torch.float64)
            micro_stats = [dict(zip(keys, row)) for row in self.dp.gather(table).tolist()]
        return {k: [s[k] for s in micro_stats] for k in keys}

    def _policy_forward(self, input_ids, attention_mask, n_response: int, with_entropy: bool):
        """`backend.policy_forward`, (B, `n_response`) outputs; the rollout's old log-probs and the update's new
        ones both come from here. Packed (`packed`: each row's prompt and response together at the right, the
        columns no row uses cut; outputs back in the batch's layout, zero after each response) where that keeps the
        two forwards of a row alike: one row per forward (the row's own tokens in both), or a CPU, whose fp32
        results differ by batch shape only at rounding (below 2e-6 on the tiny model). A GPU's bf16 kernels round
        by shape (0.033 per token at 7B, 16 rows against 1), and a micro-batch of the update holds other rows, so
        another width, than the rollout's: there the forwards keep the batch's layout."""
        if not cuts_policy_forwards(self.config.micro_batch_size, self.backend.device):
            return self.backend.policy_forward(input_ids, attention_mask, n_response, self.config.temperature,
                                               with_entropy=with_entropy)
        ids, mask, r, lengths = packed(input_ids, attention_mask, n_response)
        out = self.backend.policy_forward(ids, mask, r, self.config.temperature, with_entropy=with_entropy)
        return tuple(unpacked(x, lengths, n_response) for x in out)

    def micro_batch_loss(self, r: Rollout, rows, gap: list | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`ppo_loss` of rollout rows `rows` under the current policy and critic (one forward with the graph).
        `gap`: append [Σ abs(log π_new − log π_old), response tokens] over these rows to it."""
        cfg = self.config
        with self.backend.training_forward():  # checkpointed layers when `gradient_checkpointing`
            logprobs, values, entropy = self._policy_forward(r.input_ids[rows], r.attention_mask[rows], r.n_response,
                                                             with_entropy=cfg.entropy_coef != 0)
        if gap is not None:
            gap.append(_abs_gap_parts(logprobs.detach().float(), r.logprobs[rows], r.response_mask[rows]))
        # truncated importance sampling (tis_cap): the clipped surrogate max(-Aρ, -A·clip(ρ)) times w ≥ 0 is the same
        # surrogate with advantages w·A, so weighting each token's policy loss is scaling its advantage
        advantages = r.advantages[rows] if r.tis_weights is None else r.advantages[rows] * r.tis_weights[rows]
        return ppo_loss(logprobs.float(), r.logprobs[rows], advantages, values.float(), r.values[rows],
                        r.returns[rows], r.response_mask[rows], None if entropy is None else entropy.float(),
                        cliprange=cfg.cliprange, cliprange_value=cfg.cliprange_value, vf_coef=cfg.vf_coef,
                        ent_coef=cfg.entropy_coef, ratio_threshold=cfg.ratio_threshold,
                        loss_aggregation=cfg.loss_aggregation)

    def _kl_too_far(self, acc) -> bool:
        return acc["policy/policykl"][-1] > 1.5 * self.config.early_stopping_target_kl

    # ---- one step -----------------------------------------------------------------------

    def rollout_stats(self, r: Rollout) -> dict[str, float]:
        m = r.response_mask
        returns_var = masked_var(r.returns, m)
        return {
            "score/mean": float(r.raw_scores.mean()),
            "score/std": float(r.raw_scores.std()) if len(r.raw_scores) > 1 else 0.0,
            "score/used_mean": float(r.scores.mean()),
            "kl/k1": float(_masked_sum(r.logprobs - r.ref_logprobs, m).mean()),
            "kl/k3": float(_masked_sum(kl_penalty(r.logprobs, r.ref_logprobs, "k3"), m).mean()),
            "kl/coef": float(self.kl_controller.value),
            # the adaptive controller's aim, so that a reader of the records (`watch.check_run`) knows where the
            # run's KL is meant to sit
            **({"kl/target": self.kl_controller.target} if isinstance(self.kl_controller, AdaptiveKLController)
               else {}),
            "policy/entropy": float(masked_mean(r.entropy, m)),
            "value/mean": float(masked_mean(r.values, m)),
            "value/explained_variance": float(1 - masked_var(r.returns - r.values, m) / returns_var)
            if returns_var > 0 else 0.0,
            "reward/kl_penalty": float(_masked_sum(r.rewards, m).mean() - r.scores.mean()),
            "response/length": float(m.sum(1).float().mean()),
            "response/no_eos_rate": float((~r.has_eos).float().mean()),
            **eos_split_scores(r.raw_scores, r.has_eos),
            **({} if r.logprob_gap is None else {"rollout/logprob_gap": float(r.logprob_gap)}),
            **({} if r.tis_weights is None else {
                "rollout/tis_weight_mean": float(masked_mean(r.tis_weights, m)),
                "rollout/tis_capped_share": float(masked_mean((r.tis_weights >= self.config.tis_cap).float(), m))}),
            # under `reward_fn` (the positive control) the reward model is logged beside what PPO optimises
            **({} if r.reward_model_scores is None else {
                "score/reward_model_mean": float(r.reward_model_scores.mean()),
                "score/reward_model_std": float(r.reward_model_scores.std()) if len(r.reward_model_scores) > 1 else 0.0,
                **{k.replace("score/", "score/reward_model_"): v
                   for k, v in eos_split_scores(r.reward_model_scores, r.has_eos).items()}}),
        }

    def step(self) -> dict[str, float]:
        """One PPO iteration on the next batch of prompts; returns its record."""
        self.timer.seconds.clear()
        t0 = time.perf_counter()
        prompts = self.batch_prompts(self.step_index)
        r = self.rollout(prompts)
        t1 = time.perf_counter()
        record = {"step": self.step_index + 1, **self.rollout_stats(r)}
        if self.gold_reward_fn is not None:  # before the update: the judge sees the rollout the RM scored
            gold = self.gold_reward_fn(prompts, r.texts(self.tokenizer)[1])
            record["gold/mean"] = float(sum(gold) / len(gold))
        with self.timer("update"):
            record.update(self.update(r))
        # the controller sees the estimator the rewards used, summed over each response, averaged over the batch
        self.kl_controller.update(float(_masked_sum(r.kls, r.response_mask).mean()), self.config.batch_size)
        t2 = time.perf_counter()
        tokens = int(r.attention_mask.sum())
        record.update({"time/rollout_s": t1 - t0, "time/update_s": self.timer.seconds["update"], "time/step_s": t2 - t0,
                       "time/tokens_per_s": tokens / (t2 - t0),
                       # sampled (response) tokens per second of the generate phase
                       "time/generate_tokens_per_s": int(r.response_mask.sum()) / max(self.timer.seconds["generate"], 1e-9)})
        record.update({f"time/{p}_s": self.timer.seconds[p] for p in PHASES if p != "update"})
        self.step_index += 1
        self.last_rollout = r
        return record

    # ---- the run: metrics, checkpoints, resume --------------------------------------------

    @property
    def metrics_path(self) -> pathlib.Path:
        return self.output_dir / "metrics.jsonl"

    def train(self, progress: bool = True, trackers=None) -> list[dict]:
        """Run to `total_steps` (from the latest checkpoint when `resume`), writing one JSONL record per step.
        In a data-parallel run every rank trains and returns the records; rank 0 alone writes them."""
        from tqdm.auto import tqdm

        cfg, main = self.config, self.dp.is_main
        # a resume of a run stopped before its first checkpoint starts over (`load_checkpoint` gives None): fresh
        fresh = not cfg.resume or self.load_checkpoint() is None
        if not cfg.resume and not self.run_folder_checked:
            check_run_folder(cfg)  # a fresh run needs a folder without one
        self.dp.barrier()  # every rank has looked before rank 0 writes
        if main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        records = []
        if self.eval_fn is not None and cfg.eval_every and fresh:
            if main:  # a fresh run: a curve left by a start that died in its first evaluation is not this run's
                self.eval_curve_path.unlink(missing_ok=True)
            self._held_out_eval()  # the start of the curve: the policy before any update
        # pass `disable` only to turn the bar off, so TQDM_DISABLE=1 in the environment still wins otherwise
        bar = tqdm(total=cfg.total_steps, initial=self.step_index, desc="ppo",
                   **({} if progress and main else {"disable": True}))
        with (open(self.metrics_path, "a") if main else contextlib.nullcontext()) as log:
            while self.step_index < cfg.total_steps:
                record = self.step()
                if self.eval_fn is not None and cfg.eval_every and self.step_index % cfg.eval_every == 0:
                    record.update({f"eval/{k}": v for k, v in self._held_out_eval().items()})
                records.append(record)
                if log is not None:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                if trackers is not None:
                    trackers.log(record, step=record["step"])
                bar.update(1)
                bar.set_postfix(score=f"{record['score/mean']:.2f}", kl=f"{record['kl/k1']:.2f}")
                if (cfg.save_steps and self.step_index % cfg.save_steps == 0) or self.step_index == cfg.total_steps:
                    self.save_checkpoint()
        bar.close()
        return records

    @property
    def eval_curve_path(self) -> pathlib.Path:
        return self.output_dir / "eval_curve.jsonl"

    def _held_out_eval(self) -> dict:
        """`eval_fn` of the policy after `step_index` updates, appended to `eval_curve.jsonl` (rank 0) as
        `{"updates": n, ...}`. Every rank evaluates (the same weights and seeds give the same answers)."""
        start = time.perf_counter()
        metrics = {**self.eval_fn(self.backend), "time_s": time.perf_counter() - start}
        if self.dp.is_main:
            with open(self.eval_curve_path, "a") as f:
                f.write(json.dumps({"updates": self.step_index, **metrics}) + "\n")
        return {k: v for k, v in metrics.items() if not isinstance(v, list)}  # per-prompt lists stay in the file

    def _rng_state(self) -> dict:
        rng = {"torch": torch.get_rng_state(), "shuffle": self.shuffle.get_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return rng

    def _rng_file(self, rank: int) -> str:
        return "rng.pt" if self.dp.world_size == 1 else f"rng-rank{rank}.pt"

    def save_checkpoint(self) -> pathlib.Path:
        """Write `checkpoints/step-NNNNNN/` atomically: into a temporary directory, then rename, then point
        `checkpoints/latest` at it (itself replaced atomically). A kill at any moment leaves the previous
        checkpoint intact and `latest` naming a complete one.

        Data-parallel: the weights and optimizer are the same on every rank, so rank 0 writes them once; every
        rank's random state is gathered and written beside them (`rng-rank{r}.pt`)."""
        from safetensors.torch import save_file

        rngs = self.dp.gather_objects(self._rng_state())
        root = self.output_dir / "checkpoints"
        name = f"step-{self.step_index:06d}"
        if not self.dp.is_main:
            self.dp.barrier()  # until rank 0 has written the checkpoint
            return root / name
        root.mkdir(parents=True, exist_ok=True)
        tmp, final = root / (name + ".tmp"), root / name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file({k: v.detach().contiguous().cpu() for k, v in self.backend.trainable_state_dict().items()},
                  str(tmp / "trainable.safetensors"))
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        # the policy at this step as a model reference (`generate`, `evaluate`, `merge` read it): a run's answers
        # can be read at each checkpoint, while it runs or after it stopped, without resuming it
        export_policy(self.backend, self.config, tmp / CHECKPOINT_POLICY)
        for rank, rng in enumerate(rngs):
            torch.save(rng, tmp / self._rng_file(rank))
        state = {"step": self.step_index, "data_position": self.step_index * self.config.batch_size,
                 "world_size": self.dp.world_size,
                 "kl_controller": self.kl_controller.state_dict(), "config": asdict(self.config)}
        seal_checkpoint(tmp, state)  # state.json with a sha256 per file; everything fsynced before the rename
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (root / "latest.tmp").write_text(name)
        fsync_path(root / "latest.tmp")  # the pointer's contents on disk before its rename can be
        os.replace(root / "latest.tmp", root / "latest")
        fsync_path(root)  # both renames (the checkpoint's and the pointer's) on disk
        for old in sorted(p for p in root.glob("step-*") if p.name != name and not p.name.endswith(".tmp"))[:-1]:
            shutil.rmtree(old, ignore_errors=True)  # keep the newest two
        self.dp.barrier()
        return final

    def load_checkpoint(self) -> int | None:
        """Restore weights, optimizer, KL controller, RNGs and step from the newest checkpoint that verifies
        (`usable_checkpoint`); cut the metrics file back to that step (a killed run may have logged steps it never
        checkpointed). Refuses a run whose settings differ from the checkpoint's (`check_run_folder`); applies
        `resume_overrides`. None for a run stopped before its first checkpoint: nothing is loaded, its records
        are set aside (`set_aside_stopped_run`) and the run starts over from step 0."""
        from safetensors.torch import load_file

        # `ppo.run.run` checked it before loading any model (hashing every file); otherwise check it now
        checked = self.run_folder_checked or check_run_folder(self.config)
        if checked is None:  # stopped before its first checkpoint (check_run_folder said so): nothing to load
            self.dp.barrier()  # every rank has looked before rank 0 moves the stopped run's records
            if self.dp.is_main:
                set_aside_stopped_run(self.output_dir)
            return None
        ckpt, state = checked
        saved_world = state.get("world_size", 1)
        if saved_world != self.dp.world_size:
            raise ConfigError(f"--resume: {ckpt} was written by a run on {saved_world} rank(s), this one has "
                              f"{self.dp.world_size}: resume with the same number of processes (each rank's random "
                              "state and its shard of every batch belong to that layout)")
        self.backend.load_trainable_state_dict(load_file(str(ckpt / "trainable.safetensors"), device=str(self.backend.device)))
        # weights_only=True: a checkpoint is data, never code (a crafted pickle would run on `--resume`; torch < 2.6
        # defaults to False, so say it explicitly for every file). Tensors, dicts, tuples and ints are all we store.
        self.optimizer.load_state_dict(load_data(ckpt / "optimizer.pt", map_location=self.backend.device))
        rng = load_data(ckpt / self._rng_file(self.dp.rank))
        torch.set_rng_state(rng["torch"])
        self.shuffle.set_state(rng["shuffle"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        # resume_overrides take effect for real: the restored optimizer and controller carry the old values
        overrides = set(self.config.resume_overrides)
        for group in self.optimizer.param_groups:
            if group.get("name") == "policy" and "learning_rate" in overrides:
                group["lr"] = self.config.learning_rate
            if group.get("name") == "value" and overrides & {"learning_rate", "critic_learning_rate"}:
                group["lr"] = self.config.critic_learning_rate or self.config.learning_rate
        if "kl_coef" in overrides:
            self.kl_controller.value = float(self.config.kl_coef)
        self.step_index = state["step"]
        if self.dp.is_main:
            keep_records_up_to(self.metrics_path, "step", self.step_index)
            keep_records_up_to(self.eval_curve_path, "updates", self.step_index)
        return self.step_index


def read_metrics(path) -> list[dict]:
    """The records of a run's `metrics.jsonl` (a last line half-written by a killed run is ignored)."""
    return read_jsonl(path)


def fork_all_rngs():
    """`torch.random.fork_rng` over the CPU and every visible CUDA device: `manual_seed` inside it reseeds them
    all, so all of them must be restored on exit, or evaluation would shift the training run's CUDA samples."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    return torch.random.fork_rng(devices=devices)


def sample_responses(backend: PPOBackend, prompts: list[str], max_new_tokens: int = 32, temperature: float = 1.0,
                     batch_size: int = 64, seed: int = 0,
                     with_finished: bool = False) -> list[str] | tuple[list[str], list[bool]]:
    """Sampled responses of the backend's current policy, without touching the training RNG stream. With
    `with_finished`, also whether each ended with EOS (False: cut off at `max_new_tokens`), read from the sampled
    ids: `(responses, finished)`."""
    tok = backend.tokenizer
    out, finished = [], []
    with fork_all_rngs():
        torch.manual_seed(seed)  # seeds CPU and every CUDA device; fork_all_rngs restores them all
        for start in range(0, len(prompts), batch_size):
            enc = tok(prompts[start:start + batch_size], return_tensors="pt", padding=True, padding_side="left").to(backend.device)
            ids = backend.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=max_new_tokens,
                                   temperature=temperature)
            new = ids[:, enc["input_ids"].shape[1]:]
            finished += (new == tok.eos_token_id).any(dim=1).tolist()
            out += tok.batch_decode(new, skip_special_tokens=True)
    texts = [text.strip() for text in out]
    return (texts, finished) if with_finished else texts


def sample_toy(backend: PPOBackend, world, repeats: int = 4, max_new_tokens: int = 32, seed: int = 0,
               temperature: float = 1.0) -> list[dict]:
    """One record per sampled answer to the toy world's held-out prompts, each asked `repeats` times:
    question, kind, response, whether it ended with EOS (`finished`), the judge's verdict, the gold reward and the
    reward model's score.

    Chapter 11 builds its intervals from these records (`marlhf_edu.math.evaluation.group_outcomes`)."""
    prompts = [p for p in world.eval_prompts for _ in range(repeats)]
    responses, finished = sample_responses(backend, [p.prompt for p in prompts], max_new_tokens, temperature,
                                           seed=seed, with_finished=True)
    # scored as the reward model was trained: the book's " answer" after the toy prompt, the bare answer after a
    # chat template's assistant header
    template = template_for(backend.tokenizer)
    texts = [p.prompt + template.completion(r) for p, r in zip(prompts, responses)]
    scores = score_texts_with(backend.scores, backend.tokenizer, texts, device=backend.device)
    return [{"question": p.question, "kind": p.kind, "response": r, "finished": f, "verdict": world.judge(p, r),
             "gold": world.gold_reward(p, r), "reward_model_score": float(s)}
            for p, r, f, s in zip(prompts, responses, finished, scores.tolist())]


def toy_metrics(world, samples: list[dict], repeats: int) -> dict:
    """`ToyWorld.evaluate`'s rates of `sample_toy(..., repeats)` records and their mean reward-model score."""
    metrics = world.evaluate(lambda _: [s["response"] for s in samples],
                             prompts=[p for p in world.eval_prompts for _ in range(repeats)])
    metrics["reward_model_score"] = sum(s["reward_model_score"] for s in samples) / len(samples)
    return metrics


def evaluate_toy(backend: PPOBackend, world, repeats: int = 4, max_new_tokens: int = 32, seed: int = 0) -> dict:
    """The toy world's evaluation of the current policy, with mean reward-model score of its answers."""
    return toy_metrics(world, sample_toy(backend, world, repeats, max_new_tokens, seed), repeats)
