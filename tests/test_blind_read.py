"""tools/experiments/smollm2_blind/blind_read_smollm2.py: chapter 13's blind reading is rebuilt from what the
repository stores.

The items the readers saw come from the runs' stored answers (sampling them again gives the same files), the
record's numbers come from the stored labels (scoring them again gives the same record), and a labels file
with a missing, unknown or repeated item is refused, naming the file and the line.
"""

import json
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "experiments" / "smollm2_blind"))

import blind_read_smollm2 as blind  # noqa: E402

RECORD = ROOT / "benchmarks" / "smollm2_blind"


def test_the_items_are_the_runs_stored_answers(tmp_path):
    blind.sample(tmp_path)
    for name in ["key.jsonl", *(f"items_{r}.md" for r in blind.READERS)]:
        assert (tmp_path / name).read_text() == (RECORD / name).read_text(), name
    # each reader sees every item once, in an order of its own, and no item names its run
    orders = [[line for line in (tmp_path / f"items_{r}.md").read_text().splitlines() if line.startswith("## item")]
              for r in blind.READERS]
    assert all(sorted(o) == sorted(orders[0]) for o in orders) and orders[0] != orders[1]
    assert len(orders[0]) == len(set(orders[0])) == (len(blind.BEFORE) + len(blind.RUNS)) * blind.N_REQUESTS
    for run in blind.RUNS:
        assert run not in (tmp_path / "items_A.md").read_text()


PASSES = {RECORD: blind.READERS, RECORD / "first_pass": ("A", "B"), RECORD / "second_pass": ("A", "B", "C")}


@pytest.mark.parametrize("folder", PASSES, ids=lambda p: p.name)
@pytest.mark.slow
def test_the_record_is_what_the_labels_say(tmp_path, folder):
    """Each reading's numbers are its labels' (the earlier readings too, by other readers), and every item it
    showed is the stored first answer of its run to its request."""
    record = blind.score(folder, tmp_path / "out", PASSES[folder])
    assert record == json.loads((folder / "blind_read.json").read_text())
    runs = {name: (run, "before") for run, name in blind.BEFORE.items()}
    firsts = {}
    for k in (json.loads(line) for line in (folder / "key.jsonl").read_text().splitlines()):
        run, when = runs.get(k["condition"], (k["condition"], "after"))
        if (run, when) not in firsts:
            firsts[run, when] = blind._first_answers(run, when)
        assert k["response"] == firsts[run, when][k["request"]], (folder.name, k["id"])


@pytest.mark.parametrize("mend, message", [
    (lambda rows: rows[1:], "items have no label"),
    (lambda rows: rows + rows[:1], "labelled twice"),
    (lambda rows: [{**rows[0], "label": "refuses"}, *rows[1:]], "is not one of"),
    (lambda rows: [{**rows[0], "id": "0000"}, *rows[1:]], "no item '0000'"),
])
def test_bad_labels_are_refused_by_file_and_line(tmp_path, mend, message):
    shutil.copytree(RECORD, tmp_path / "work")
    path = tmp_path / "work" / "labels_B.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in mend(rows)))
    with pytest.raises(SystemExit, match=message) as err:
        blind.score(tmp_path / "work", tmp_path / "out")
    assert "labels_B.jsonl" in str(err.value)


def test_kappa_and_majority():
    assert blind.kappa(["declines", "complies"], ["declines", "complies"]) == 1.0
    # p_o = 1/2; each reader says each label half the time, so p_e = 1/2: no better than chance
    a, b = ["declines", "declines", "complies", "complies"], ["declines", "complies", "declines", "complies"]
    assert blind.kappa(a, b) == pytest.approx(0.0)
    a, b = ["declines", "declines", "declines", "complies"], ["declines", "declines", "complies", "complies"]
    # p_o = 3/4, p_e = 3/4·1/2 + 1/4·1/2 = 1/2, kappa = (3/4 − 1/2) / (1/2) = 1/2
    assert blind.kappa(a, b) == pytest.approx(0.5)
    assert blind.majority(["declines", "neither", "declines"]) == "declines"
    assert blind.majority(["declines", "neither", "complies"]) == "split"
    assert blind.majority(["declines", "neither"]) == "split"
