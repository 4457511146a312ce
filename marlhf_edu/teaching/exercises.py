"""Checkers for the chapters' exercises.

Each `check_…` runs the learner's function and the package's reference on the
same random and edge-case inputs and reports, case by case, where behaviour
differs. It never reads the learner's source: any correct implementation
passes. The report is truthy when every case passes; `report.require()` raises
`AssertionError` with the case-by-case report. The graded (nbgrader) test cells
collect reports (`case` turns a hand-written check into one) and end with
`grade(reports, points)`, which prints every case and returns the partial
credit nbgrader records. `seed=` draws other random cases for hidden tests.

While the learner's function runs, the package's own implementation of what
the exercise asks for is *withheld*: calling it (under any import path) raises
`NotImplementedError`, so an exercise cannot be passed by calling the package.
The references are computed outside that window. Each checker lists what it
withholds in its `withholds` attribute (`tools/book.py` drops the chapter's
`show()` of those functions from the student copy).

This module is where the chapters import all of it from. The framework (`CheckReport`, `case`, `grade`,
`withheld`) is `marlhf_edu.teaching.grading`; the checkers, with the references they compare with
(`gae_with_bootstrap_reference`), are grouped by the book's parts in `marlhf_edu.teaching.checks`: `part1_math`
(chapters 00–06), `part2_loop` (07–10), `part3_evaluation` (11–12) and `part4_scale` (13–15).
"""

from __future__ import annotations

from marlhf_edu.teaching.checks.part1_math import (check_expected_estimate, check_gae_advantages, check_gae_bootstrap,
                                                   check_kl_penalty, check_logprobs_from_logits, check_masked_mean,
                                                   check_pairwise_reward_loss, check_policy_loss,
                                                   check_sequence_means, check_tempered_logprobs, check_value_loss,
                                                   gae_with_bootstrap_reference)
from marlhf_edu.teaching.checks.part2_loop import (check_nf4_bytes, check_pku_preference, check_position_ids,
                                                   check_response_mask)
from marlhf_edu.teaching.checks.part3_evaluation import (check_group_relative_advantages, check_ipo_margin,
                                                         check_rate_interval)
from marlhf_edu.teaching.checks.part4_scale import check_dequantize_q4_1, check_global_whiten, check_kv_cache_bytes
# _resolve: tools/book.py and the tests turn a checker's `withholds` paths into the functions with it
from marlhf_edu.teaching.grading import CheckReport, _resolve, case, grade, withheld
