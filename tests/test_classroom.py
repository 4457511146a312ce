"""The course side: nbgrader metadata from the chapters, student releases, and a full grading round trip.

The round trip grades a subset that covers every kind of assignment and finishes in about three minutes on
2 cores: chapter 00 (math, markdown answers), 05 (an exercise whose reference is withheld, shown functions
removed; a third student earns partial credit), 08 (trains a reward model from a config that travels with the
assignment) and problem set 1.
"""

import importlib.util
import pathlib
import re
import shutil

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("book_tool", ROOT / "tools" / "book.py")
book = importlib.util.module_from_spec(spec)
spec.loader.exec_module(book)

SUBSET = ["00_preface", "05_gae", "08_reward_model_training", "p1_math"]
ALL = [p.stem for p in book.chapter_paths(problems=True)]


def nbgrader_cells(nb):
    return [(c, c.metadata["nbgrader"]) for c in nb.cells if "nbgrader" in c.metadata]


@pytest.mark.parametrize("stem", ALL)
def test_every_assignment_has_graded_work(stem):
    nb = nbformat.read(book.notebook_path(next(p for p in book.chapter_paths(problems=True) if p.stem == stem)), 4)
    cells = nbgrader_cells(nb)
    tests = [m for _, m in cells if m["grade"] and not m["solution"]]
    answers = [m for c, m in cells if m["solution"] and c.cell_type == "code"]
    assert tests and answers and all(m["locked"] and m["points"] > 0 for m in tests)
    assert len({m["grade_id"] for _, m in cells}) == len(cells)
    for c, m in cells:  # every graded test checks a function some solution cell defines
        if m["grade"] and not m["solution"]:
            tested = re.search(r"check_\w+\(\s*(\w+)", c.source).group(1)
            assert any(re.search(rf"^def {tested}\(", a.source, re.M) for a, am in cells if am["solution"]), tested


def test_grading_metadata_follows_the_markers():
    cells = [nbformat.v4.new_code_cell("def f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION"),
             nbformat.v4.new_code_cell("# graded: 3 points\nchecks = [check_thing(f)]\ngrade(checks, points=3)"),
             nbformat.v4.new_markdown_cell("**Model answer (2 points).** Because."),
             nbformat.v4.new_code_cell("print(1)")]
    metas = book.grading_metadata(cells, "99_x")
    assert metas[0] == {"grade": False, "grade_id": "99_x-f", "locked": False, "schema_version": 3, "solution": True,
                        "task": False}
    assert metas[1]["grade_id"] == "99_x-f-test" and metas[1]["points"] == 3 and metas[1]["locked"]
    assert metas[2]["solution"] and metas[2]["grade"] and metas[2]["points"] == 2 and metas[3] is None
    with pytest.raises(ValueError, match="used twice"):
        book.grading_metadata(cells[:2] * 2, "99_x")
    # the points the marker states are the points the cell's grade() gives (nbgrader refuses a score above them)
    for last in ("grade(checks, points=2)", "check_thing(f).require()"):
        cells[1].source = f"# graded: 3 points\nchecks = [check_thing(f)]\n{last}"
        with pytest.raises(ValueError, match=r"must end with `grade\(checks, points=3\)`"):
            book.grading_metadata(cells, "99_x")


def test_student_source_drops_the_answers_and_localises_paths():
    for md in book.chapter_paths(problems=True):
        nb = nbformat.read(book.notebook_path(md), 4)
        files: set[str] = set()
        student = book.student_source(nb, md.stem, files)
        text = "\n".join(c.source for c in student.cells)
        for name in book.withheld_names(nb):  # nor through its module: show(gguf_blocks.dequantize_q4_1)
            assert not re.search(rf"^\s*show\((\w+\.)*{name}\)", text, re.M), (md.stem, name)
        assert "../configs/" not in text and "../benchmarks/" not in text
        # JupyterLab shows MyST's roles raw: the student copy has the site's numbers instead (book.plain_roles)
        assert not re.search(r"\{(eq|numref)\}`|^\$\$ *\(", text, re.M), md.stem
        assert all((ROOT / f).is_file() or (ROOT / f).is_dir() for f in files), files  # a run's folder is copied whole
        assert all(not c.get("outputs") for c in student.cells if c.cell_type == "code")
    gae = book.student_source(nbformat.read(ROOT / "notebooks" / "05_gae.ipynb", 4), "05_gae", set())
    assert sum("not shown in the student copy" in c.source for c in gae.cells) == 2
    # a checker in an ungraded cell (chapter 12's silent-bug demonstration) hides nothing; the graded one does
    contrasts = book.student_source(nbformat.read(ROOT / "notebooks" / "12_dpo_and_grpo.ipynb", 4), "12", set())
    text = "\n".join(c.source for c in contrasts.cells)
    assert "show(group_relative_advantages)" in text and "show(ipo_loss)" not in text


def fill_in_solutions(released: pathlib.Path, source: pathlib.Path) -> None:
    """A student who wrote exactly the instructor's solutions and answers (markers removed)."""
    solutions = {m["grade_id"]: c.source for c, m in nbgrader_cells(nbformat.read(source, 4)) if m["solution"]}
    nb = nbformat.read(released, 4)
    for cell, meta in nbgrader_cells(nb):
        if meta["grade_id"] in solutions:
            cell.source = "\n".join(l for l in solutions[meta["grade_id"]].splitlines() if "### " not in l)
    nbformat.write(nb, released)


def ignore_the_bootstrap(released: pathlib.Path) -> None:
    """Chapter 05's student who wrote plain GAE: the instructor's solution with the bootstrap ignored, right on
    the rows that ended and wrong on the truncated ones."""
    nb = nbformat.read(released, 4)
    (cell,) = [c for c, m in nbgrader_cells(nb) if m["grade_id"] == "05_gae-my_gae_bootstrap"]
    head, _, body = cell.source.partition("\n")
    cell.source = head + "\n    bootstrap = 0 * bootstrap\n" + body
    nbformat.write(nb, released)


@pytest.fixture(scope="module")
def graded_course(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    assert book.cmd_assignments(SUBSET, root=root) == SUBSET
    for stem in SUBSET:
        students = ("stubs", "solutions", "partial") if stem == "05_gae" else ("stubs", "solutions")
        for student in students:
            shutil.copytree(root / "release" / stem, root / "submitted" / student / stem)
        fill_in_solutions(root / "submitted" / "solutions" / stem / f"{stem}.ipynb", root / "source" / stem / f"{stem}.ipynb")
        if stem == "05_gae":
            partial = root / "submitted" / "partial" / stem / f"{stem}.ipynb"
            fill_in_solutions(partial, root / "source" / stem / f"{stem}.ipynb")
            ignore_the_bootstrap(partial)
        book.nbgrader("autograde", stem, "--create", "--force", root=root)
        book.nbgrader("generate_feedback", stem, "--force", root=root)
    return root


def grades(root, stem, student):
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        nb = gb.find_submission_notebook(stem, stem, student)
        return [(g.name, g.cell_type, g.auto_score, g.max_score, g.needs_manual_grade) for g in nb.grades]


@pytest.mark.slow
def test_release_has_stubs_and_no_hidden_tests(graded_course):
    for stem in SUBSET:
        text = (graded_course / "release" / stem / f"{stem}.ipynb").read_text()
        assert "BEGIN HIDDEN TESTS" not in text and "BEGIN SOLUTION" not in text and "Model answer" not in text
        assert "raise NotImplementedError()" in text
        assert ("YOUR ANSWER HERE" in text) == stem[0].isdigit()  # chapters have written questions
    assert (graded_course / "release" / "08_reward_model_training" / "configs" / "tiny_rm.yaml").is_file()


@pytest.mark.parametrize("stem", SUBSET)
@pytest.mark.slow
def test_stubs_score_zero_and_solutions_full_marks(graded_course, stem):
    stubs, solutions = grades(graded_course, stem, "stubs"), grades(graded_course, stem, "solutions")
    auto = [g for g in stubs if g[1] == "code"]
    assert auto, stem
    assert all(score == 0 for _, _, score, _, _ in auto), stubs
    assert all(score == top for _, kind, score, top, _ in solutions if kind == "code"), solutions
    # written answers: an untouched "YOUR ANSWER HERE" scores 0 by itself, a written one waits for the teacher
    assert all(score == 0 and not manual for _, kind, score, _, manual in stubs if kind == "markdown"), stubs
    assert all(manual for _, kind, _, _, manual in solutions if kind == "markdown"), solutions


@pytest.mark.slow
def test_partial_work_earns_partial_credit_and_its_feedback_names_every_case(graded_course):
    """Issue 36: plain GAE is right on the cases where every row ended and wrong on the truncated ones; it used to
    score what the empty stub scores (0 of 3)."""
    (test,) = [g for g in grades(graded_course, "05_gae", "partial") if g[0] == "05_gae-my_gae_bootstrap-test"]
    assert 0 < test[2] < test[3] == 3, test
    html = (graded_course / "feedback" / "partial" / "05_gae" / "05_gae.html").read_text()
    assert "PASS every row ended (bootstrap 0): plain GAE" in html and "FAIL every row truncated" in html
    assert f"score: {test[2]:g} of 3 points" in html


@pytest.mark.slow
def test_feedback_is_generated(graded_course):
    for stem in SUBSET:
        for student in ("stubs", "solutions"):
            html = graded_course / "feedback" / student / stem / f"{stem}.html"
            assert html.is_file(), html
    failed = (graded_course / "feedback" / "stubs" / "05_gae" / "05_gae.html").read_text()
    assert "is withheld" not in failed and "NotImplementedError" in failed  # the stub's own error, reported


def test_config_points_nbgrader_at_course():
    text = (ROOT / "nbgrader_config.py").read_text()
    assert 'c.CourseDirectory.root' in text and "Execute.timeout" in text


def test_points_in_the_course_readme_match_the_graded_cells():
    course = (ROOT / "course" / "README.md").read_text()
    for md in book.chapter_paths(problems=True):
        cells = nbgrader_cells(nbformat.read(book.notebook_path(md), 4))
        auto = sum(m.get("points", 0) for c, m in cells if c.cell_type == "code")
        written = sum(m.get("points", 0) for c, m in cells if c.cell_type == "markdown")
        row = re.search(rf"^\| {md.stem} \|[^|]*\| (\d+) \| (\d+|–) \|", course, re.M)
        assert row, md.stem
        assert (int(row.group(1)), row.group(2)) == (auto, str(written) if written else "–"), md.stem


@pytest.mark.parametrize("stem", ["14_scaling_out", "15_launching_7b"])
def test_chapters_naming_the_repository_run_from_their_assignment_folder(stem, tmp_path, monkeypatch):
    """Chapters 14 and 15 name the repository `ROOT = pathlib.Path("..")` and run commands in it; as an
    assignment (one folder, nothing above it) ROOT is the folder, and every file named under it travels with it,
    a pipeline file with its stage configs."""
    from marlhf_edu.training.pipeline_file import load_pipeline

    files: set[str] = set()
    student = book.student_source(nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", 4), stem, files)
    text = "\n".join(c.source for c in student.cells if c.cell_type == "code")
    assert 'pathlib.Path("..")' not in text and 'ROOT = pathlib.Path(".")' in text
    for rel in files:  # as cmd_assignments copies them
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        book._copy_confined(ROOT / rel, tmp_path / rel)
    named = re.findall(r"[\"']((?:configs|benchmarks)/[\w./-]*\w)[\"']", text)
    named += ["benchmarks/" + n for n in re.findall(r"BENCH / [\"']([\w./-]+)[\"']", text)]
    assert named and all((tmp_path / rel).exists() for rel in named), [r for r in named if not (tmp_path / r).exists()]
    monkeypatch.chdir(tmp_path)
    if stem == "15_launching_7b":  # the smoke run reads the pipeline and its three stage configs from ROOT
        stages, _ = load_pipeline("configs/llama2_7b/pipeline.yaml", [])
        assert [s.name for s in stages] == ["sft", "rm", "ma-ppo"]
        assert all((tmp_path / s.config).is_file() for s in stages), [s.config for s in stages]


def test_assignment_paths_stay_inside_configs_and_benchmarks(tmp_path):
    """Issue 37 item 14: a chapter cell naming `../configs/../../..` must not make an assignment copy files from
    outside the repository's configs/ and benchmarks/, and symbolic links are never followed."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell('open("../configs/../../../etc/passwd")')]
    with pytest.raises(SystemExit, match="leads outside configs/ and benchmarks/"):
        book.student_source(nb, "evil", set())
    assert book.confined_path("benchmarks/smollm2_last_token/smollm2_ma_ppo") == "benchmarks/smollm2_last_token/smollm2_ma_ppo"
    link = ROOT / "benchmarks" / "_test_link_to_outside"
    link.symlink_to(tmp_path)
    try:
        with pytest.raises(SystemExit, match="leads outside"):
            book.confined_path("benchmarks/_test_link_to_outside")
    finally:
        link.unlink()
    # a folder inside benchmarks/ that holds a link to outside: refused as a whole, nothing copied
    folder = ROOT / "benchmarks" / ".test_folder_with_a_link"  # a dot: never an entry of the benchmarks index
    shutil.rmtree(folder, ignore_errors=True)  # left by a killed run of this test
    folder.mkdir()
    try:
        (folder / "run.json").write_text("{}")
        (folder / "secret").symlink_to(tmp_path)
        with pytest.raises(SystemExit, match=r"\.test_folder_with_a_link/secret is a symbolic link"):
            book._copy_confined(folder, tmp_path / "copy")
        assert not (tmp_path / "copy").exists()
    finally:
        shutil.rmtree(folder)


def test_learner_edition_has_no_answers_and_keeps_a_learners_work(tmp_path):
    """Issue 36: `make lab` builds learner/ from the instructor copies with nbgrader's own preprocessors: the
    exercise is a stub, the hidden tests and model answers are gone, no exercise cell keeps an output (which
    outputs stay: tests/test_learner.py), nothing pairs it with chapters/, and a learner's edited notebook is never
    overwritten. Its JupyterLab hides nbgrader."""
    import json

    instructor = nbformat.read(ROOT / "notebooks" / "05_gae.ipynb", 4)
    solution = next(c.source for c in instructor.cells if c.metadata.get("nbgrader", {}).get("solution")
                    and c.cell_type == "code")
    answers = [c.source for c in instructor.cells if c.cell_type == "markdown"
               and c.metadata.get("nbgrader", {}).get("solution")]
    book.cmd_learner(["05_gae"], out=tmp_path)
    copy = tmp_path / "05_gae.ipynb"
    learner = nbformat.read(copy, 4)
    text = copy.read_text()
    body = [l for l in solution.splitlines() if l.strip() and not l.startswith(("def ", "###", "#"))]
    assert body and not any(json.dumps(l.strip())[1:-1] in text for l in body[:5])
    assert "raise NotImplementedError()" in text and "BEGIN HIDDEN TESTS" not in text
    assert len(answers) >= 3 and not any(a.split("**", 2)[2][:60] in text for a in answers)
    assert not any(c.get("outputs") for c in learner.cells if c.cell_type == "code" and "nbgrader" in c.metadata)
    assert "jupytext" not in learner.metadata and 'formats = "ipynb"' in (tmp_path / "jupytext.toml").read_text()
    # the prose and the demonstrations are the instructor copy's (its MyST cross-references as plain numbers)
    plain = book.plain_roles(nbformat.from_dict(json.loads(json.dumps(instructor))), "05_gae")
    assert [c.source for c in learner.cells if c.cell_type == "markdown"][:2] == \
        [c.source for c in plain.cells if c.cell_type == "markdown"][:2]
    page = json.loads((tmp_path / ".jupyter" / "labconfig" / "page_config.json").read_text())
    server = json.loads((tmp_path / ".jupyter" / "jupyter_server_config.json").read_text())
    assert page["disabledExtensions"] == {"@jupyter/nbgrader": True}
    assert not any(server["ServerApp"]["jpserver_extensions"].values())
    # the learner works in it: a rebuild keeps it, and names it
    copy.write_text(text.replace("raise NotImplementedError()", "return None"))
    assert book.cmd_learner(["05_gae"], out=tmp_path) == []
    assert "return None" in copy.read_text()
    copy.unlink()
    assert book.cmd_learner(["05_gae"], out=tmp_path) == [copy]


def test_executing_a_chapter_prints_progress(capsys, tmp_path):
    """Issue 36: `make notebooks` is never silent for long: a line per cell that ends `progress_s` after the last."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), nbformat.v4.new_code_cell("1 + 1"),
                nbformat.v4.new_code_cell("2 + 2")]
    book.execute(nb, cwd=tmp_path, name="t", progress_s=0)
    assert re.findall(r"t: code cell (\d) of 2, \d+ s", capsys.readouterr().out) == ["1", "2"]
    book.execute(nb, cwd=tmp_path, name="t", progress_s=3600)
    assert "code cell" not in capsys.readouterr().out


@pytest.mark.slow
def test_jupyterlab_shows_the_learner_edition_without_raw_myst(tmp_path):
    """Issue 36: JupyterLab renders Markdown, not MyST, so a chapter showed "{eq}`gae`", "{numref}`fig-…`" and a
    stray "(td-error)" under each labelled equation. The learner edition (`make lab`) carries the site's numbers
    instead (`book.plain_roles`). Opened in JupyterLab in headless Chromium, as a reader opens it; a chapter's
    `Table` output is a rendered table there, not Markdown source."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser checks: install Debian's chromium (.ci/run does)")
        pytest.skip("no chromium on this machine (apt-get install chromium); CI runs this check")
    from playwright.sync_api import sync_playwright

    book.cmd_learner(["05_gae"], out=tmp_path)
    shutil.copy(ROOT / "notebooks" / "06_ppo_losses.ipynb", tmp_path / "06_instructor.ipynb")  # stored outputs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import tempfile

    runtime = tempfile.mkdtemp()  # outside the server's root: not a folder in the learner's file browser
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / ".jupyter"), "JUPYTER_RUNTIME_DIR": runtime}
    server = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
                               "--ServerApp.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
                               f"--ServerApp.root_dir={tmp_path}", "--allow-root"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                urllib.request.urlopen(base + "/api/status", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(base + "/lab/tree/05_gae.ipynb", wait_until="load")
            page.wait_for_selector(".jp-MarkdownCell .jp-RenderedMarkdown", timeout=90_000)
            page.wait_for_timeout(3000)  # every cell rendered, MathJax typeset
            # textContent, not innerText: JupyterLab skips painting cells below the fold (CSS content-visibility),
            # and innerText of an unpainted cell is empty, so what the check reads would depend on the window's height
            text = page.evaluate("() => [...document.querySelectorAll('.jp-MarkdownCell .jp-RenderedMarkdown')]"
                                 ".map(e => e.textContent).join('\\n')")
            shots = ROOT / "build" / "site-check"
            shots.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shots / "jupyterlab_05_gae.png"))
            # a marlhf_edu.teaching.book.Table output is a Markdown table in JupyterLab too (chapter 06 shows one; the
            # learner edition has no outputs, so the instructor copy, as `make teach` opens it)
            page.goto(base + "/lab/tree/06_instructor.ipynb", wait_until="load")
            # "attached", not "visible": an unpainted table below the fold is invisible to Playwright however long it
            # waits (it timed out so in CI, whose layout put the tables lower)
            table = page.locator(".jp-OutputArea-output table", has_text="sequence-mean").first
            table.wait_for(state="attached", timeout=90_000)
            cells = table.evaluate("t => [...t.querySelectorAll('th, td')].map(c => c.textContent.trim())")
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert "Generalised" in text or "GAE" in text, text[:500]  # the chapter rendered
    raw = re.findall(r"\{(?:eq|numref|doc|ref)\}`[^`]*`|\((?:td-error|gae)\)", text)
    assert not raw, raw
    assert "Figure 5.1" in text and "(5.2)" in text  # the site's numbers, as plain text
    assert cells[:6] == ["", "token weight, short", "token weight, long", "response weight, short",
                         "response weight, long", "token-mean"], cells
