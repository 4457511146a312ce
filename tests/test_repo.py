"""The book's machinery: chapter pairs, stored executions, pins, a light import."""

import importlib.util
import inspect
import json
import pathlib
import re
import subprocess
import sys

import pytest

import marlhf_edu
from tests.conftest import without_code_cells

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("book_tool", ROOT / "tools" / "book.py")
book_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(book_tool)


def test_chapter_pairs_in_sync_and_executed():
    assert book_tool.out_of_sync() == []


def test_out_of_sync_detection_works(tmp_path, monkeypatch):
    chapters, notebooks = tmp_path / "chapters", tmp_path / "notebooks"
    chapters.mkdir(); notebooks.mkdir()
    src = (ROOT / "chapters" / "00_preface.md").read_text()
    (chapters / "00_preface.md").write_text(src.replace("print(", "print('edited', ", 1))
    nb = json.loads((ROOT / "notebooks" / "00_preface.ipynb").read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["execution_count"] = None
            break
    (notebooks / "00_preface.ipynb").write_text(json.dumps(nb))
    (chapters / "99_orphan.md").write_text(src)
    monkeypatch.setattr(book_tool, "CHAPTERS", chapters)
    monkeypatch.setattr(book_tool, "NOTEBOOKS", notebooks)
    problems = "\n".join(book_tool.out_of_sync())
    assert "99_orphan.md has no notebooks" in problems
    assert "00_preface: chapter and notebook differ" in problems
    assert "has no stored execution" in problems


@pytest.mark.parametrize("nb_path", sorted((ROOT / "notebooks").rglob("*.ipynb")), ids=lambda p: p.stem)
def test_notebooks_have_no_stderr_or_errors(nb_path):
    nb = json.loads(nb_path.read_text())
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            assert out.get("name") != "stderr", f"{nb_path.name} cell {i} stored stderr output"
            assert out["output_type"] != "error", f"{nb_path.name} cell {i} stored an error"
            # progress-bar widgets carry random ids: a stored one would never regress
            assert "application/vnd.jupyter.widget-view+json" not in out.get("data", {}), f"{nb_path.name} cell {i}"
    assert "widgets" not in nb["metadata"], nb_path.name


@pytest.mark.parametrize("md_path", sorted((ROOT / "chapters").glob("*.md")), ids=lambda p: p.stem)
def test_chapter_structure(md_path):
    text = md_path.read_text()
    assert "format_name: myst" in text
    assert "**Learning goals.**" in text and "## Summary" in text
    assert "show(" in text, "chapters display the package's own source"
    assert re.search(r"check_\w+\(", text), "every chapter has an exercise with a checker"
    assert "### BEGIN SOLUTION" in text and "### END SOLUTION" in text
    assert re.search(r"^# graded: \d+ points?$", text, re.M), "every exercise has a graded test cell"
    assert "### BEGIN HIDDEN TESTS" in text, "graded cells carry hidden tests"
    assert 2 <= len(re.findall(r"^\*\*Model answer \(\d+ points?\)\.\*\*", text, re.M)) <= 4, "2-4 conceptual questions"
    # whole heading lines: "### Questions that ..." inside a section is not the questions section
    assert heading_at(text, "## Questions") > heading_at(text, "## Summary")
    heading_at(text, "## Suggested experiment")
    assert "plt." in text, "every chapter has at least one figure"
    for cell in re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", text, flags=re.S):
        # Jupyter displays only a cell's last expression: an earlier bare show() shows nothing
        statements = [line for line in cell.splitlines() if line and not line.startswith((" ", "#"))]
        for line in statements[:-1]:
            assert not line.startswith("show("), f"{md_path.name}: `{line}` is not its cell's last statement"


def heading_at(text: str, heading: str) -> int:
    """Offset of the line that is exactly `heading` (once), failing with the heading's name."""
    found = [m.start() for m in re.finditer(rf"^{re.escape(heading)}[ \t]*$", text, re.M)]
    assert len(found) == 1, f"expected one {heading!r} line, found {len(found)}"
    return found[0]


def read_pins(lines):
    return {line.split("==")[0].lower(): line.split("==")[1] for line in lines if "==" in line}


def test_environment_yml_matches_lock():
    lock = read_pins(l.strip() for l in (ROOT / "requirements.lock").read_text().splitlines() if not l.startswith("#"))
    env_lines = [l.strip()[2:] for l in (ROOT / "environment.yml").read_text().splitlines() if l.strip().startswith("- ")]
    env = read_pins(env_lines)
    assert lock == env
    assert lock["torch"] == "2.13.0" and "bitsandbytes" in lock and "nbval" in lock


def test_pyproject_declares_the_stack():
    text = (ROOT / "pyproject.toml").read_text()
    for dep in ("torch", "transformers", "peft", "trl", "bitsandbytes>=0.48", "datasets", "accelerate",
                "matplotlib", "jupyterlab", "nbval", "jupytext"):
        assert f'"{dep}' in text, dep


def test_import_is_light():
    code = "import sys, marlhf_edu; print(sorted(m for m in ('trl', 'peft', 'transformers', 'datasets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    # and every module of the package: the heavy libraries are imported inside the functions that use them
    code = ("import importlib, pkgutil, sys, marlhf_edu\n"
            "for m in pkgutil.walk_packages(marlhf_edu.__path__, 'marlhf_edu.'):\n"
            "    plotting = 'matplotlib' in sys.modules\n"
            "    importlib.import_module(m.name)\n"
            "    if not plotting and 'matplotlib' in sys.modules and m.name != 'marlhf_edu.teaching.diagrams':\n"
            "        print('matplotlib', m.name)\n"
            "print(sorted(m for m in ('trl', 'peft', 'transformers', 'datasets', 'accelerate', 'bitsandbytes')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert re.fullmatch(r"\d+\.\d+\.\d+", marlhf_edu.__version__)


def test_public_api_documented_with_chapter():
    chapters = {p.stem[:2] for p in (ROOT / "chapters").glob("*.md")}
    for name in marlhf_edu.__all__:
        if name == "__version__":
            continue
        obj = getattr(marlhf_edu, name)
        doc = inspect.getdoc(obj) or ""
        match = re.search(r"[Cc]hapter (\d\d)", doc)
        assert match, f"{name} has no 'chapter NN' pointer in its docstring"
        assert match.group(1) in chapters, f"{name} points to chapter {match.group(1)}, which does not exist"
        if inspect.isfunction(obj):
            hints = inspect.signature(obj)
            assert hints.return_annotation is not inspect.Signature.empty, f"{name} lacks a return type hint"


def test_ci_runs_the_readme_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text() and "make book" in (ROOT / "README.md").read_text()


def test_make_test_runs_the_slow_tests_and_test_fast_leaves_them_out(pytestconfig):
    """Issue 60: `make test` (what CI runs) deselects nothing; `make test-fast` is the tests without those marked
    slow and without the notebooks; the marker is registered (and --strict-markers refuses a misspelt one)."""
    makefile = (ROOT / "Makefile").read_text()
    recipes = dict(re.findall(r"^([\w-]+):[^=\n]*\n\t(.*)", makefile, re.M))
    test, fast = recipes["test"].split(), recipes["test-fast"]
    test = test[test.index("pytest") + 1:]  # pytest's arguments (`python -m pytest` has a -m of its own)
    assert {"tests", "notebooks"} <= set(test) and "-m" not in test and "-k" not in test and "slow" not in test
    assert '-m "not slow"' in fast and "tests" in fast.split() and "notebooks" not in fast
    assert "test-fast" in re.search(r"^\.PHONY:(.*)", makefile, re.M).group(1).split()
    assert any(m.startswith("slow:") for m in pytestconfig.getini("markers"))
    assert "--strict-markers" in pytestconfig.getini("addopts")


@pytest.mark.parametrize("nb_path", sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_every_figure_has_a_caption_and_a_name(nb_path):
    """Issue 36: a figure the site shows gets a number and a caption (myst-nb reads them from the cell's
    `mystnb.figure` metadata); 22 of 37 had neither."""
    nb = json.loads(nb_path.read_text())
    missing = []
    for i, cell in enumerate(nb["cells"]):
        images = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        figure = cell.get("metadata", {}).get("mystnb", {}).get("figure", {})
        if images and not (figure.get("caption", "").strip() and figure.get("name", "").startswith("fig-")):
            missing.append(f"cell {i}: {''.join(cell['source'])[:60]!r}")
        if len(images) > 1 and figure:
            missing.append(f"cell {i}: {len(images)} images under one caption: split the cell")
    assert not missing, missing


# A narrow window (a phone, half a screen) wraps plain-text outputs at about 76 characters, which breaks a
# text table's columns apart. Tables print with marlhf_edu.teaching.book.Table (a Markdown table on the site) or fit in 76.
# What the rule still finds: the `marlhf-edu memory` and `preflight` commands' own reports (ch10, ch12, ch14),
# a tensor printed over two lines (ch09), aligned prose and answer listings (ch10, ch11, ch12, ch15). The
# numbers may only go down.
WIDE_TEXT_TABLES = {"09_four_model_loop": 1, "10_multi_adapter": 2, "11_overoptimisation_and_evaluation": 1,
                    "12_dpo_and_grpo": 2, "15_launching_7b": 1}


def wide_text_table_cells(nb: dict, width: int = 76) -> list[int]:
    """Code cells whose plain-text output has a line wider than `width` laid out in columns (two or more gaps of
    two spaces or more between words; a printed tensor's are not columns). Outputs with a Markdown form (show(),
    Table) render as Markdown instead."""
    cells = []
    for i, cell in enumerate(nb["cells"]):
        text = "".join("".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
                       for out in cell.get("outputs", []) if "text/markdown" not in out.get("data", {}))
        if any(len(line) > width and "tensor(" not in line and len(re.findall(r"(?<=\S) {2,}(?=\S)", line)) >= 2
               for line in text.splitlines()):
            cells.append(i)
    return cells


@pytest.mark.parametrize("nb_path", sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_text_tables_fit_the_site_column(nb_path):
    nb = json.loads(nb_path.read_text())
    wide = wide_text_table_cells(nb)
    allowed = WIDE_TEXT_TABLES.get(nb_path.stem, 0)
    assert len(wide) <= allowed, f"{nb_path.name}: cells {wide} print tables wider than 76 characters; use Table"
    assert len(wide) == allowed, f"{nb_path.name}: {len(wide)} such cells now: lower WIDE_TEXT_TABLES to match"


@pytest.mark.parametrize("nb_path", sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_printed_text_stays_where_it_was_printed(nb_path):
    """The site merges a cell's printed text into one block where the first of it stands (nb_merge_streams), so a
    line printed after a table or a figure that follows other printed lines would move above it there, and stay
    below it in Jupyter. Print everything before the table or figure, or split the cell."""
    moved = []
    for i, cell in enumerate(json.loads(nb_path.read_text())["cells"]):
        kinds = [out.get("name") if out["output_type"] == "stream" else "display" for out in cell.get("outputs", [])]
        for name in {"stdout", "stderr"} & set(kinds):
            first, last = kinds.index(name), len(kinds) - 1 - kinds[::-1].index(name)
            if "display" in kinds[first:last]:
                moved.append(i)
    assert not moved, f"{nb_path.name}: cells {moved} print on both sides of a table or figure"


def test_streams_are_stored_joined():
    """How a cell's prints are cut into stream outputs depends on when the kernel flushed them (the machine's
    speed); `book.py notebooks` joins each run of one stream, so a re-executed chapter's stored outputs change
    only where its text did. A display output between two prints keeps them apart."""
    import nbformat

    def merged(outputs):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("", outputs=outputs)])
        book_tool.merged_streams(nb)
        return [dict(o) for o in nb.cells[0].outputs]

    s = lambda text, name="stdout": nbformat.v4.new_output("stream", name=name, text=text)  # noqa: E731
    shown = nbformat.v4.new_output("display_data", data={"text/plain": "table"})
    assert merged([s("a\n"), s("b\n"), s("c\n", "stderr"), s("d\n", "stderr")]) == [
        s("a\nb\n"), s("c\nd\n", "stderr")]
    assert merged([s("a\n"), shown, s("b\n")]) == [s("a\n"), shown, s("b\n")]
    split = []
    for nb_path in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb_path.read_text())["cells"]):
            outs = cell.get("outputs", [])
            if any(a["output_type"] == b["output_type"] == "stream" and a["name"] == b["name"]
                   for a, b in zip(outs, outs[1:])):
                split.append(f"{nb_path.relative_to(ROOT)} cell {i}")
    assert not split, f"stream outputs stored in pieces (re-run make notebooks): {split}"


def test_the_wide_table_rule_sees_a_table_and_not_prose():
    """A row of chapter 13's seed table printed as text, as it was before Table, fails the rule; prose does not."""
    row = ["0", "40 → 22", "65% → 9%", "-0.49 [-0.69, -0.30]", "+0.22 [-0.11, +0.53]", "length_runaway"]
    assert wide_text_table_cells({"cells": [{"outputs": [{"text": "   ".join(row)}]}]}) == [0]
    assert wide_text_table_cells({"cells": [{"outputs": [{"text": " ".join(row) * 2}]}]}) == []


def test_package_layers():
    """Issue 60: every import of the package's own modules sits at the top of its module and points down the layers
    (`tools/import_layers.py`: math, loading, data, ppo, memory, training, then stages and teaching), with no
    circle and no command importing another; and the check fails when an import inside a function comes back."""
    import shutil

    tool = ROOT / "tools" / "import_layers.py"
    done = subprocess.run([sys.executable, str(tool), str(ROOT), "--layers", "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "marlhf_edu" not in (ROOT / "marlhf_edu" / "errors.py").read_text().split('"""', 2)[2]

    def broken(tmp, module, code):
        root = tmp / module.replace("/", "_")
        shutil.copytree(ROOT / "marlhf_edu", root / "marlhf_edu", ignore=shutil.ignore_patterns("assets", "__pycache__"))
        with open(root / "marlhf_edu" / module, "a") as f:
            f.write(code)
        return subprocess.run([sys.executable, str(tool), str(root), "--layers", "--check"], capture_output=True,
                              text=True)

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        inside = broken(tmp, "math/masked.py", "\n\ndef _late():\n    from marlhf_edu.errors import ConfigError\n")
        assert inside.returncode == 1 and "1 in-function own imports" in inside.stdout
        upward = broken(tmp, "loading/assets.py", "\nfrom marlhf_edu.ppo.config import PPOConfig  # noqa\n")
        assert upward.returncode == 1 and "loading.assets -> ppo.config: points up or sideways" in upward.stdout
        sibling = broken(tmp, "stages/sft.py", "\nfrom marlhf_edu.stages.reward import main as _rm  # noqa\n")
        assert sibling.returncode == 1 and "one command imports another" in sibling.stdout


def test_torch_floor_is_one_whose_weights_only_load_is_safe():
    """Issue 37: resume trusts `torch.load(weights_only=True)` to refuse a crafted pickle, and torch <= 2.5.1 could
    be made to run code through it (CVE-2025-32434). pyproject must not allow those versions."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [d for d in deps if re.match(r"torch\b", d)]
    floor = re.search(r">=\s*(\d+)\.(\d+)", torch_req)
    assert floor and (int(floor[1]), int(floor[2])) >= (2, 6), torch_req


# The book states facts about runs and machines, never the project's history. A phrase here is one that tells
# that history; the exceptions are the uses that are not about the project (a reader panel of language-model
# sessions, a CPU that issues kernels).
HISTORY = re.compile(r"\b(sessions?|issues?|used to|since fixed|engine of the time|as it was then)\b", re.I)
NOT_HISTORY = ("language-model sessions", "sessions of one language model", "the CPU issues")


def history_phrases(text: str) -> list[str]:
    """The lines of a chapter's prose (code cells left out) with a phrase that tells the project's history."""
    prose = without_code_cells(text)
    found = []
    for line in prose.splitlines():
        kept = line
        for allowed in NOT_HISTORY:
            kept = re.sub(re.escape(allowed), "", kept, flags=re.I)
        if HISTORY.search(kept):
            found.append(line.strip())
    return found


@pytest.mark.parametrize("md_path", sorted((ROOT / "chapters").rglob("*.md")), ids=lambda p: p.stem)
def test_prose_tells_no_project_history(md_path):
    found = history_phrases(md_path.read_text())
    assert not found, f"{md_path.name}: state what was measured, on what machine: {found}"


def test_history_rule_sees_history_and_not_its_exceptions():
    assert history_phrases("One H100 ran it in three of this book's sessions.\n")
    assert history_phrases("The issue that asked for this benchmark set a target.\n")
    assert history_phrases("Both used to load the model on the CPU.\n")
    assert not history_phrases("The readers were language-model sessions, not people.\n")
    assert not history_phrases("each a kernel that the CPU issues from Python\n")
    assert not history_phrases("```{code-cell} ipython3\nsession = 1\n```\n")


# The package's docstrings and messages reach the reader too (chapters `show` functions, stages print errors):
# they name no tracker numbers either.
TRACKER = re.compile(r"\bissues? \d+\b", re.I)


def test_package_text_names_no_tracker_issue():
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "marlhf_edu").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if TRACKER.search(line)]
    assert not found, f"say what the code does and why, not which issue asked for it: {found}"


@pytest.mark.parametrize("nb_path", sorted((ROOT / "notebooks").rglob("*.ipynb")), ids=lambda p: p.stem)
def test_stored_outputs_name_no_tracker_issue(nb_path):
    outputs = [o for cell in json.loads(nb_path.read_text())["cells"] for o in cell.get("outputs", [])]
    texts = ["".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", "")) for o in outputs]
    found = [line.strip() for text in texts for line in text.splitlines() if TRACKER.search(line)]
    assert not found, f"{nb_path.name}: {found}"
