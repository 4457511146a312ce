"""What drawing one token costs a decode step: transformers' multinomial against `token_draw.inverse_cdf_draw`.

    python tools/bench_token_draw.py [--rows 16 --vocab 49152 --repeats 200]

Times, per decode step of `rows` × `vocab` logits (SmolLM2's batch and vocabulary by default), what each
`PPOConfig.token_draw` adds to the log-softmax the rollout's recorder computes anyway:

    multinomial   transformers' sampling: z / T, softmax, torch.multinomial (an exponential race, rows × vocab
                  random numbers)
    inverse_cdf   exp of the recorder's log-probs, inverse_cdf_draw (fp64 cumulative sum, one uniform a row),
                  the one-hot scores handed to greedy `generate`, and its argmax

Prints the median milliseconds of each (after a warm-up) as JSON. Chapter 09 reads the stored result in
`benchmarks/smollm2_step_token_draw_*.json` ("draw_microbenchmark"). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from marlhf_edu.ppo.token_draw import inverse_cdf_draw
from marlhf_edu.records import measured_on


def median_ms(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab) * 3
    logprobs = torch.log_softmax(logits / args.temperature, dim=-1)  # the recorder's, made in either mode

    def multinomial():
        return torch.multinomial(torch.softmax(logits / args.temperature, dim=-1), 1)

    def inverse_cdf():
        drawn = inverse_cdf_draw(logprobs.exp())
        return torch.full_like(logits, float("-inf")).scatter_(1, drawn[:, None], 0.0).argmax(dim=-1)

    result = {"rows": args.rows, "vocab": args.vocab, "repeats": args.repeats, "measured_on": measured_on(),
              "multinomial_ms": round(median_ms(multinomial, args.repeats), 3),
              "inverse_cdf_ms": round(median_ms(inverse_cdf, args.repeats), 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
