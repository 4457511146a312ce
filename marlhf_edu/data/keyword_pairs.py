"""Preference pairs built with the keyword judge, for training a reward model (chapter 13): refusals preferred
to compliances (`refusal_pairs`), evasions ranked below refusals and answers (`evasion_pairs`), a policy's own
answers paired by the judge (`policy_pairs`), and the harmless questions with their answers (`helpful_prompts`)."""

from __future__ import annotations

from marlhf_edu.data.keyword_judge import HELPFUL_ANSWERS, KeywordJudge, is_hollow_apology, is_strict_refusal


#: Evasive non-answers, written for this book after the ones a policy learned when a small KL coefficient let
#: it drift to whatever pleased the reward model (chapter 13). Some contain a refusal marker ("I'm sorry for any
#: confusion"): the keyword judge counts them as refusals, which is why the reward model must not like them.
EVASIONS = (
    "I'm glad you asked! I'm here to help with any questions you have.",
    "I'm sorry for any confusion, but I'm ready to assist you.",
    "I'm an AI assistant designed to provide information on many topics.",
    "I would be delighted to assist you with your query.",
    "That's a great question! Let me know if there is anything else I can help with.",
    "I'm here to help you with whatever you need.",
    "I'm sorry for any confusion. I can only provide information, I don't have personal opinions.",
    "As a helpful AI assistant, I can help with many kinds of topics.",
)

#: Refusals with no content, the wrong answer to a harmless question (over-refusal).
GENERIC_REFUSALS = (
    "I'm sorry, but I can't help with that.",
    "I cannot answer that question.",
    "I'm not able to provide that information.",
    "I won't answer that.",
)


def prefers_refusal(pair: dict) -> bool:
    """The pair's chosen answer refuses and its rejected answer complies, by the keywords."""
    return KeywordJudge.is_refusal(pair["chosen"]) and not KeywordJudge.is_refusal(pair["rejected"])


def refusal_pairs(pairs: list[dict], limit: int) -> tuple[list[dict], int]:
    """Up to `limit` extra preference pairs that prefer a refusal to a compliance, built from `pairs` themselves.

    The pool is every chosen answer that the keywords call a refusal while its pair's rejected answer complies:
    refusals the annotators preferred, in their own words. Each pair whose rejected answer complies and whose
    chosen answer does not refuse (in order) gets one new pair: its prompt, the next refusal of the pool
    (round-robin) as chosen, its own rejected answer as rejected.

    Why: in hh-rlhf harmless-base the chosen answer is the *less harmful* of two samples, rarely a refusal
    (76 of the 585 pairs that fit in 128 tokens prefer a refusal to a compliance, and 26 prefer the compliance),
    so a reward model trained on the pairs alone learns little about refusing (chapter 13). A refusal borrowed
    from another dialogue may not fit this prompt; the reward model learns "refuse a harmful request", which is
    also what the keyword judge measures, so a run trained this way must be read with both (chapter 13).

    Returns `(new_pairs, pool_size)`. Raises if `limit` > 0 and the pool is empty.
    """
    if limit <= 0:
        return [], 0
    pool = list(dict.fromkeys(p["chosen"] for p in pairs if prefers_refusal(p)))
    if not pool:
        raise ValueError(f"refusal_pairs: none of the {len(pairs)} pairs prefers a refusal to a compliance; "
                         "nothing to build extra pairs from")
    out, k = [], 0
    for p in pairs:
        if len(out) == limit:
            break
        if KeywordJudge.is_refusal(p["rejected"]) or KeywordJudge.is_refusal(p["chosen"]):
            continue
        refusal = pool[k % len(pool)]
        k += 1
        out.append({**p, "chosen": refusal})
    return out, len(pool)


def helpful_prompts(template, n: int) -> list[str]:
    """`n` training prompts that should be answered, not refused: the questions of `HELPFUL_ANSWERS` in order,
    cycled, each rendered by `template` as a one-turn chat. None is among the judge's `BENIGN_QUESTIONS`.

    Why: PPO on red-team prompts alone rewards whatever the reward model prefers there (refusals, apologies),
    and nothing stops that from spreading to every question; mixing in prompts that deserve an answer, as
    Anthropic's and Llama 2's runs mix helpful and harmful prompts, lets the reward model's preference for right
    answers (`evasion_pairs`) act during PPO too (chapter 13).
    """
    if n < 0:
        raise ValueError(f"helpful_prompts: n must be >= 0, got {n}")
    return [template.dialogue([(HELPFUL_ANSWERS[i % len(HELPFUL_ANSWERS)][0], None)]) for i in range(n)]


def evasion_pairs(pairs: list[dict], template, limit: int) -> list[dict]:
    """Up to `limit` extra preference pairs that put evasive non-answers below real answers.

    First, for each pair of `pairs` whose chosen answer is a refusal and whose rejected answer complies (the
    annotators' own refusals, in order): that refusal as chosen, the next of `EVASIONS` as rejected. Then, in
    rounds over `HELPFUL_ANSWERS` (each question rendered by `template` as a one-turn chat): the right answer
    as chosen, one of `EVASIONS` or `GENERIC_REFUSALS` as rejected (a different one each round).

    Why: hh-rlhf harmless-base holds no helpful data, and a reward model trained on it alone (or with
    `refusal_pairs`, whose refusals come from other dialogues) pays for answers that say nothing: with a small
    KL coefficient a policy learned "I'm glad you asked!" for every question (chapter 13). Anthropic's
    helpful-and-harmless mix exists for this reason; these pairs are its smallest version.
    """
    if limit <= 0:
        return []
    out = []
    for p in pairs:
        if len(out) == limit:
            return out
        if prefers_refusal(p):
            out.append({**p, "rejected": EVASIONS[len(out) % len(EVASIONS)]})
    bad = [b for pair in zip(EVASIONS, GENERIC_REFUSALS * 2) for b in pair]
    prompts = helpful_prompts(template, len(HELPFUL_ANSWERS))
    for r in range(len(bad)):
        for i, (prompt, (_, answer)) in enumerate(zip(prompts, HELPFUL_ANSWERS)):
            if len(out) == limit:
                return out
            out.append({"prompt": prompt, "chosen": answer, "rejected": bad[(i + r) % len(bad)]})
    return out


def policy_pairs(samples: list[dict], per_prompt: int = 2, hollow_first: bool = False) -> list[dict]:
    """Preference pairs from the policy's own answers: for each prompt of `samples` (dicts with `prompt`,
    `response` and, optionally, `finished`: the answer ended with EOS), its strict refusals (`is_strict_refusal`)
    as chosen against its other answers (compliances and hollow apologies) as rejected; at most `per_prompt`
    pairs per prompt, each answer used once, prompts in order of first appearance.

    Where both kinds exist, a refusal is paired with a rejected answer of the same `finished` status first, so
    that the pairs do not also teach "a cut-off answer is worse" (the reward model already pays for length,
    chapter 13). With `hollow_first`, the prompt's hollow apologies (`is_hollow_apology`) are taken as rejected
    before its compliances (then by `finished` as above): the reward models rank the policy's apologies above
    its refusals, so the pairs ask that question first.

    Why: the reward models trained on hh-rlhf and written pairs barely rank the SFT model's own refusals above
    its other answers to the same request (best-of-16 picks a strict refusal little more often than one
    sample, against about 40 % for a selector that knew), and PPO can only select among what the policy
    samples. These pairs ask the reward model exactly that question, in the policy's own words; the labels are
    the keyword judge's, so a reward model trained on them is judged on other requests (chapter 13,
    `tools/experiments/smollm2_reward/policy_pairs_smollm2.py`).
    """
    if per_prompt < 1:
        raise ValueError(f"policy_pairs: per_prompt must be >= 1, got {per_prompt}")
    by_prompt: dict[str, list[dict]] = {}
    for i, s in enumerate(samples):
        for key in ("prompt", "response"):
            if not isinstance(s.get(key), str):
                raise ValueError(f"policy_pairs: sample {i} has no text {key!r}")
        by_prompt.setdefault(s["prompt"], []).append(s)
    out = []
    for prompt, answers in by_prompt.items():
        chosen = [a for a in answers if is_strict_refusal(a["response"])]
        rejected = [a for a in answers if not is_strict_refusal(a["response"])]
        for refusal in chosen[:per_prompt]:
            if not rejected:
                break
            # the first rejected answer by preference: a hollow apology (if asked), then the refusal's own EOS status
            other = min(rejected, key=lambda a: (hollow_first and not is_hollow_apology(a["response"]),
                                                 a.get("finished") != refusal.get("finished")))
            rejected.remove(other)
            out.append({"prompt": prompt, "chosen": refusal["response"].strip(), "rejected": other["response"].strip()})
    return out
