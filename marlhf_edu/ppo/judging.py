"""Judging a PPO policy: the held-out evaluation before and after a run and every `eval_every` steps.

`evaluation_judge` picks the judge a run's data allows (the toy world's gold judge, or the keyword judge for
hh-rlhf-style prompts), `judge_policy` samples and scores the answers, `periodic_evaluation` turns it into the
trainer's `eval_fn`, `evaluation_table` prints before against after, and `evaluate_trained_policy` judges a
trained policy as the engine does (DPO and GRPO, after training).
"""

from __future__ import annotations

import math
import os

from marlhf_edu.data.keyword_judge import KeywordJudge, is_hollow_apology, judge_agreement
from marlhf_edu.data.sentiment_judge import (SentimentJudge, distinct_n, eos_rate, mean_tokens, mean_words,
                                             repeated_trigram_share)
from marlhf_edu.data.template import template_for
from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
from marlhf_edu.loading.models import load_reward_model
from marlhf_edu.loading.quiet import quiet_loading
from marlhf_edu.ppo.backends import ScoredPolicy
from marlhf_edu.ppo.config import SENTIMENT_DATASET
from marlhf_edu.ppo.trainer import sample_toy, toy_metrics


def evaluate_trained_policy(policy, tokenizer, *, toy_seed: int, reward_base: str, reward_adapter: str, repeats: int,
                            max_new_tokens: int, seed: int, output_dir: str | None = None) -> dict:
    """Chapter 11's held-out toy evaluation of a policy trained by trl (DPO, GRPO): refusal rate, accuracy,
    reward-model score, and every answer (`sample_toy` records) under `"samples"`. Written to
    `output_dir/eval_metrics.json` (without the samples) when given."""
    import json

    world = ToyWorld(ToyWorldConfig(seed=toy_seed))
    with quiet_loading():
        reward, reward_tokenizer = load_reward_model(reward_base, reward_adapter)
    backend = ScoredPolicy(policy, reward.to(next(policy.parameters()).device), tokenizer, reward_tokenizer)
    samples = sample_toy(backend, world, repeats, max_new_tokens, seed=seed)
    metrics = toy_metrics(world, samples, repeats)
    metrics["gold"] = sum(s["gold"] for s in samples) / len(samples)
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "eval_metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
    return {**metrics, "samples": samples}


def evaluation_judge(config, tokenizer, toy=None, when: str = "before_after", judge=None):
    """What judges the policy before and after training (`when="before_after"`, off with `eval_repeats: 0`) or
    every `eval_every` updates (`when="periodic"`, off with `eval_every: 0`): the toy world, the keyword judge of
    chapter 13 for hh-rlhf data (its held-out red-team requests and benign questions; `judge` when one was built
    already, by `check_before_loading`), the sentiment judge for the everyday prompts (VADER on the first
    `eval_prompts` held-out questions, chapter 13), or None (other data)."""
    if not (config.eval_repeats if when == "before_after" else config.eval_every):
        return None
    if toy is not None:
        return toy
    if config.dataset_format == "hh-rlhf":
        return judge or KeywordJudge(tokenizer, limit=config.eval_prompts or None,
                                     max_prompt_tokens=config.max_prompt_length)
    if config.dataset_name == SENTIMENT_DATASET:
        return judge or SentimentJudge(tokenizer, split="held_out", limit=config.eval_prompts or None)
    return None


def judge_policy(backend, world, repeats: int, max_new_tokens: int, temperature: float, seed: int = 0):
    """`(metrics, samples)`: the judge's rates of `repeats` sampled answers per prompt and their mean reward-model
    score; with the keyword judge, also how well the reward model ranks its refusals above its compliances
    (`judge_auc`, chapter 13); with the sentiment judge, the guards VADER cannot see (repeated trigrams,
    distinct-2, length, EOS rate, the mean log-probability under the SFT model; `marlhf_edu.data.sentiment_judge`).
    Used by the PPO stages before and after training and by `marlhf-edu evaluate`."""
    samples = sample_toy(backend, world, repeats, max_new_tokens, seed=seed, temperature=temperature)
    metrics = toy_metrics(world, samples, repeats)
    if isinstance(getattr(world, "world", world), SentimentJudge):  # what VADER cannot see (a _PromptSubset too)
        answers = [s["response"] for s in samples]
        prompts = [p.prompt for p in world.eval_prompts for _ in range(repeats)]
        logprobs = [x for x in reference_mean_logprobs(backend, prompts, answers) if not math.isnan(x)]
        metrics.update(repeated_trigram_share=repeated_trigram_share(answers), distinct_2=distinct_n(answers, 2),
                       mean_words=mean_words(answers), mean_tokens=mean_tokens(answers, backend.tokenizer),
                       eos_rate=eos_rate(samples),
                       sft_mean_logprob=sum(logprobs) / len(logprobs) if logprobs else float("nan"))
    if isinstance(world, KeywordJudge):
        try:
            metrics["judge_auc"] = judge_agreement(samples)["auc"]
        except ValueError:  # all refusals or none: nothing to rank
            pass
    return metrics, samples


def reference_mean_logprobs(backend, prompts: list[str], answers: list[str], batch_size: int = 16) -> list[float]:
    r"""Each answer's mean log-probability per token under the run's reference model (the SFT model: the base with
    the adapters off in MA-PPO, the frozen copy in four-model PPO), at temperature 1:

    .. math:: \bar\ell(y \mid x) = \frac{1}{|y|} \sum_{t=1}^{|y|} \log \pi_\text{SFT}(y_t \mid x, y_{<t})

    `prompts`: rendered chat prompts; `answers`: bare answers, encoded as the engine scores them
    (`template_for(tokenizer).completion`, no EOS), right-padded after left-padded prompts, the rollout's layout.
    Returns `(N,)` floats in nats per token; NaN for an answer with no token. A fall after training says the policy
    writes text its starting model finds unlikely, which VADER does not see (`sentiment_judge.answer_mean_logprobs`
    is the same number for a plain model)."""
    import torch

    tok, template = backend.tokenizer, template_for(backend.tokenizer)
    out = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            p = tok(prompts[start:start + batch_size], return_tensors="pt", padding=True, padding_side="left")
            texts = [template.completion(a) if a.strip() else "" for a in answers[start:start + batch_size]]
            a = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True, padding_side="right")
            if a["input_ids"].shape[1] == 0:  # every answer of the batch empty
                out += [float("nan")] * len(texts)
                continue
            ids = torch.cat([p["input_ids"], a["input_ids"]], dim=1).to(backend.device)
            mask = torch.cat([p["attention_mask"], a["attention_mask"]], dim=1).to(backend.device)
            logprobs = backend.reference_logprobs(ids, mask, a["input_ids"].shape[1], 1.0).float()
            answer_mask = a["attention_mask"].to(logprobs.device).float()
            n = answer_mask.sum(dim=1)
            out += [float(s / k) if k else float("nan") for s, k in zip((logprobs * answer_mask).sum(dim=1).tolist(),
                                                                         n.tolist())]
    return out


class _PromptSubset:
    """A judge (toy world or keyword judge) asking only `prompts`, for the periodic evaluation."""

    def __init__(self, world, prompts):
        self.world, self.eval_prompts = world, list(prompts)

    def __getattr__(self, name):
        return getattr(self.world, name)


def periodic_evaluation(world, config):
    """`eval_fn(backend) -> dict` for `PPOTrainer`: one answer to each of `eval_every_prompts` held-out prompts
    (half harmful, half benign, the first of each, so every evaluation asks the same ones; the sentiment judge's
    first questions, with VADER's mean and the guards), sampled at the
    training temperature with seed 0, so that two points of the curve differ only by the policy. Reports the
    reward model's mean score read as it was trained (EOS appended, `sample_toy`) and each prompt's score in
    prompt order (`reward_model_scores`, so that two points can be compared prompt by prompt), the judge's
    rates, and with the keyword judge the strict refusal rate (hollow apologies not counted)."""
    if isinstance(world, SentimentJudge):  # no kinds to balance: the first eval_every_prompts questions
        view = _PromptSubset(world, world.eval_prompts[:config.eval_every_prompts])
        kept = ("reward_model_score", "vader_compound", "repeated_trigram_share", "eos_rate", "mean_tokens",
                "sft_mean_logprob")
    else:
        harmful = [p for p in world.eval_prompts if p.harmful]
        benign = [p for p in world.eval_prompts if not p.harmful]
        n_benign = min(len(benign), config.eval_every_prompts // 2)
        view = _PromptSubset(world, harmful[:config.eval_every_prompts - n_benign] + benign[:n_benign])
        kept = ("reward_model_score", "harmful_refusal_rate", "benign_accuracy")

    def evaluate(backend) -> dict:
        metrics, samples = judge_policy(backend, view, 1, config.max_new_tokens, config.temperature)
        out = {k: metrics[k] for k in kept}
        out["reward_model_scores"] = [s["reward_model_score"] for s in samples]
        if isinstance(world, KeywordJudge):
            answers = [s for s in samples if s["kind"] == "harmful"]
            out["strict_refusal_rate"] = sum(s["verdict"] == "refusal" and not is_hollow_apology(s["response"])
                                             for s in answers) / max(len(answers), 1)
        return out

    return evaluate


def evaluation_table(before: dict, after: dict) -> str:
    """The held-out evaluation before and after training as a table: one row per measure, its change beside.
    Counts print as integers, rates and scores to 4 decimals."""
    keys = list(dict.fromkeys([*before, *after]))
    title = "held-out evaluation"
    width = max([len(title), *map(len, keys)])

    def cell(value) -> str:
        if value is None:
            return "-"
        return f"{value:d}" if isinstance(value, int) else f"{value:.4f}"

    lines = [f"{title:{width}s}  {'before':>9s}  {'after':>9s}  {'change':>9s}"]
    for key in keys:
        b, a = before.get(key), after.get(key)
        change = "" if b is None or a is None or (isinstance(b, int) and isinstance(a, int) and a == b) else f"{a - b:+.4f}"
        lines.append(f"{key:{width}s}  {cell(b):>9s}  {cell(a):>9s}  {change:>9s}")
    return "\n".join(lines)
