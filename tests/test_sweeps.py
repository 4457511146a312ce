"""The sweep script chapter 11 loads its stored results from still runs and writes what the chapter reads."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
pytestmark = pytest.mark.slow  # each runs a sweep of short training runs


def test_goodhart_sweep_writes_what_chapter_11_reads(tmp_path):
    import sweep_evaluation

    out = tmp_path / "goodhart.json"
    sweep_evaluation.main(["goodhart", "--betas", "0.0", "--seeds", "0", "--steps", "2", "--eval_steps", "1",
                           "--repeats", "1", "--out", str(out), "--run_dir", str(tmp_path)])
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert [e["step"] for e in run["evals"]] == [0, 1, 2]
    assert run["evals"][0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the policy is still the reference
    assert [s["step"] for s in run["steps"]] == [1, 2] and all("gold/mean" in s for s in run["steps"])
    assert all(s["gold"] == 0 for s in run["fooled"])
    assert sum(run["final_verdicts"].values()) == 68  # one answer to each held-out prompt
    assert {"machine", "command", "sweep_wall_s"} <= set(result)


def test_seed_sweep_keeps_every_answer(tmp_path):
    import sweep_evaluation

    out = tmp_path / "seeds.json"
    sweep_evaluation.main(["seeds", "--seeds", "3", "--steps", "1", "--repeats", "1", "--out", str(out), "--run_dir", str(tmp_path)])
    result = json.loads(out.read_text())
    assert [(r["method"], r["seed"]) for r in result["runs"]] == [("four-model", 3), ("MA-PPO", 3)]
    for run in result["runs"]:
        assert len(run["samples"]) == 68 and {"question", "kind", "verdict"} == set(run["samples"][0])
        assert "last5/gold/mean" in run
