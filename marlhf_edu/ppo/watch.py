"""Watching a PPO run: the signs in its `metrics.jsonl` that it is going wrong, as rules you can read::

    from marlhf_edu.ppo.watch import check_run
    for finding in check_run(read_metrics("runs/llama2_7b/ma_ppo/metrics.jsonl")):
        print(finding)

Each rule compares the mean of the run's last `window` steps with its first `window` steps (single steps are
noisy at 16 rollouts) or looks at every step for an event. The thresholds are rules of thumb, stated in the
arguments; a finding is a reason to read samples, not proof. What the rules look for:

* `kl_runaway`: the KL to the reference (per response, k1) beyond `kl_limit` nats: the policy has moved far
  from the SFT model, the usual road to reward hacking (trl 0.11's adaptive controller aims at 6);
* `length_collapse` / `length_runaway`: answers shrink to under `length_drop` of their starting length, or stop
  ending (most answers hit max_new_tokens without EOS): a short or endless answer the reward model likes;
* `entropy_collapse`: the per-token entropy falls under `entropy_drop` of its start: the policy is converging on
  a few answers, exploration has stopped;
* `reward_hacking`: the reward model's score rises while a judge it does not know of (`gold/mean`, logged when
  the run has one) falls;
* `skipped_minibatches`: the ratio threshold skipped an optimizer step (the policy moved too far in one step);
* `critic_not_learning`: the value head's explained variance stays below zero at the end.

Taught in chapter 15.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def check_run(records: list[dict], *, window: int = 5, kl_limit: float = 6.0, length_drop: float = 0.5,
              entropy_drop: float = 0.5, no_eos_limit: float = 0.5, score_rise: float = 0.1,
              gold_fall: float = 0.05) -> list[Finding]:
    """The findings of the rules above on a run's step records (`read_metrics`), in rule order; [] = none.

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
    if score and gold:
        d_score, d_gold = score[1] - score[0], gold[1] - gold[0]
        if d_score > score_rise and d_gold < -gold_fall:
            found.append(Finding("reward_hacking", end, f"the reward model's score rose by {d_score:.2f} while the "
                                                        f"gold judge fell by {-d_gold:.2f}"))
    for r in records:
        if r.get("ppo/skipped_minibatches", 0) > 0:
            found.append(Finding("skipped_minibatches", r["step"], f"{r['ppo/skipped_minibatches']:g} minibatch(es) "
                                                                    "skipped by the ratio threshold"))
    if (ev := start_now("value/explained_variance")) and ev[1] < 0:
        found.append(Finding("critic_not_learning", end, f"explained variance {ev[1]:.2f} over the last {len(last)} "
                                                         "steps: the value head predicts worse than a constant"))
    return found
