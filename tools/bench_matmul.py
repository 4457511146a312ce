"""fp32 products of SmolLM2's shapes on this CPU: torch's `F.linear` (MKL's sgemm) against oneDNN from weights
reordered once (`marlhf_edu.loading.onednn`, the engine's `onednn_matmuls`).

    python tools/bench_matmul.py --out benchmarks/matmul_onednn_<cpu>.json

Each case multiplies one input by the weights of all 30 decoder layers in turn (so every weight comes from memory,
as in a model's forward, not from cache): an MLP's up projection (576 → 1536) and down projection (1536 → 576) at
16 rows (one decode step of 16 samples) and 992 rows (a forward over 16 rows of 62 tokens), and the 49152 × 576
LM head at 16 and 384 rows (the answers' positions of 8 rows of 48). Reports the median of `--repeats` timings of
each, GFLOP/s, and the largest relative difference between the two paths' outputs. Chapter 09 reads the record;
not part of `make test`. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

from marlhf_edu.records import machine, measured_on, write_result

CASES = (("MLP up, 30 layers", 16, 576, 1536, 30), ("MLP up, 30 layers", 992, 576, 1536, 30),
         ("MLP down, 30 layers", 16, 1536, 576, 30), ("MLP down, 30 layers", 992, 1536, 576, 30),
         ("LM head", 16, 576, 49152, 1), ("LM head", 384, 576, 49152, 1))


def time_ms(fn, repeats: int) -> float:
    fn()  # the first call pays for allocation
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def bench_case(rows: int, d_in: int, d_out: int, layers: int, repeats: int) -> dict:
    import torch

    from marlhf_edu.loading.onednn import OneDNNWeight, frozen_linear

    torch.manual_seed(0)
    weights = [torch.randn(d_out, d_in) / d_in ** 0.5 for _ in range(layers)]
    reordered = [OneDNNWeight(w, backward=False) for w in weights]
    x = torch.randn(rows, d_in)
    with torch.no_grad():
        mkl = time_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights], repeats)
        onednn = time_ms(lambda: [frozen_linear(x, w) for w in reordered], repeats)
        ref, got = torch.nn.functional.linear(x, weights[0]), frozen_linear(x, reordered[0])
    flop = 2 * rows * d_in * d_out * layers
    return {"rows": rows, "in": d_in, "out": d_out, "layers": layers, "mkl_ms": round(mkl, 3),
            "onednn_ms": round(onednn, 3), "mkl_gflops": round(flop / mkl / 1e6, 1),
            "onednn_gflops": round(flop / onednn / 1e6, 1), "speedup": round(mkl / onednn, 2),
            "max_rel_diff": float(((got - ref).abs().max() / ref.abs().max()).item())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--label", default="", help="a name for this environment in the output")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON file to write (else print only)")
    args = parser.parse_args(argv)
    import os

    cases = []
    for name, rows, d_in, d_out, layers in CASES:
        cases.append({"case": name, **bench_case(rows, d_in, d_out, layers, args.repeats)})
        print(json.dumps(cases[-1]))
    env = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                      "OMP_NUM_THREADS") if k in os.environ}
    result = {"label": args.label, "environment": env or "default", "repeats": args.repeats, "cases": cases,
              "measured_on": measured_on(), "machine": machine()}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
