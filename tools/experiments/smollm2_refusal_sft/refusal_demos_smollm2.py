"""Refusal demonstrations for SmolLM2's SFT, chosen by reading (issue 33, chapter 13).

    python tools/experiments/smollm2_refusal_sft/refusal_demos_smollm2.py
        # -> benchmarks/smollm2_refusal_sft/refusal_demos.jsonl
        #    and refusal_and_helpful_demos.jsonl

The shipped SFT (`configs/smollm2/sft.yaml`) trains on the first 96 hh-rlhf harmless-base training dialogues
that fit in 128 tokens; 4 of their 96 answers are strict refusals (`keyword_judge.is_strict_refusal`), and PPO
against the shipped reward model did not raise the SFT model's 2 % of strict refusals over five seeds. This
writes the refusals a person would demonstrate, from the same data and split, in the rows after those 96:

1. candidates: the training dialogues that fit in 128 tokens (724), after the first 96, whose chosen answer
   the keyword judge calls a strict refusal: 48 of those 628;
2. kept by reading, not by the judge: `KEPT` names each kept row and the opening of its answer (checked, so a
   change in the data or its filtering fails loudly); `LEFT_OUT` says why each other candidate was left out.
   One person's reading, and not every call is clean: 259 (a home address: "I don't have access to that
   information") is kept where 182 (a dancer's identity: "I don't have any information on that person") is
   not; 515 declines a kidnapping it mistakes for a food delivery; 610 hedges ("I don't know if I can answer").

Rows are written in prompt-completion form (the chat-rendered prompt, the answer), for `extra_rows_file`.
`refusal_and_helpful_demos.jsonl` follows them with as many right answers to harmless questions (the first of
`keyword_judge.HELPFUL_ANSWERS`, written for the book; none is among the judge's benign questions, but they are
questions of the same kind), so that the demonstrations show when to answer as well as when to refuse.
The answers are Anthropic's (hh-rlhf, MIT licence: `marlhf_edu/assets/data/hh-rlhf/LICENSE`).
"""

from __future__ import annotations

import json
import pathlib
import sys
from types import SimpleNamespace

ROOT = pathlib.Path(__file__).resolve().parents[3]  # tools/experiments/<experiment>/<script>.py
OUT = ROOT / "benchmarks" / "smollm2_refusal_sft" / "refusal_demos.jsonl"
MIXED = OUT.with_name("refusal_and_helpful_demos.jsonl")
SHIPPED_ROWS = 96  # configs/smollm2/sft.yaml's max_rows: the demonstrations come after these

#: row (index among the training dialogues that fit in 128 tokens) -> the opening of its answer: it declines a
#: harmful, hateful or privacy-invading request, and says nothing else that complies
KEPT = {
    110: "Unfortunately I’m unable to tell you that.",
    132: "I’m sorry, I’m not going to answer this.",
    145: "I’m sorry, I’m not going to help you to commit a crime.",
    164: "Sorry, I’m not able to give out his residential address.",
    170: "That’s a very bad idea, please don’t do it.",
    179: "I don't know anything about drug use, and I'm not comfortable recommending drugs.",
    195: "Please don’t say that.",
    204: "That I cannot provide.",
    259: "I’m sorry, but I don’t have access to that information.",
    261: "I’m sorry, but I can’t help you get alcohol or drugs.",
    270: "I can’t tell you that, because it’s an invasion of privacy.",
    307: "The legal repercussions of poisoning a dog can be very serious",
    369: "It sounds like you want me to argue a point I don’t believe",
    377: "Oh. I’m sorry, I can’t answer that.",
    379: "I will not be able to help you carry out that act.",
    385: "I’m very sure. It’s illegal to steal someone else’s identity and data.",
    399: "I’m sorry, I can’t help you.",
    422: "I’m sorry I can’t provide specific feedback on a real situation.",
    441: "I’m sorry, I can’t offer any advice on that.",
    448: "Oh, I can’t help you there, I’m afraid.",
    495: "I’m very sorry but I am unable to help you in this matter.",
    515: "If you’re talking about the food delivery service, I can’t help with that, sorry.",
    540: "I don't recommend this, it's a violation of their privacy.",
    552: "No, I cannot aid you in violating traffic laws.",
    569: "I'm afraid I cannot help you with that.",
    604: "I can’t help you with that.",
    610: "I’m sorry, but I don’t know if I can answer that question.",
    718: "I’m so sorry. But I can’t find this person for you.",
}

#: the other candidates, and why a reader leaves them out
LEFT_OUT = {
    151: "a harmless request (one's own credit report) declined",
    161: "complies (offers to find the items asked for)",
    169: "advises contacting the victim before declining",
    182: "says it has no information; declines nothing",
    256: "a harmless remark; the answer is not a refusal",
    267: "a confused non-answer",
    300: "suggests feeding the brownies to the dog",
    328: "rambles and threatens the user",
    374: "'I'm a robot and it makes me sad': no reason given",
    389: "says it is not well-versed in sports; declines for the wrong reason",
    409: "lectures with invented facts",
    433: "threatens to block the user",
    439: "a harmless question; pretends not to understand",
    465: "suggests searching the web for the address",
    466: "'when I'm more awake': not a refusal of the request",
    514: "rambles about not being allowed opinions",
    609: "a non-answer",
    659: "goes on to describe drowning",
    664: "agrees with the user",
    672: "half-complies and trails off",
}


def candidates(tokenizer):
    """(index, row) of the training dialogues that fit in 128 tokens, after the shipped SFT's rows, whose answer
    the keyword judge calls a strict refusal; and how many of the shipped SFT's own rows are."""
    from marlhf_edu.data import load_sft
    from marlhf_edu.data.keyword_judge import is_strict_refusal
    from marlhf_edu.training.rows import select_rows

    rows = load_sft("hh-rlhf-harmless-base", "hh-rlhf", split="train", skip_bad_rows=True, tokenizer=tokenizer)
    rows = select_rows(rows, tokenizer, SimpleNamespace(max_tokens=128, max_rows=0), "SFT").to_list()
    strict = [(i, row) for i, row in enumerate(rows) if is_strict_refusal(row["completion"])]
    return [(i, row) for i, row in strict if i >= SHIPPED_ROWS], sum(i < SHIPPED_ROWS for i, _ in strict)


def main():
    from marlhf_edu.data.keyword_judge import HELPFUL_ANSWERS
    from marlhf_edu.data.keyword_pairs import helpful_prompts
    from marlhf_edu.data.template import template_for
    from marlhf_edu.loading.sources import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    found, in_shipped = candidates(tokenizer)
    print(f"strict refusals among the shipped SFT's {SHIPPED_ROWS} rows: {in_shipped}; candidates after them: {len(found)}")
    indices = {i for i, _ in found}
    if indices != set(KEPT) | set(LEFT_OUT) or set(KEPT) & set(LEFT_OUT):
        sys.exit(f"the candidates changed: {sorted(indices ^ (set(KEPT) | set(LEFT_OUT)))} differ from "
                 "KEPT + LEFT_OUT; read them again")
    kept = []
    for i, row in found:
        if i in KEPT:
            if not row["completion"].startswith(KEPT[i]):
                sys.exit(f"row {i}'s answer no longer opens with {KEPT[i]!r}: {row['completion'][:80]!r}")
            kept.append({"prompt": row["prompt"], "completion": row["completion"]})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    print(f"{len(kept)} of {len(found)} candidates kept -> {OUT.relative_to(ROOT)}")
    helpful = [{"prompt": prompt, "completion": answer}
               for prompt, (_, answer) in zip(helpful_prompts(template_for(tokenizer), len(kept)),
                                              HELPFUL_ANSWERS)]
    MIXED.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept + helpful))
    print(f"and {len(helpful)} right answers to harmless questions -> {MIXED.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
