"""The exercises' checkers, one module per part of the book; the chapters import them from
`marlhf_edu.teaching.exercises`.

- `part1_math`: The math, chapters 00–06
- `part2_loop`: The loop, chapters 07–10
- `part3_evaluation`: Evaluation, chapters 11–12
- `part4_scale`: Real model and scale, chapters 13–15
"""
