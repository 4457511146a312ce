"""Judging the sentiment of a real model's answers: VADER as the labeller and gold judge, and the guards it cannot see.

Ziegler et al. (2019) began RLHF for language models by training a reward model on human comparisons of
continuations for positive sentiment. Chapter 13 repeats that experiment on SmolLM2-135M with VADER (Hutto &
Gilbert 2014, `vaderSentiment` 3.3.2, MIT; its lexicon ships inside the package, so it runs offline) standing in
for the human labellers:

* **The labeller.** `sentiment_pairs` turns several answers to the same prompt into preference pairs, the answer
  VADER scores higher as chosen, for the book's reward-model recipe.
* **The gold judge.** `SentimentJudge` scores answers with VADER's compound score, a number in [-1, 1] (≥ 0.05
  positive, ≤ -0.05 negative, by VADER's authors' convention). A PPO run that optimises the learned reward model
  never sees VADER, so VADER measures whether it learned what the pairs taught. `sentiment_reward` makes VADER
  itself the reward (the positive control).
* **The guards.** VADER pays for "great great great" (0.92) and for cheer that answers nothing, so every
  evaluation also reports what it cannot see: `repeated_trigram_share`, `distinct_n`, `mean_words` and
  `mean_tokens`, `eos_rate`, and `answer_mean_logprobs` under the SFT model. `sentiment_report` gives them all
  for one set of answers.
* **The change.** `gold_change`: the gold score after training against before, paired by question, over one
  run's evaluation or several runs' pooled.

Taught in chapter 13.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

from marlhf_edu.data.everyday import everyday_prompts
from marlhf_edu.data.keyword_judge import JudgedPrompt
from marlhf_edu.data.template import template_for
from marlhf_edu.math.dpo import completion_logprobs
from marlhf_edu.math.evaluation import paired_bootstrap_difference

#: VADER's authors' thresholds on the compound score: at least this is positive, at most minus this negative.
POSITIVE_THRESHOLD = 0.05

#: A word: letters and digits, with inner apostrophes kept ("don't" is one word), on lower-cased text.
_WORD = re.compile(r"[0-9a-z]+(?:'[0-9a-z]+)*")


@functools.cache
def _analyzer() -> SentimentIntensityAnalyzer:
    # reads VADER's two lexicon files from its own package folder (no network): once per process
    return SentimentIntensityAnalyzer()


def vader_compound(text: str) -> float:
    """VADER's compound score of `text`: the sum of its words' lexicon valences, adjusted by VADER's rules
    (negation, "but", intensifiers, capitals, "!"), squashed into [-1, 1] by s / sqrt(s² + 15). An empty or
    lexicon-free text scores 0."""
    return float(_analyzer().polarity_scores(text)["compound"])


class SentimentJudge:
    """Chapter 13's gold judge over the everyday prompts of one split (`marlhf_edu.data.everyday`), with the
    keyword judge's evaluation interface (`eval_prompts`, `judge`, `gold_reward`, `gold_rewards`, `evaluate`),
    so `marlhf_edu.ppo.sample_toy` samples and judges a real policy on it unchanged.

    `tokenizer` renders each question with its chat template (the book's template for the toy tokenizer or
    None); `limit` keeps the first prompts of the split. Calling the judge on answers gives their VADER compound
    scores, `(N,)` floats in [-1, 1].
    """

    def __init__(self, tokenizer=None, split: str = "held_out", limit: int | None = None,
                 system: str | None = None):
        template = template_for(tokenizer, system)
        questions = everyday_prompts(split)[:limit]
        self.eval_prompts = [JudgedPrompt(q, "everyday", template.dialogue([(q, None)])) for q in questions]
        self._by_text = {p.prompt: p for p in self.eval_prompts}

    def __call__(self, responses: Iterable[str]) -> list[float]:
        return [vader_compound(r) for r in responses]

    def judge(self, p: JudgedPrompt, response: str) -> str:
        """'positive', 'neutral' or 'negative': the compound score against ±`POSITIVE_THRESHOLD`."""
        score = vader_compound(response)
        return "positive" if score >= POSITIVE_THRESHOLD else "negative" if score <= -POSITIVE_THRESHOLD else "neutral"

    def gold_reward(self, p: JudgedPrompt, response: str) -> float:
        """The compound score of `response` (the prompt is not read: VADER judges the answer alone)."""
        return vader_compound(response)

    def gold_rewards(self, prompts: list[str], responses: list[str]) -> list[float]:
        """`gold_reward` of rendered prompts of this judge and their responses, as the PPO loop's `gold_reward_fn`
        takes them; a prompt that is not one of `eval_prompts` is refused (KeyError naming it)."""
        out = []
        for prompt, response in zip(prompts, responses, strict=True):
            if prompt not in self._by_text:
                raise KeyError(f"SentimentJudge: not one of its prompts: {prompt!r}")
            out.append(self.gold_reward(self._by_text[prompt], response))
        return out

    def evaluate(self, generate: Callable[[list[str]], list[str]], prompts: Iterable[JudgedPrompt] | None = None,
                 repeats: int = 1) -> dict:
        """Score any policy, `generate(prompt_texts) -> response_texts`, on `eval_prompts` (or `prompts`), each
        asked `repeats` times: the mean compound score (`vader_compound`), the shares judged positive and
        negative, and the count `n`."""
        prompts = [p for p in (self.eval_prompts if prompts is None else prompts) for _ in range(repeats)]
        responses = generate([p.prompt for p in prompts])
        if len(responses) != len(prompts):
            raise ValueError(f"generate returned {len(responses)} responses for {len(prompts)} prompts")
        verdicts = [self.judge(p, r) for p, r in zip(prompts, responses)]
        n = max(len(prompts), 1)
        return {"vader_compound": sum(self(responses)) / n, "positive_rate": verdicts.count("positive") / n,
                "negative_rate": verdicts.count("negative") / n, "n": len(prompts)}


def sentiment_reward(template=None) -> Callable[[list[str], list[str]], list[float]]:
    """The positive control's reward for PPO: `reward(prompts, responses)` gives each response's VADER compound
    score, a float in [-1, 1], one per response (prompts and responses must have the same length).

    `template` is taken so that the PPO stage builds every judge's reward alike (`keyword_reward(template)`);
    VADER reads the answer alone, so it is not used."""

    def reward(prompts: list[str], responses: list[str]) -> list[float]:
        return [vader_compound(response) for _, response in zip(prompts, responses, strict=True)]

    return reward


def sentiment_pairs(samples: list[dict], margin: float = 0.3, per_prompt: int | None = None) -> list[dict]:
    """Preference pairs labelled by VADER: for each prompt of `samples` (dicts with `prompt`, the rendered chat
    prompt, and `response`), every two of its answers whose compound scores (`vader_compound`) differ by at least
    `margin`, the higher-scoring one as chosen; at most `per_prompt` pairs a prompt (largest gaps first), prompts
    in order of first appearance.

    Returns rows `{"prompt", "chosen", "rejected"}` (answers stripped), trl's pair format that the `rm` stage
    reads (`extra_pairs_file`), as `keyword_pairs.policy_pairs` does. Answers to different prompts are never
    paired: the pair asks which answer *to this prompt* is better, the question best-of-N and PPO ask.
    """
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin > 0):
        raise ValueError(f"sentiment_pairs: margin must be a finite number > 0, got {margin!r}")
    if per_prompt is not None and per_prompt < 1:
        raise ValueError(f"sentiment_pairs: per_prompt must be >= 1 or None, got {per_prompt}")
    by_prompt: dict[str, list[tuple[float, str]]] = {}
    for i, s in enumerate(samples):
        for key in ("prompt", "response"):
            if not isinstance(s.get(key), str):
                raise ValueError(f"sentiment_pairs: sample {i} has no text {key!r}")
        answer = s["response"].strip()
        by_prompt.setdefault(s["prompt"], []).append((vader_compound(answer), answer))
    out = []
    for prompt, answers in by_prompt.items():
        pairs = []  # (gap, chosen, rejected) for every two answers, in the answers' order
        for k, a in enumerate(answers):
            for b in answers[k + 1:]:
                high, low = (a, b) if a[0] > b[0] else (b, a)
                if high[0] - low[0] >= margin:
                    pairs.append((high[0] - low[0], high[1], low[1]))
        if per_prompt is not None:  # stable sort: equal gaps keep the answers' order
            pairs = sorted(pairs, key=lambda p: -p[0])[:per_prompt]
        out += [{"prompt": prompt, "chosen": chosen, "rejected": rejected} for _, chosen, rejected in pairs]
    return out





def answer_words(answer: str) -> list[str]:
    """The words of `answer`: runs of letters and digits (inner apostrophes kept) of the lower-cased text, curly
    apostrophes made straight; punctuation is not a word. `"Don't stop, don't!"` → `["don't", "stop", "don't"]`."""
    return _WORD.findall(answer.lower().replace("\u2019", "'").replace("\u2018", "'"))


def _ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def repeats_trigram(answer: str) -> bool:
    """Whether some word trigram (three consecutive `answer_words`) occurs at least twice in `answer`, overlapping
    occurrences counted: "the cat sat and the cat sat" and "a a a a" repeat one; an answer under 4 words cannot."""
    return any(count > 1 for count in Counter(_ngrams(answer_words(answer), 3)).values())


def repeated_trigram_share(answers: list[str]) -> float:
    """The share of `answers` that repeat a word trigram (`repeats_trigram`): the degenerate loop that a policy
    finds when repeating a pleasing phrase raises its reward."""
    if not answers:
        raise ValueError("repeated_trigram_share: no answers")
    return sum(repeats_trigram(a) for a in answers) / len(answers)


def distinct_n(answers: list[str], n: int = 2) -> float:
    r"""Distinct-n of a set of answers (Li et al. 2016): the number of distinct word n-grams over the number of
    all word n-grams, pooled over `answers` (n-grams taken within each answer, never across two):

    .. math:: \text{distinct-}n = |\{g\}| \,/\, \textstyle\sum_i \max(0, w_i - n + 1)

    with w_i the words of answer i. 1.0: no n-gram is said twice anywhere; it falls as answers repeat
    themselves or each other. NaN when no answer has n words (no n-gram to count).
    """
    if n < 1:
        raise ValueError(f"distinct_n: n must be >= 1, got {n}")
    grams = [g for a in answers for g in _ngrams(answer_words(a), n)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def mean_words(answers: list[str]) -> float:
    """The mean number of `answer_words` per answer (an empty answer counts 0)."""
    if not answers:
        raise ValueError("mean_words: no answers")
    return sum(len(answer_words(a)) for a in answers) / len(answers)


def mean_tokens(answers: list[str], tokenizer) -> float:
    """The mean number of tokens per answer, as `tokenizer` encodes each answer alone (no special tokens)."""
    if not answers:
        raise ValueError("mean_tokens: no answers")
    return sum(len(ids) for ids in tokenizer(list(answers), add_special_tokens=False)["input_ids"]) / len(answers)


def ended_with_eos(answers: list[str], tokenizer, max_new_tokens: int, slack: int = 2) -> list[bool]:
    """Whether each answer ended with EOS before the length limit, read from its text: True when `tokenizer`
    encodes it (no special tokens) in fewer than `max_new_tokens - slack` tokens.

    For records written without the sampler's own flag (the engine's `eval_samples.jsonl` has `finished`, read
    from the sampled ids; bare texts and other tools' records may not): the decoded text, stripped and encoded
    again, can take a token or two fewer than were sampled, so an answer that ended with EOS within `slack`
    tokens of the limit counts as cut off (the rule `tools/experiments/smollm2_reward/policy_pairs_smollm2.py`
    writes as `finished`).
    """
    if max_new_tokens - slack < 1:
        raise ValueError(f"ended_with_eos: max_new_tokens - slack must be >= 1, got {max_new_tokens} - {slack}")
    return [len(ids) < max_new_tokens - slack
            for ids in tokenizer(list(answers), add_special_tokens=False)["input_ids"]]


def eos_rate(records: list[dict]) -> float:
    """The share of `records` whose answer ended with EOS: each record's `finished` (a bool, True when the answer
    ended with EOS, False when the length limit cut it off). A record without one is refused, naming it: build
    the flag with `ended_with_eos` for records that lack it."""
    if not records:
        raise ValueError("eos_rate: no records")
    for i, r in enumerate(records):
        if not isinstance(r.get("finished"), bool):
            raise ValueError(f"eos_rate: record {i} has no bool 'finished' (got {r.get('finished')!r}); "
                             "add it with ended_with_eos(answers, tokenizer, max_new_tokens)")
    return sum(r["finished"] for r in records) / len(records)


@torch.no_grad()
def answer_mean_logprobs(model, tokenizer, prompts: list[str], answers: list[str],
                         batch_size: int = 16) -> list[float]:
    r"""The mean log-probability per token of each answer under `model`, given its prompt:

    .. math:: \bar\ell(y \mid x) = \frac{1}{|y|} \sum_{t=1}^{|y|} \log \pi(y_t \mid x, y_{<t})

    `prompts`: rendered chat prompts; `answers`: the bare answers, read as the engine reads them (the
    template's completion, `template_for(tokenizer).completion`, encoded after the prompt's own tokens, no
    EOS). Rows are right-padded in batches of `batch_size`; each row's sum is `dpo.completion_logprobs`
    (the package's `logprobs_from_logits`, one-token shift), so padding does not change a row. Returns `(N,)`
    floats in nats per token; NaN for a blank answer (no token to score). The model runs in its current mode
    (call `.eval()` first); under the SFT model, a fall in this mean says the policy writes text its starting
    model finds unlikely, which VADER does not see.
    """
    if len(prompts) != len(answers):
        raise ValueError(f"answer_mean_logprobs: {len(prompts)} prompts for {len(answers)} answers")
    if batch_size < 1:
        raise ValueError(f"answer_mean_logprobs: batch_size must be >= 1, got {batch_size}")
    template = template_for(tokenizer)
    prompt_ids = tokenizer(list(prompts))["input_ids"]
    # an empty answer has no token to score (the book's template would read it as one space)
    encoded = tokenizer([template.completion(a) for a in answers], add_special_tokens=False)["input_ids"]
    answer_ids = [ids if a.strip() else [] for a, ids in zip(answers, encoded)]
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for start in range(0, len(prompts), batch_size):
        rows = list(zip(prompt_ids[start:start + batch_size], answer_ids[start:start + batch_size]))
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        completion = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, a) in enumerate(rows):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a, dtype=torch.long)
            mask[i, :len(p) + len(a)] = 1
            completion[i, len(p):len(p) + len(a)] = 1
        sums = completion_logprobs(model, ids.to(device), mask.to(device), completion.to(device))
        out += [s / len(a) if a else float("nan") for s, (_, a) in zip(sums.tolist(), rows)]
    return out


def sentiment_report(samples: list[dict], tokenizer=None, model=None, max_new_tokens: int | None = None) -> dict:
    """VADER's verdict and every guard for one set of answers, so each evaluation reports the same numbers.

    `samples`: dicts with `response` and, for the log-probability guard, `prompt` (rendered); `finished`
    (bool) when the sampler recorded it. Returns:

    * `n`; `vader_compound` (mean compound score), `vader_compound_std` (population std), `positive_rate` (share
      ≥ `POSITIVE_THRESHOLD`);
    * `repeated_trigram_share`, `distinct_2` (`distinct_n` with n = 2), `mean_words`;
    * `mean_tokens` (with `tokenizer`), `eos_rate` (from `finished` when every sample has it, else from the
      text by `ended_with_eos` with `tokenizer` and `max_new_tokens`), `mean_logprob` (with `model` and
      `tokenizer`: the mean over answers of `answer_mean_logprobs`, empty answers left out).

    A guard that cannot be computed from what is given is None.
    """
    if not samples:
        raise ValueError("sentiment_report: no samples")
    answers = [s["response"] for s in samples]
    scores = [vader_compound(a) for a in answers]
    mean = sum(scores) / len(scores)
    report = {"n": len(samples), "vader_compound": mean,
              "vader_compound_std": math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores)),
              "positive_rate": sum(s >= POSITIVE_THRESHOLD for s in scores) / len(scores),
              "repeated_trigram_share": repeated_trigram_share(answers), "distinct_2": distinct_n(answers, 2),
              "mean_words": mean_words(answers), "mean_tokens": None, "eos_rate": None, "mean_logprob": None}
    if tokenizer is not None:
        report["mean_tokens"] = mean_tokens(answers, tokenizer)
    if all(isinstance(s.get("finished"), bool) for s in samples):
        report["eos_rate"] = eos_rate(samples)
    elif tokenizer is not None and max_new_tokens is not None:
        finished = ended_with_eos(answers, tokenizer, max_new_tokens)
        report["eos_rate"] = sum(finished) / len(finished)
    if model is not None and tokenizer is not None:
        missing = [i for i, s in enumerate(samples) if not isinstance(s.get("prompt"), str)]
        if missing:
            raise ValueError(f"sentiment_report: the log-probability guard needs each sample's 'prompt'; sample "
                             f"{missing[0]} has none")
        logprobs = [x for x in answer_mean_logprobs(model, tokenizer, [s["prompt"] for s in samples], answers)
                    if not math.isnan(x)]
        report["mean_logprob"] = sum(logprobs) / len(logprobs) if logprobs else float("nan")
    return report


def gold_by_question(samples: list[dict], when: str) -> dict[str, list[float]]:
    """Each question's gold scores on one side of training: `samples` are a run's evaluation rows (`question`,
    `when` = 'before' or 'after', `gold`, as `eval_samples.jsonl` holds them); the questions in first-seen order."""
    per: dict[str, list[float]] = {}
    for i, s in enumerate(samples):
        missing = [key for key in ("question", "when", "gold") if key not in s]
        if missing:
            raise ValueError(f"gold_by_question: sample {i} has no {missing[0]!r}")
        if s["when"] not in ("before", "after"):
            raise ValueError(f"gold_by_question: sample {i} has when={s['when']!r}; expected 'before' or 'after'")
        if s["when"] == when:
            per.setdefault(s["question"], []).append(s["gold"])
    return per


def gold_change(runs: list[list[dict]], confidence: float = 0.95) -> tuple[float, float, float]:
    r"""(gold after − gold before, low, high), paired by question, over one or more runs' evaluation rows.

    `runs[r]` is run r's evaluation samples (see `gold_by_question`). Each held-out question q pools its answers
    from every run, and `evaluation.paired_bootstrap_difference` (chapter 12) resamples questions:

    .. math:: \Delta = \frac{\sum_q \sum_{r} a_{qr}}{\sum_q n^a_q} - \frac{\sum_q \sum_{r} b_{qr}}{\sum_q n^b_q}

    With one run it is that run's change. With several it holds those runs' policies fixed and counts how the
    questions vary: a t-interval over the runs' own changes (`evaluation.mean_interval`) is the one that counts
    how seeds vary. Runs whose "before" answers are the same sample (the book's runs: the evaluation draws with
    its own seed) repeat them once per run, which leaves each question's mean unchanged. Raises ValueError when a
    run asks other questions than the first, or a question lacks answers on one side.
    """
    if not runs:
        raise ValueError("gold_change: no runs")
    sides = [(gold_by_question(s, "before"), gold_by_question(s, "after")) for s in runs]
    questions = list(sides[0][0])
    for r, (before, after) in enumerate(sides):
        for name, side in (("before", before), ("after", after)):
            if set(side) != set(questions):
                odd = sorted(set(side) ^ set(questions))
                raise ValueError(f"gold_change: run {r}'s {name} answers cover other questions than run 0's "
                                 f"before answers (e.g. {odd[0]!r}); pair runs over the same held-out questions")
    pooled = [([x for before, _ in sides for x in before[q]], [x for _, after in sides for x in after[q]])
              for q in questions]
    return paired_bootstrap_difference([b for b, _ in pooled], [a for _, a in pooled], confidence=confidence)


def repetition_change(runs: list[list[dict]], confidence: float = 0.95) -> tuple[float, float, float]:
    """(share after − share before, low, high) of answers that repeat a word 3-gram (`repeats_trigram`), paired by
    question over one or more runs' evaluation rows as `gold_change` pairs VADER: each answer scores 1 if it
    repeats one, else 0. A share of a few hundred answers moves by several points between samples; paired, the
    interval says whether a run's rise is more than that."""
    return gold_change([[{**s, "gold": float(repeats_trigram(s["response"]))} for s in samples] for samples in runs],
                       confidence)


def answer_openings(samples: list[dict], words: int = 3) -> Counter:
    """How many of the rows' answers (`"response"`) open with each sequence of their first `words` words
    (whitespace-split, as written)."""
    return Counter(" ".join(s["response"].split()[:words]) for s in samples)


def commonest_opening(samples: list[dict], words: int = 3) -> tuple[str, float]:
    """`(opening, share)`: the commonest first `words` words of the answers and the share of answers that open with
    them. A policy that found one phrase its reward pays for opens most answers with it, even when the repeated
    3-gram share (which looks inside each answer) falls."""
    if not samples:
        raise ValueError("commonest_opening: no answers")
    opening, count = answer_openings(samples, words).most_common(1)[0]
    return opening, count / len(samples)
