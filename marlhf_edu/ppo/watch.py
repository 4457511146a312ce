"""Watching a PPO run: the signs in its `metrics.jsonl` that it is going wrong, as rules you can read::

    from marlhf_edu.ppo.watch import check_run
    for finding in check_run(read_metrics("runs/llama2_7b/ma_ppo/metrics.jsonl")):
        print(finding)

Each rule compares the mean of the run's last `window` steps with its first `window` steps (single steps are
noisy at 16 rollouts) or looks at every step for an event. The thresholds are rules of thumb, stated in the
arguments; a finding is a reason to read samples, not proof. What the rules look for:

* `kl_runaway`: the KL to the reference (per response, k1) beyond `kl_limit` nats: the policy has moved far
  from the SFT model, the usual road to reward hacking. Unset, the limit is 6, or 1.5 times the adaptive
  controller's target where the records hold one (`kl/target`): a run held at its target (trl 0.11's is 6,
  the 7B config's too) is where it was asked to be;
* `length_collapse` / `length_runaway`: answers shrink to under `length_drop` of their starting length, or stop
  ending (most answers hit max_new_tokens without EOS): a short or endless answer the reward model likes;
* `entropy_collapse`: the per-token entropy falls under `entropy_drop` of its start: the policy is converging on
  a few answers, exploration has stopped;
* `reward_hacking`: the reward model's score rises while a judge it does not know of (`gold/mean`, logged when
  the run has one) falls;
* `held_out_falls`: the reward model's training score rises (by more than `score_rise` and than a quarter of a
  batch's spread of scores, so that step-to-step noise is not a rise) while its own score of held-out answers,
  read as it was trained (EOS appended; `eval_curve.jsonl`, or `eval.json`'s before and after), falls by more
  than `held_out_fall` and, when per-prompt scores are there, by more than two paired standard errors: what the
  policy learned to please is not what the reward model rewards on text it was trained for. Under a reward
  that is not the reward model (`reward: canonical_refusal`, `keyword_judge`) its logged score (`score/reward_model_mean`) is used;
* `eos_driven_score`: answers that end with EOS and answers cut off score apart by more than `eos_gap` times the
  spread of a batch's scores at the start (`score/std`): the policy can move its score by ending sooner or
  later. Under `truncated_scoring: last_token` the reading itself makes the gap (chapter 13); under
  `append_eos` it is what long answers say. From `score/mean_eos` and `score/mean_no_eos` when logged; else
  estimated from how the step's mean score follows its no-EOS rate (a least-squares slope over the steps, used
  when they correlate), an estimate confounded with everything else that changed during training;
* `skipped_minibatches`: the ratio threshold skipped an optimizer step (the policy moved too far in one step);
* `critic_not_learning`: the value head's explained variance stays below zero at the end.

Taught in chapter 15 (`held_out_falls` and `eos_driven_score` in chapter 13).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from marlhf_edu.ppo.run_files import read_jsonl


@dataclass(frozen=True)
class Finding:
    """One sign in a run: which rule, at which step, and what it saw."""

    rule: str
    step: int
    message: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.rule}: {self.message}"


def _mean(records: list[dict], key: str) -> float:
    return sum(r[key] for r in records) / len(records)


def read_held_out(run_dir) -> list[dict]:
    """The held-out reward-model scores of a run folder, as `[{"updates": n, "reward_model_score": mean,
    "scores": [per prompt, in prompt order]}, ...]`: `eval_curve.jsonl` (`eval_every`) when it starts before
    any update, else `eval.json`'s before (0 updates) and after (the last step of `metrics.jsonl`), with each
    held-out question's mean score from `eval_samples.jsonl` when it is there; [] when the run has neither."""
    run_dir = pathlib.Path(run_dir)
    curve = read_jsonl(run_dir / "eval_curve.jsonl") if (run_dir / "eval_curve.jsonl").exists() else []
    if curve and curve[0]["updates"] == 0:
        return [{"updates": c["updates"], "reward_model_score": c["reward_model_score"],
                 **({"scores": c["reward_model_scores"]} if "reward_model_scores" in c else {})} for c in curve]
    if not (run_dir / "eval.json").exists():
        return []
    evals = json.loads((run_dir / "eval.json").read_text())
    # key="step": a line without a whole-number step is refused naming the file and line, not a KeyError here
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl", key="step")]
    samples = read_jsonl(run_dir / "eval_samples.jsonl") if (run_dir / "eval_samples.jsonl").exists() else []
    out = []
    for when, updates in (("before", 0), ("after", steps[-1] if steps else 0)):
        if "reward_model_score" in evals.get(when, {}):
            point = {"updates": updates, "reward_model_score": evals[when]["reward_model_score"]}
            per_question: dict = {}
            for sample in samples:
                if sample["when"] == when:
                    per_question.setdefault((sample["kind"], sample["question"]), []).append(sample["reward_model_score"])
            if per_question:
                point["scores"] = [sum(v) / len(v) for v in per_question.values()]
            out.append(point)
    return out


def held_out_change(first: dict, last: dict) -> tuple[float, float | None]:
    """(change of the held-out mean score, its standard error or None). The error is paired, prompt by prompt,
    when both points carry per-prompt scores over the same prompts (`read_held_out`): what the policy changed,
    without the spread between prompts."""
    change = last["reward_model_score"] - first["reward_model_score"]
    a, b = first.get("scores"), last.get("scores")
    if not a or not b or len(a) != len(b) or len(a) < 3:
        return change, None
    diffs = [y - x for x, y in zip(a, b)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return change, (var / len(diffs)) ** 0.5


def check_folder(run_dir, **thresholds) -> list[Finding]:
    """`check_run` of a run folder: its `metrics.jsonl` and held-out scores (`read_held_out`)."""
    run_dir = pathlib.Path(run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl", key="step")  # the findings name each record's step
    return check_run(records, held_out=read_held_out(run_dir), **thresholds)


def eos_score_gap(records: list[dict], min_corr: float = 0.5) -> tuple[float, str] | None:
    """(mean score of answers with EOS − of answers without, how it was found), or None when it cannot be told.

    Logged split means (`score/mean_eos`, `score/mean_no_eos`) are averaged over the steps that have both.
    Otherwise: if every answer of a step scored `a` with EOS and `b` without, the step's mean would be
    a + (b − a)·q at no-EOS rate q, so the least-squares slope of `score/mean` on `response/no_eos_rate` over
    the steps estimates b − a; used only when the two correlate (absolute correlation at least `min_corr`) and q varied (range ≥ 0.2),
    since the content of the answers changes too."""
    both = [r for r in records if "score/mean_eos" in r and "score/mean_no_eos" in r]
    if both:
        return sum(r["score/mean_eos"] - r["score/mean_no_eos"] for r in both) / len(both), f"logged over {len(both)} steps"
    pts = [(r["response/no_eos_rate"], r["score/mean"]) for r in records
           if "response/no_eos_rate" in r and "score/mean" in r]
    if len(pts) < 3:
        return None
    qs, ss = zip(*pts)
    mq, ms = sum(qs) / len(qs), sum(ss) / len(ss)
    sqq = sum((q - mq) ** 2 for q in qs)
    sss = sum((x - ms) ** 2 for x in ss)
    if max(qs) - min(qs) < 0.2 or sqq == 0 or sss == 0:
        return None
    sqs = sum((q - mq) * (x - ms) for q, x in pts)
    if abs(sqs) / (sqq * sss) ** 0.5 < min_corr:
        return None
    return -sqs / sqq, f"estimated from the trend of {len(pts)} steps, confounded with whatever else changed"


def check_run(records: list[dict], *, held_out: list[dict] | None = None, window: int = 5,
              kl_limit: float | None = None,
              length_drop: float = 0.5, entropy_drop: float = 0.5, no_eos_limit: float = 0.5, score_rise: float = 0.1,
              gold_fall: float = 0.05, held_out_fall: float = 0.05, eos_gap: float = 1.0) -> list[Finding]:
    """The findings of the rules above on a run's step records (`read_metrics`), in rule order; [] = none.

    `held_out`: the run's held-out reward-model scores (`read_held_out`), for `held_out_falls`.
    A run shorter than 2 · `window` steps is compared first window against last window all the same (they
    overlap); a key the run did not log skips its rule.
    """
    if not records:
        raise ValueError("check_run: no step records")
    if window < 1:
        raise ValueError(f"check_run: window must be >= 1, got {window}")
    first, last = records[:window], records[-window:]
    end = records[-1]["step"]
    has = set(records[0])

    def start_now(key):  # mean of the first and of the last window; None when the run did not log `key`
        return (_mean(first, key), _mean(last, key)) if key in has else None

    if kl_limit is None:  # above the adaptive controller's own target, which a healthy run oscillates around
        target = records[-1].get("kl/target")
        kl_limit = 1.5 * target if isinstance(target, (int, float)) and target > 0 else 6.0
    found = []
    if (kl := start_now("kl/k1")) and kl[1] > kl_limit:
        found.append(Finding("kl_runaway", end, f"KL to the reference {kl[1]:.1f} nats per response over the last "
                                                f"{len(last)} steps, above {kl_limit:g}"))
    if (length := start_now("response/length")) and 0 < length[0] and length[1] < length_drop * length[0]:
        found.append(Finding("length_collapse", end, f"answers shrank from {length[0]:.1f} to {length[1]:.1f} tokens "
                                                     f"({length[1] / length[0]:.0%} of their start)"))
    if (no_eos := start_now("response/no_eos_rate")) and no_eos[1] > no_eos_limit and no_eos[1] > no_eos[0]:
        found.append(Finding("length_runaway", end, f"{no_eos[1]:.0%} of answers end without EOS (at the start: "
                                                    f"{no_eos[0]:.0%})"))
    if (entropy := start_now("policy/entropy")) and 0 < entropy[0] and entropy[1] < entropy_drop * entropy[0]:
        found.append(Finding("entropy_collapse", end, f"entropy fell from {entropy[0]:.2f} to {entropy[1]:.2f} nats "
                                                      f"per token ({entropy[1] / entropy[0]:.0%} of its start)"))
    score, gold = start_now("score/mean"), start_now("gold/mean")
    rm_score = start_now("score/reward_model_mean") or score  # what the reward model says, whatever PPO optimised
    rm_spread = start_now("score/reward_model_std") or start_now("score/std")
    if score and gold:
        d_score, d_gold = score[1] - score[0], gold[1] - gold[0]
        if d_score > score_rise and d_gold < -gold_fall:
            found.append(Finding("reward_hacking", end, f"the reward model's score rose by {d_score:.2f} while the "
                                                        f"gold judge fell by {-d_gold:.2f}"))
    if rm_score and held_out and len(held_out) >= 2:
        d_score = rm_score[1] - rm_score[0]
        h0, h1 = held_out[0]["reward_model_score"], held_out[-1]["reward_model_score"]
        change, se = held_out_change(held_out[0], held_out[-1])
        # the rise must stand out of the step-to-step noise: a quarter of a batch's spread of scores, at least;
        # the fall out of the sampling noise of the held-out answers: two paired standard errors, when known
        rise = max(score_rise, 0.25 * (rm_spread[0] + rm_spread[1]) / 2) if rm_spread else score_rise
        fall = max(held_out_fall, 2 * se) if se is not None else held_out_fall
        if d_score > rise and change < -fall:
            noise = f", paired standard error {se:.2f}" if se is not None else ""
            found.append(Finding("held_out_falls", end, f"the reward model's training score rose by {d_score:.2f} "
                                                        f"while its held-out score (EOS appended, as trained) fell "
                                                        f"from {h0:.2f} to {h1:.2f} (after {held_out[-1]['updates']} "
                                                        f"updates{noise})"))
    spread = start_now("score/std")
    if spread and (gap := eos_score_gap(records)):
        typical = spread[0]  # at the start: a policy that collapsed onto one answer has no spread left to compare
        if typical > 0 and abs(gap[0]) > eos_gap * typical:
            side = "that end with EOS above those cut off" if gap[0] > 0 else "cut off above those that end with EOS"
            found.append(Finding("eos_driven_score", end, f"answers {side} by {abs(gap[0]):.2f}, "
                                                          f"{abs(gap[0]) / typical:.1f} times the spread of a batch's "
                                                          f"scores at the start ({typical:.2f}; {gap[1]})"))
    for r in records:
        if r.get("ppo/skipped_minibatches", 0) > 0:
            found.append(Finding("skipped_minibatches", r["step"], f"{r['ppo/skipped_minibatches']:g} minibatch(es) "
                                                                    "skipped by the ratio threshold"))
    if (ev := start_now("value/explained_variance")) and ev[1] < 0:
        found.append(Finding("critic_not_learning", end, f"explained variance {ev[1]:.2f} over the last {len(last)} "
                                                         "steps: the value head predicts worse than a constant"))
    return found
