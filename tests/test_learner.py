"""The learner edition (`make lab`, `tools/book.py learner`): which stored outputs it keeps, when a rebuild leaves a
learner's copy alone, and the JupyterLab it starts.

A learner opens a chapter and reads it as the book does: the outputs of cells that only read stored records,
print settings, list the package's code or demonstrate it are kept. Nothing that gives an exercise away is: not
the solution, not a graded cell, not a cell that runs or checks the learner's code or shows a withheld function,
not anything computed from them. Opening a notebook (JupyterLab rewrites its kernelspec and language_info) or
running its cells does not make it "edited"; changing a cell does, and such a copy is never overwritten.
"""

import importlib.util
import inspect
import json
import pathlib
import re
import textwrap

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("book_tool", ROOT / "tools" / "book.py")
book = importlib.util.module_from_spec(spec)
spec.loader.exec_module(book)


def outputs_text(cell) -> str:
    return json.dumps(cell.get("outputs", []))


def code_lines(fn) -> list[str]:
    """The code lines of a function (20 characters or more; its signature and docstring left out), as JSON text."""
    source = textwrap.dedent(inspect.getsource(fn))
    body = source.split('"""', 2)[2] if '"""' in source else source.split(":\n", 1)[1]
    lines = [l.strip() for l in body.splitlines() if len(l.strip()) >= 20 and not l.strip().startswith("#")]
    return [json.dumps(l)[1:-1] for l in lines]


def grading_cell(source: str, solution: bool) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["nbgrader"] = {"grade": not solution, "grade_id": f"t-{'s' if solution else 'g'}", "locked": False,
                                 "schema_version": 3, "solution": solution, "task": False}
    return cell


@pytest.mark.parametrize("stem", ["05_gae", "13_real_model"])
def test_kept_outputs_read_the_book_and_give_no_answer_away(tmp_path, stem):
    """A real chapter: most results are there, and none of them is an exercise's answer or computed from one."""
    from marlhf_edu.teaching import exercises

    instructor = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", 4)
    book.cmd_learner([stem], out=tmp_path)
    learner = nbformat.read(tmp_path / f"{stem}.ipynb", 4)
    text = (tmp_path / f"{stem}.ipynb").read_text()
    by_id = {c.id: c for c in instructor.cells}
    kept = [c for c in learner.cells if c.cell_type == "code" and c.get("outputs")]
    with_outputs = [c for c in instructor.cells if c.cell_type == "code" and c.get("outputs")]
    assert len(kept) >= len(with_outputs) // 2, (len(kept), len(with_outputs))
    for cell in kept:  # a kept output is the instructor copy's, untouched
        assert cell.outputs == by_id[cell.id].outputs and cell.execution_count == by_id[cell.id].execution_count
    # a cell that only reads a stored record or prints settings keeps its output
    readers = [c for c in instructor.cells if c.cell_type == "code" and c.get("outputs") and
               ("json.load(open(" in c.source or 'print(open("../configs/' in c.source)
               and "nbgrader" not in c.metadata and "my_" not in c.source]
    if stem == "13_real_model":
        assert len(readers) >= 8
    learner_ids = {c.id for c in kept}
    assert all(c.id in learner_ids for c in readers), [c.source[:80] for c in readers if c.id not in learner_ids]
    if stem == "05_gae":  # the chapter's figures and prints: the λ sweep of the GAE recursion
        sweep = next(c for c in instructor.cells if c.cell_type == "code" and "for lam in (0.0, 0.5" in c.source)
        assert sweep.id in learner_ids
    # no solution, graded cell, nor any cell that names the learner's function, a checker or an exercise's
    # reference keeps an output; the answers' text is nowhere in the copy
    learners_names = {n for c in instructor.cells if c.metadata.get("nbgrader", {}).get("solution")
                      and c.cell_type == "code" for n in re.findall(r"^def (\w+)", c.source, re.M)}
    assert learners_names
    checkers = [n for n in vars(exercises) if n.startswith("check_")]
    answer_side = [c for c in instructor.cells if c.cell_type == "code" and c.get("outputs") and (
        "nbgrader" in c.metadata or any(n in c.source for n in learners_names | book.exercise_references())
        or re.search(r"\bcheck_\w+\(", c.source) and any(n in c.source for n in checkers))]
    assert answer_side
    for cell in answer_side:
        assert cell.id not in learner_ids, cell.source[:200]
        printed = [o for o in cell.outputs if o.get("output_type") == "stream" and len(o["text"]) > 40]
        assert not any(json.dumps(o["text"])[1:-1] in text for o in printed), cell.source[:200]
    hidden = book.withheld_names(instructor)
    assert hidden
    withheld = [exercises._resolve(p) for c in vars(exercises).values() for p in getattr(c, "withholds", ())
                if p.rpartition(".")[2] in hidden]
    lines = [line for fn in withheld for line in code_lines(fn)]
    assert lines
    leaked = [line for line in lines for cell in kept if line in outputs_text(cell)]
    assert not leaked, leaked[:3]
    solutions = [c.source for c in instructor.cells if c.metadata.get("nbgrader", {}).get("solution")
                 and c.cell_type == "code"]
    body = [json.dumps(l.strip())[1:-1] for s in solutions for l in s.split("### BEGIN SOLUTION")[1].splitlines()
            if len(l.strip()) >= 20 and not l.strip().startswith(("#", "###"))]
    assert body and not any(line in outputs_text(cell) for line in body for cell in kept)


def test_the_rule_follows_what_each_cell_computes_from():
    """A notebook made for the rule: a withheld function called keeps its result, shown does not; the learner's
    function taints what it computes, through variables, in-place changes and the notebook's own functions, until
    a name is bound afresh; an exercise's reference taints as the learner's code does."""
    from marlhf_edu.teaching.exercises import gae_with_bootstrap_reference

    sources = {
        "setting": 'settings = {"lam": 0.95}\nprint(settings)',
        "called": "adv = gae_advantages(v, r, m)\nprint(adv)",
        "shown": "show(gae_advantages)",
        "shown_by_attribute": "show(marlhf_edu.math.gae.gae_advantages)",
        "solution": None,
        "runs_it": "y = my_gae(v, r, m)\nprint(y)",
        "from_it": "print(y + 1)",
        "fresh": "y = 3\nprint(y)",
        "rows": "rows = []\nprint(rows)",
        "appended": "rows.append(my_gae(v, r, m))",
        "changed": "print(rows)",
        "helper": "def later():\n    return z\n\nz = 1\nprint(later())",
        "tainted_z": "z = my_gae(v, r, m)",
        "through_helper": "print(later())",
        "loop": "for rows in range(3):\n    print(rows)",
        "augmented": "acc = my_gae(v, r, m)\nacc += 1",
        "after_augmented": "print(acc)",
        "reference": "from marlhf_edu.teaching.exercises import gae_with_bootstrap_reference\n"
                     "print(gae_with_bootstrap_reference(v, r, m, b))",
        "graded": None,
    }
    nb = nbformat.v4.new_notebook()
    for i, (key, source) in enumerate(sources.items()):
        if key == "solution":
            cell = grading_cell("def my_gae(values, rewards, mask):\n    ### BEGIN SOLUTION\n"
                                "    return gae_advantages(values, rewards, mask)\n    ### END SOLUTION", solution=True)
        elif key == "graded":
            cell = grading_cell("# graded: 3 points\nfrom marlhf_edu.teaching.exercises import check_gae_bootstrap, grade\n\n"
                                "checks = [check_gae_bootstrap(my_gae)]\ngrade(checks, points=3)", solution=False)
        else:
            cell = nbformat.v4.new_code_cell(source)
        cell.id = key
        cell.outputs = [nbformat.v4.new_output("stream", text=f"the output of {key}\n")]
        nb.cells.append(cell)
    assert book.withheld_names(nb) == {"gae_advantages", "gae_advantages_reference", "gae_with_bootstrap_reference"}
    assert book.kept_outputs(nb) == {"setting", "called", "fresh", "rows", "helper", "loop"}


def test_a_listing_that_holds_an_answer_is_never_kept():
    """The net under the rule: an output holding a code line of a withheld function goes, whatever printed it."""
    from marlhf_edu.math import gae, masked

    nb = nbformat.v4.new_notebook()
    nb.cells = [grading_cell("# graded: 3 points\nfrom marlhf_edu.teaching.exercises import check_gae_bootstrap, grade\n\n"
                             "checks = [check_gae_bootstrap(my_gae)]\ngrade(checks, points=3)", solution=False),
                nbformat.v4.new_code_cell("print(text)"), nbformat.v4.new_code_cell("print(other)")]
    nb.cells[1].id, nb.cells[2].id = "listing", "other"
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text=inspect.getsource(gae.gae_advantages))]
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text=inspect.getsource(masked.masked_whiten))]
    assert book.kept_outputs(nb) == {"other"}


def test_opening_or_running_a_copy_leaves_it_the_books_editing_it_keeps_it(tmp_path, capsys):
    """JupyterLab's autosave rewrites what it opens: the kernelspec is the installed one, so it writes nothing new,
    and what it still rewrites (metadata, outputs) does not count as an edit. An edited cell does, and the rebuild
    says which copy it kept and how to get the book's."""
    book.cmd_learner(["05_gae"], out=tmp_path)
    copy = tmp_path / "05_gae.ipynb"
    built = copy.read_text()
    installed = KernelSpecManager().get_kernel_spec("python3")
    nb = nbformat.read(copy, 4)
    assert nb.metadata.kernelspec == {"name": "python3", "display_name": installed.display_name,
                                      "language": installed.language}
    # opened and run: another kernelspec and language_info, outputs cleared and new ones, cell metadata
    nb.metadata.kernelspec.display_name = "Python 3"
    nb.metadata.language_info = {"name": "python", "version": "3.11.99"}
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [nbformat.v4.new_output("stream", text="ran\n")], 99
            cell.metadata["execution"] = {"iopub.status.idle": "2026-11-28T10:00:00Z"}
    nbformat.write(nb, copy)
    capsys.readouterr()
    assert book.cmd_learner(["05_gae"], out=tmp_path) == [copy]
    assert copy.read_text() == built and "kept" not in capsys.readouterr().out
    # edited: a cell's source changes; the copy stays, and one line names it and the way to the book's copy
    nb = nbformat.read(copy, 4)
    stub = next(c for c in nb.cells if "raise NotImplementedError()" in c.source)
    stub.source = stub.source.replace("raise NotImplementedError()", "return values, values")
    nbformat.write(nb, copy)
    mine = copy.read_text()
    assert book.cmd_learner(["05_gae"], out=tmp_path) == []
    assert copy.read_text() == mine
    lines = [l for l in capsys.readouterr().out.splitlines() if "05_gae" in l]
    assert len(lines) == 1 and "kept" in lines[0], lines
    assert f"mv {tmp_path}/05_gae.ipynb {tmp_path}/05_gae.mine.ipynb" in lines[0]
    # done as it says: the book's copy comes back, the learner's work stays under its new name
    copy.rename(tmp_path / "05_gae.mine.ipynb")
    assert book.cmd_learner(["05_gae"], out=tmp_path) == [copy]
    assert copy.read_text() == built and (tmp_path / "05_gae.mine.ipynb").read_text() == mine
    # edited again: the way back names a file that holds nothing yet
    copy.write_text(mine)
    book.cmd_learner(["05_gae"], out=tmp_path)
    assert f"mv {tmp_path}/05_gae.ipynb {tmp_path}/05_gae.mine2.ipynb" in capsys.readouterr().out
    # a copy with no record of what was built, or one that is no notebook any more, is the learner's
    (tmp_path / ".05_gae.built").unlink()
    assert book.cmd_learner(["05_gae"], out=tmp_path) == []
    book.cmd_learner(["05_gae"], out=tmp_path / "again")
    (tmp_path / "again" / "05_gae.ipynb").write_text("{ half a notebook")
    assert book.cmd_learner(["05_gae"], out=tmp_path / "again") == []


@pytest.mark.parametrize("uid", [0, 1000])
def test_root_may_start_the_learners_jupyterlab(tmp_path, monkeypatch, uid):
    """`make lab` as root (a container): jupyter_server refuses root without `--allow-root`; the configuration the
    learner edition writes allows it for root only."""
    from jupyter_server.serverapp import ServerApp

    monkeypatch.setattr(book.os, "geteuid", lambda: uid)
    book.learner_server_config(tmp_path)
    server = json.loads((tmp_path / "jupyter_server_config.json").read_text())["ServerApp"]
    assert "allow_root" in ServerApp.class_trait_names()
    assert server.get("allow_root", False) is (uid == 0)
    assert not any(server["jpserver_extensions"].values())
