"""Execute the chapters and build the book's site.

  python tools/book.py notebooks [NAME ...]   re-generate notebooks/ from chapters/ and execute them in place
  python tools/book.py site                   build the site into build/site/ from the stored outputs
  python tools/book.py site --execute         execute every chapter into build/executed/ first, build from those
  python tools/book.py status                 list chapter pairs that are out of sync or unexecuted
  python tools/book.py times                  execute every chapter and problem set into build/executed/ and record
                                              the seconds each took: benchmarks/chapter_times_<cpu kind>.json
  python tools/book.py grading                write nbgrader cell metadata into chapters/ from the exercise markers
  python tools/book.py assignments [NAME ...] build course/source/ from the stored notebooks, release into course/release/
  python tools/book.py learner [NAME ...]     the learner edition: learner/ from the stored notebooks, answers removed

Exercise markers in a chapter (the chapter stays the single source; `grading` turns them into nbgrader metadata,
which jupytext's pairing keeps):
  a code cell with `### BEGIN SOLUTION`        autograded answer, grade_id `<chapter>-<def name>`
  a code cell whose first line is `# graded: N points`
                                               locked, graded test cell worth N, `<chapter>-<function>-test`;
                                               `### BEGIN HIDDEN TESTS` … `### END HIDDEN TESTS` stay out of releases
  a markdown cell starting `**Model answer (N point(s)).**`
                                               manually graded answer worth N, `<chapter>-answer-<k>`

The site is Sphinx + myst-nb + sphinx-book-theme (`site/conf.py`), with MathJax installed from the npm
registry (`site/package.json`, `site/package-lock.json`) and served locally. `site` never writes to
notebooks/; `notebooks` is the only command that rewrites stored outputs.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
NOTEBOOKS = ROOT / "notebooks"
COURSE = ROOT / "course"
LEARNER = ROOT / "learner"
BUILD = ROOT / "build"
SITE = ROOT / "site"
# the parts of MathJax's es5 distribution that TeX input with CHTML output loads
MATHJAX_PARTS = ["tex-chtml.js", "input", "output", "ui", "a11y", "adaptors", "sre"]

# What every kernel that executes a chapter sees (nbval's kernel gets the same from the Makefile).
QUIET_ENV = {
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
}


def chapter_paths(names: list[str] | None = None, problems: bool = False) -> list[pathlib.Path]:
    """Chapter sources (chapters/NN_*.md), and with `problems` the problem sets (chapters/problems/*.md) too."""
    paths = sorted(CHAPTERS.glob("[0-9][0-9]_*.md"))
    if problems:
        paths += sorted((CHAPTERS / "problems").glob("*.md"))
    if names:
        wanted = {pathlib.Path(n).name.removesuffix(".md").removesuffix(".ipynb") for n in names}
        paths = [p for p in paths if p.stem in wanted or p.stem[:2] in wanted]
        if not paths:
            sys.exit(f"no chapter matches {sorted(wanted)}")
    return paths


def notebook_path(md: pathlib.Path) -> pathlib.Path:
    """chapters/X.md -> notebooks/X.ipynb, chapters/problems/X.md -> notebooks/problems/X.ipynb."""
    return NOTEBOOKS / md.relative_to(CHAPTERS).with_suffix(".ipynb")


# --- nbgrader metadata from the exercise markers ----------------------------------------------------------------

GRADED = re.compile(r"^# graded: (\d+) points?\b")
ANSWER = re.compile(r"^\*\*Model answer \((\d+) points?\)\.\*\*")


def _nbgrader(grade_id: str, *, solution: bool, grade: bool, locked: bool, points: int | None = None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3, "solution": solution,
            "task": False}
    if points is not None:
        meta["points"] = points
    return meta


def grading_metadata(cells, stem: str) -> list[dict | None]:
    """The nbgrader metadata each cell should carry, derived from the markers (see the module docstring)."""
    metas, answers, seen = [], 0, set()
    for i, cell in enumerate(cells):
        src = cell.source.lstrip()
        meta = None
        if cell.cell_type == "code" and "### BEGIN SOLUTION" in src:
            name = re.search(r"^def (\w+)", src, re.M)
            meta = _nbgrader(f"{stem}-{name.group(1) if name else f'solution-{i}'}", solution=True, grade=False,
                             locked=False)
        elif cell.cell_type == "code" and (m := GRADED.match(src)):
            tested = re.search(r"check_\w+\(\s*(\w+)", src)
            if not tested:
                raise ValueError(f"{stem}, cell {i}: a graded cell must call a check_… function on the learner's one")
            last = src.rstrip().splitlines()[-1]
            said = re.match(r"grade\(checks, points=(\d+)(, partial=False)?\)$", last)
            if not said or said.group(1) != m.group(1):
                raise ValueError(f"{stem}, cell {i}: a graded cell worth {m.group(1)} points must end with "
                                 f"`grade(checks, points={m.group(1)})` (its partial credit), not {last!r}")
            meta = _nbgrader(f"{stem}-{tested.group(1)}-test", solution=False, grade=True, locked=True,
                             points=int(m.group(1)))
        elif cell.cell_type == "markdown" and (m := ANSWER.match(src)):
            answers += 1
            meta = _nbgrader(f"{stem}-answer-{answers}", solution=True, grade=True, locked=False, points=int(m.group(1)))
        if meta:
            if meta["grade_id"] in seen:
                raise ValueError(f"{stem}, cell {i}: grade_id {meta['grade_id']!r} is used twice")
            seen.add(meta["grade_id"])
        metas.append(meta)
    return metas


def apply_grading_metadata(nb, stem: str) -> bool:
    """Set (or remove) each cell's nbgrader metadata; True when anything changed."""
    changed = False
    for cell, meta in zip(nb.cells, grading_metadata(nb.cells, stem)):
        if cell.metadata.get("nbgrader") != meta:
            changed = True
            if meta is None:
                cell.metadata.pop("nbgrader", None)
            else:
                cell.metadata["nbgrader"] = meta
    return changed


def cmd_grading(names: list[str] | None = None) -> None:
    """Write the derived nbgrader metadata into the chapter sources (jupytext keeps it in the pairing)."""
    import jupytext

    for md in chapter_paths(names, problems=True):
        nb = jupytext.read(md)
        if apply_grading_metadata(nb, md.stem):
            jupytext.write(nb, md, fmt="md:myst")
            print(f"{md.relative_to(ROOT)}: nbgrader metadata written")


def read_chapter(md: pathlib.Path):
    import jupytext

    nb = jupytext.read(md)
    # stable cell ids, so re-executing an unchanged chapter leaves an unchanged notebook
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"c{i:03d}"
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["jupytext"] = {"formats": "notebooks///ipynb,chapters///md:myst"}
    if apply_grading_metadata(nb, md.stem):
        sys.exit(f"{md.relative_to(ROOT)}: its nbgrader metadata does not match its exercise markers; "
                 "run `python tools/book.py grading` first")
    return nb


def execute(nb, timeout: int = 900, cwd: pathlib.Path = NOTEBOOKS, name: str = "", progress_s: float = 10.0):
    """Execute `nb` in place in a fresh kernel (working directory `cwd`); returns the seconds it took. With `name`,
    prints a progress line (chapter, code cell i of n, seconds so far) after any cell that ends more than
    `progress_s` seconds after the last line, so a long chapter is never silent for long."""
    from nbclient import NotebookClient

    os.environ.update(QUIET_ENV)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    start = last = time.perf_counter()

    def on_cell_executed(cell, cell_index, **_):
        nonlocal last
        now = time.perf_counter()
        if name and now - last >= progress_s:
            print(f"  {name}: code cell {code.index(cell_index) + 1} of {len(code)}, {now - start:.0f} s", flush=True)
            last = now

    # the kernel listens on loopback only; ipykernel's notice that such TCP is unencrypted is not for
    # readers of the build log, so its own log stops at errors
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],
                            resources={"metadata": {"path": str(cwd)}}, on_cell_executed=on_cell_executed)
    client.execute()
    merged_streams(nb)
    return time.perf_counter() - start


def merged_streams(nb) -> None:
    """Join, in each code cell of `nb`, every run of consecutive stream outputs of one name (stdout, stderr).

    How a cell's printed lines are cut into stream outputs depends on when the kernel flushed them, which
    depends on the machine's speed; joined, a re-executed chapter's stored outputs change only where what it
    printed changed (nbval and the site join them the same way). nbconvert's preprocessor does the joining."""
    from nbconvert.preprocessors.coalescestreams import CoalesceStreamsPreprocessor

    CoalesceStreamsPreprocessor().preprocess(nb, {})


def execute_chapters(out_dir: pathlib.Path, names: list[str] | None = None,
                     problems: bool | None = None) -> dict[str, float]:
    """Execute chapters (all, or `names`) from chapters/ into `out_dir`, and the problem sets if `problems` (by
    default only when `out_dir` is notebooks/); returns seconds per chapter."""
    import nbformat

    timings = {}
    for md in chapter_paths(names, problems=out_dir == NOTEBOOKS if problems is None else problems):
        nb = read_chapter(md)
        notebook_path(md).parent.mkdir(parents=True, exist_ok=True)
        print(f"{md.stem}: executing {sum(c.cell_type == 'code' for c in nb.cells)} code cells", flush=True)
        timings[md.stem] = round(execute(nb, cwd=notebook_path(md).parent, name=md.stem), 1)
        out = out_dir / notebook_path(md).relative_to(NOTEBOOKS)
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out)
        print(f"{out.relative_to(ROOT)}: executed in {timings[md.stem]:.1f} s", flush=True)
    return timings


def cmd_notebooks(names: list[str] | None) -> None:
    cmd_grading(names)
    execute_chapters(NOTEBOOKS, names)


def install_mathjax(static: pathlib.Path) -> None:
    """MathJax from the npm registry, pinned by site/package-lock.json, copied into the site's _static/."""
    npm_dir = BUILD / "npm"
    installed = npm_dir / "node_modules" / "mathjax" / "package.json"
    wanted = json.loads((SITE / "package-lock.json").read_text())["packages"]["node_modules/mathjax"]["version"]
    if not installed.exists() or json.loads(installed.read_text())["version"] != wanted:
        npm = shutil.which("npm")
        if npm is None:
            sys.exit("make book needs npm (Node.js) to install MathJax: apt-get install npm, or set "
                     "MARLHF_MATHJAX_CDN=1 to load MathJax from its CDN instead")
        npm_dir.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(SITE / name, npm_dir / name)
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=npm_dir, check=True)
    es5 = npm_dir / "node_modules" / "mathjax" / "es5"
    for part in MATHJAX_PARTS:
        src, dst = es5 / part, static / "mathjax" / part
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)


def stage_site(notebooks: pathlib.Path) -> pathlib.Path:
    """build/site-src/: the Sphinx sources of site/ plus the executed notebooks, the chapters under chapters/ and
    the problem sets under problems/ (pages chapters/05_gae.html, problems/p1_math.html), each with its answers
    folded."""
    src = BUILD / "site-src"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(SITE, src, ignore=shutil.ignore_patterns("package*.json", "__pycache__"))
    import nbformat

    for md in chapter_paths(problems=True):
        executed = notebooks / notebook_path(md).relative_to(NOTEBOOKS)
        if not executed.exists() and md.parent.name == "problems":
            executed = notebook_path(md)  # `site --execute` executes the chapters only: problem sets as stored
        staged = src / ("problems" if md.parent.name == "problems" else "chapters") / executed.name
        staged.parent.mkdir(exist_ok=True)
        nbformat.write(fold_answers(nbformat.read(executed, as_version=4)), staged)
    for name, text in readme_parts(src).items():
        (src / name).write_text(text)
    if os.environ.get("MARLHF_MATHJAX_CDN") != "1":
        install_mathjax(src / "_static")
    return src


#: The README's links, as the site names the same pages (a chapter or problem set is its executed notebook there)
README_LINKS = [(re.compile(r"^chapters/problems/(\w+)\.md$"), r"problems/\1.ipynb"),
                (re.compile(r"^chapters/(\w+)\.md$"), r"chapters/\1.ipynb"),
                (re.compile(r"^site/(\w+)\.md$"), r"\1.md")]


def readme_parts(src: pathlib.Path) -> dict[str, str]:
    """The parts of README.md that the site's front page includes (site/index.md), so each is written once: its
    pipeline figure (`_readme_figure.md`, the image referenced where it lies, docs/figures/, not copied) and the
    body of its "Reading path" section (`_readme_reading_path.md`), with each link rewritten to the site's page.
    A link the site has no page for stops the build, naming it."""
    readme = (ROOT / "README.md").read_text()
    figure = re.search(r"^!\[([^\]]*)\]\(([^)]+)\)$", readme, re.M)
    image = os.path.relpath(ROOT / figure.group(2), src)
    section = re.search(r"^## Reading path\n\n(.*?)(?=^## )", readme, re.M | re.S).group(1)

    def site_link(match):
        target = match.group(1)
        for pattern, replacement in README_LINKS:
            if pattern.match(target):
                return f"]({pattern.sub(replacement, target)})"
        sys.exit(f"README.md's reading path links {target!r}, which the site has no page for "
                 "(tools/book.py README_LINKS)")

    return {"_readme_figure.md": f"![{figure.group(1)}]({image})\n",
            "_readme_reading_path.md": re.sub(r"\]\(([^)]+)\)", site_link, section)}


ANSWER_OPEN = '<details class="marlhf-answer"><summary>{title}</summary>\n\n'
ANSWER_CLOSE = "\n\n</details>"


def fold_answers(nb):
    """The site's copy of a chapter with its answers folded, closed until a reader opens them: the source of an
    exercise's solution and of a graded cell's hidden tests (myst-nb's `hide-input` toggle), the listing of a
    package function the exercise withholds (`hide-output`), and each model answer (an HTML <details> around it,
    whose markdown and math the site still renders)."""
    hidden = withheld_names(nb)
    for cell in nb.cells:
        grading = cell.get("metadata", {}).get("nbgrader", {})
        tags = cell.setdefault("metadata", {}).setdefault("tags", [])
        if cell.cell_type == "markdown" and grading.get("solution"):
            points = ANSWER.match(cell.source)
            title = f"Model answer ({points.group(1)} point{'s' * (points.group(1) != '1')})" if points else "Model answer"
            cell.source = ANSWER_OPEN.format(title=title) + cell.source + ANSWER_CLOSE
        elif cell.cell_type == "code" and (grading.get("solution") or "### BEGIN HIDDEN TESTS" in cell.source):
            tags.append("hide-input")
        elif cell.cell_type == "code" and any((m := SHOWN.match(line.strip())) and m.group(1) in hidden
                                              for line in cell.source.splitlines()):
            tags.append("hide-output")
    return nb


def execute_all() -> pathlib.Path:
    """Execute every chapter afresh into build/executed/ (stored outputs in notebooks/ stay untouched)."""
    out = BUILD / "executed"
    out.mkdir(parents=True, exist_ok=True)
    timings = execute_chapters(out)
    timings["total"] = round(sum(timings.values()), 1)
    (out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    print(f"{len(timings) - 1} chapters executed in {timings['total']:.1f} s")
    return out


def smollm2_cache_state() -> str:
    """What `times` records about the SmolLM2 model cache: on a fresh machine chapter 13 first converts the shipped
    GGUF file (the folder `materialize_gguf` publishes, with its manifest) and the chapters build merged models."""
    from marlhf_edu.loading.model_cache import cache_dir
    from marlhf_edu.loading.sources import gguf_digest, shipped_gguf_path

    gguf = shipped_gguf_path("smollm2")
    converted = cache_dir() / "gguf" / f"{gguf.stem}-{gguf_digest(gguf)[:16]}" / "marlhf_manifest.json"
    merged = cache_dir() / "merged"
    built = sum(1 for entry in merged.iterdir() if entry.is_dir()) if merged.is_dir() else 0
    return (f"GGUF conversion {'present' if converted.is_file() else 'absent (chapter 13 converts it first)'}; "
            f"{built} merged model folder(s) present")


def git_state() -> dict:
    """The commit a record was made at and whether the tree had uncommitted changes to tracked files."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return {"commit": head or None, "tracked_files_changed": bool(dirty)}


def cmd_times(out_dir: pathlib.Path = ROOT / "benchmarks") -> dict:
    """Every chapter and problem set executed afresh into build/executed/, one after another (the stored outputs in
    notebooks/ stay untouched), and the seconds each took written to `out_dir`/chapter_times_<cpu kind>.json with
    the machine, the date and the SmolLM2 cache's state. One run on one machine: the README's "runs in" column
    quotes such a record (tests/test_readme.py holds them equal). An existing record is never overwritten."""
    import platform

    from marlhf_edu.records import cpu_kind, machine, measured_on

    try:
        kind = cpu_kind(pathlib.Path("/proc/cpuinfo").read_text())
    except (OSError, ValueError):  # no x86 /proc/cpuinfo (macOS, ARM): the record is named after the architecture
        kind = platform.machine().lower() or "cpu"
    out = out_dir / f"chapter_times_{kind}.json"
    shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    if out.exists():  # a record is evidence
        sys.exit(f"book.py times: {shown} exists; move it aside (e.g. to a name ending _at_<commit>) first")
    cache, at = smollm2_cache_state(), git_state()
    start = time.perf_counter()
    seconds = execute_chapters(BUILD / "executed", problems=True)
    record = {"what": "seconds each chapter and problem set takes to execute (every code cell, a fresh kernel "
                      "each, one after another in one run)",
              "command": "python tools/book.py times", "date": time.strftime("%Y-%m-%d"), "cpu_kind": kind,
              "measured_on": measured_on(), "machine": machine(), **at, "smollm2_cache": cache,
              "seconds": seconds, "total_s": round(sum(seconds.values()), 1),
              "wall_s": round(time.perf_counter() - start, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(seconds)} chapters and problem sets executed in {record['total_s']:.1f} s: {shown}")
    return record


def cmd_site(execute_first: bool) -> None:
    start = time.perf_counter()
    src = stage_site(execute_all() if execute_first else NOTEBOOKS)
    out = BUILD / "site"
    # -W: a broken reference, a missing image or a malformed docstring fails the build instead of a log line
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-E", "-q", "-W", "--keep-going",
           "-d", str(BUILD / "site-doctrees"), str(src), str(out)]
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, env=env)
    print(f"{out.relative_to(ROOT)}/index.html built in {time.perf_counter() - start:.0f} s")


def out_of_sync() -> list[str]:
    """Problems with chapter/notebook pairs: missing partner, differing cells or metadata, unexecuted code cells."""
    import jupytext

    problems = []
    md_stems = {str(p.relative_to(CHAPTERS).with_suffix("")) for p in CHAPTERS.rglob("*.md")}
    nb_stems = {str(p.relative_to(NOTEBOOKS).with_suffix("")) for p in NOTEBOOKS.rglob("*.ipynb")
                if ".ipynb_checkpoints" not in p.parts}
    problems += [f"chapters/{s}.md has no notebooks/{s}.ipynb" for s in sorted(md_stems - nb_stems)]
    problems += [f"notebooks/{s}.ipynb has no chapters/{s}.md" for s in sorted(nb_stems - md_stems)]
    for stem in sorted(md_stems & nb_stems):
        source = jupytext.read(CHAPTERS / f"{stem}.md")
        stored = jupytext.read(NOTEBOOKS / f"{stem}.ipynb")
        a = [(c.cell_type, c.source.strip(), c.metadata.get("nbgrader")) for c in source.cells]
        b = [(c.cell_type, c.source.strip(), c.metadata.get("nbgrader")) for c in stored.cells]
        if a != b:
            diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            problems.append(f"{stem}: chapter and notebook differ from cell {diff} on "
                            f"(run `make notebooks` or sync with jupytext)")
        if grading_metadata(source.cells, pathlib.Path(stem).name) != [c.metadata.get("nbgrader") for c in source.cells]:
            problems.append(f"chapters/{stem}.md: nbgrader metadata does not match the exercise markers "
                            f"(run `python tools/book.py grading`)")
        for i, c in enumerate(stored.cells):
            if c.cell_type == "code" and c.source.strip() and c.get("execution_count") is None:
                problems.append(f"notebooks/{stem}.ipynb: code cell {i} has no stored execution")
    return problems


# --- the course: nbgrader source and release ------------------------------------------------------------------

SHOWN = re.compile(r"^show\((?:\w+\.)*(\w+)\)$")  # show(name) or show(module.name): group 1 is the name
WITHHELD_NOTE = ("*The package's `{name}` is not shown in the student copy: it gives this chapter's exercise away, "
                 "and the checker withholds it while your code runs. It is in the instructor copy.*")


def withheld_names(nb) -> set[str]:
    """Names of the package functions the chapter's graded exercise checkers withhold (the answers). A checker
    called in an ungraded cell (a demonstration of silent bugs, say) hides nothing: what it checks is taught."""
    from marlhf_edu.teaching import exercises

    graded = [c for c in nb.cells if c.cell_type == "code" and c.get("metadata", {}).get("nbgrader", {}).get("grade")]
    used = {m for c in graded for m in re.findall(r"\b(check_\w+)\(", c.source)}
    return {path.rpartition(".")[2] for name in used if hasattr(exercises, name)
            for path in getattr(exercises, name).withholds}


ROLE = re.compile(r"\{(eq|numref)\}`([^`<>]+)`")
EQUATION_LABEL = re.compile(r"^\$\$ *\(([\w-]+)\) *$", re.M)


def plain_roles(nb, stem: str):
    """The chapter as JupyterLab can show it: MyST's cross-references become the numbers the site gives them.

    JupyterLab renders Markdown, not MyST (no `jupyterlab-myst` supports the pinned JupyterLab 4.6), so a labelled
    equation `$$ … $$ (gae)` showed a stray "(gae)" and a reference showed as {eq}`gae`. Here the equation
    carries `\\tag{5.2}` (MathJax numbers it), {eq}`gae` becomes (5.2) and {numref}`fig-gae-credit` Figure 5.1:
    equations and figures numbered per chapter in order of appearance, as site/conf.py `number_per_chapter` does.
    The instructor copies keep MyST (the site reads them)."""
    if not stem[:2].isdigit():  # the site numbers only chapters per chapter (a problem set has no roles)
        if any(ROLE.search(c.source) or EQUATION_LABEL.search(c.source) for c in nb.cells if c.cell_type == "markdown"):
            raise SystemExit(f"{stem}: cross-references outside a numbered chapter are not supported")
        return nb
    chapter = int(stem[:2])
    numbers: dict[str, str] = {}
    counts = {"eq": 0, "numref": 0}
    for cell in nb.cells:
        found = []
        if cell.cell_type == "markdown":
            found = [("eq", label) for label in EQUATION_LABEL.findall(cell.source)]
        figure = cell.metadata.get("mystnb", {}).get("figure", {}).get("name")
        if figure:
            found.append(("numref", figure))
        for kind, label in found:
            counts[kind] += 1
            numbers[label] = f"{chapter}.{counts[kind]}"

    def tagged(match):  # `$$ … $$ (label)`: the closing line of a labelled display equation
        return "\\tag{" + numbers[match.group(1)] + "}\n$$"

    def reference(match):
        kind, label = match.groups()
        if label not in numbers:
            raise SystemExit(f"{stem}: {{{kind}}}`{label}` names no equation or figure of the chapter")
        return f"({numbers[label]})" if kind == "eq" else f"Figure {numbers[label]}"

    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = ROLE.sub(reference, EQUATION_LABEL.sub(tagged, cell.source))
    return nb


#: how chapters 14 and 15 name the repository, and the paths they name under it
REPO_ROOT = 'pathlib.Path("..")'
ROOTED_PATH = r"""["']((?:configs|benchmarks)/[\w./-]*[\w])["']|BENCH / ["']([\w./-]+)["']"""


def student_source(nb, stem: str, files: set[str], local_paths: bool = True):
    """The nbgrader source of a chapter: the instructor copy without the answers' `show()`, with paths local, and
    with MyST's cross-references as plain numbers (`plain_roles`: students open it in JupyterLab).

    Paths `../configs/X` and `../benchmarks/X` become `configs/X` and `benchmarks/X` (added to `files`, copied
    next to the notebook): an assignment travels as one folder. A chapter that names the repository
    `ROOT = pathlib.Path("..")` (14, 15) gets `pathlib.Path(".")`, and the paths it names under it are copied; a
    pipeline file brings its stage configs. With `local_paths=False` paths stay as they are (the learner edition
    sits beside notebooks/). Outputs are cleared (nbgrader would anyway).
    """
    import nbformat
    import yaml

    nb = nbformat.from_dict(json.loads(json.dumps(nb)))  # a deep copy
    hidden = withheld_names(nb)
    # chapters 14 and 15 name the repository ROOT (a working directory for commands) and paths under it
    rooted = any(REPO_ROOT in c.source for c in nb.cells if c.cell_type == "code")
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            lines = cell.source.splitlines()
            shown = [m.group(1) for l in lines if (m := SHOWN.match(l.strip())) and m.group(1) in hidden]
            if shown:
                cells.append(nbformat.v4.new_markdown_cell(" ".join(WITHHELD_NOTE.format(name=n) for n in shown)))
                lines = [l for l in lines if not ((m := SHOWN.match(l.strip())) and m.group(1) in hidden)]
                if not any(l.strip() and not l.lstrip().startswith("#") for l in lines):
                    continue  # the cell only showed the answer
                cell.source = "\n".join(lines).strip("\n")
            for found in re.findall(r"\.\./((?:configs|benchmarks)/[\w./-]+)", cell.source):
                files.add(confined_path(found, stem))
            if rooted:  # `ROOT / "configs/X"`, `BENCH / "X"`, and "configs/X" given to a command run in ROOT
                for quoted, bench in re.findall(ROOTED_PATH, cell.source):
                    files.add(confined_path(quoted or f"benchmarks/{bench}", stem))
            if local_paths:
                cell.source = re.sub(r"\.\./(configs|benchmarks)/", r"\1/", cell.source)
                cell.source = cell.source.replace(REPO_ROOT, 'pathlib.Path(".")')  # the assignment's own folder
            cell.outputs, cell.execution_count = [], None
        cells.append(cell)
    nb.cells = cells
    for rel in [f for f in files if f.startswith("configs/") and f.endswith(".yaml")]:  # a pipeline brings its stages
        spec = yaml.safe_load((ROOT / rel).read_text())
        if isinstance(spec, dict) and isinstance(spec.get("stages"), dict):
            files.update(confined_path(config, stem) for config in spec["stages"].values())
    return plain_roles(nb, stem)


def confined_path(rel: str, stem: str = "") -> str:
    """`rel` (as a chapter cell names it, `configs/...` or `benchmarks/...`) checked to stay inside the repository's
    `configs/` or `benchmarks/` once resolved (no `..` out of them, no symbolic link leading elsewhere); a path
    that escapes is an error naming the chapter, so an assignment copies only what it may."""
    resolved = (ROOT / rel).resolve()
    allowed = [(ROOT / top).resolve() for top in ("configs", "benchmarks")]
    if not any(resolved == a or a in resolved.parents for a in allowed):
        raise SystemExit(f"{stem or 'a chapter'}: the path {rel!r} leads outside configs/ and benchmarks/ "
                         f"(to {resolved}); an assignment copies only files from those folders")
    return rel


def _copy_confined(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Copy a file or folder of `configs/` or `benchmarks/`; a symbolic link inside is refused, never followed."""
    if src.is_symlink():
        raise SystemExit(f"{src.relative_to(ROOT)} is a symbolic link: an assignment copies no links")
    if src.is_dir():
        links = [p for p in src.rglob("*") if p.is_symlink()]
        if links:
            raise SystemExit(f"{links[0].relative_to(ROOT)} is a symbolic link: an assignment copies no links")
        shutil.copytree(src, dst, dirs_exist_ok=True, symlinks=True)
    else:
        shutil.copy(src, dst)


def nbgrader(*args: str, root: pathlib.Path = COURSE) -> None:
    """Run an nbgrader command on the course at `root` (nbgrader_config.py at the top level sets the rest)."""
    cmd = [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={root}", "--log-level=WARN"]
    # nbgrader runs `alembic` (the gradebook's migrations) from PATH: the virtualenv's bin must be on it
    path = os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ.get("PATH", "")])
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, **QUIET_ENV, "PATH": path})


def cmd_assignments(names: list[str] | None, root: pathlib.Path = COURSE) -> list[str]:
    """course/source/<chapter>/ from the stored notebooks, then `nbgrader generate_assignment` into course/release/."""
    import nbformat

    built = []
    for md in chapter_paths(names, problems=True):
        stem, files = md.stem, set()
        nb = student_source(nbformat.read(notebook_path(md), as_version=4), stem, files)
        folder = root / "source" / stem
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / f"{stem}.ipynb")
        for rel in sorted(files):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            _copy_confined(ROOT / confined_path(rel, stem), folder / rel)  # a file, or a run's folder (chapter 13)
        nbgrader("generate_assignment", stem, "--force", root=root)
        built.append(stem)
        print(f"{(root / 'release' / stem).relative_to(root.parent)}/: released"
              f"{f' with {len(files)} file(s)' if files else ''}")
    return built


# --- the learner edition: exercises as stubs, the results that give nothing away kept -----------------------------


def _statement_names(source: str) -> list[tuple[set[str], set[str], set[str], set[str], str]] | None:
    """Each top-level statement of a code cell as (the notebook's names it reads, the names and attributes it reads
    other than as the function it calls, names it binds, names it may change in place, its kind: "import", "def"
    for a function or class, or ""); None when the cell is not plain Python.

    Reads follow Python's scopes: a function's parameters and locals, a lambda's parameters and a comprehension's
    variables are not the notebook's names, nor is a `for` loop's variable in its body. `show(f)`, `timed(f)` and
    `g = f` read `f` as a value, `f(x)` does not; `gguf_blocks.dequantize_q4_1` reads `dequantize_q4_1` as a
    value. An import is one statement per alias, which reads the imported name (not as a value) and binds the
    alias. Binds are assignment, loop and `with` targets and top-level `def`/`class` names. Changed in place: the
    object a subscript or attribute is assigned into (`runs[k] = …`) and the receiver of a method called as a
    statement (`rows.append(…)`, `ax.bar(…)`)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    comprehensions = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)

    def stored(nodes) -> set[str]:
        return {n.id for node in nodes for n in ast.walk(node)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

    def named(node, local: frozenset):  # (node, name) for each Name the notebook's scope provides, and each attribute
        if isinstance(node, scopes):
            args = node.args
            params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}
            body = node.body if isinstance(node.body, list) else [node.body]
            for outside in [*args.defaults, *filter(None, args.kw_defaults), *getattr(node, "decorator_list", [])]:
                yield from named(outside, local)
            inner = local | params | stored(body)
            for part in body:
                yield from named(part, inner)
        elif isinstance(node, comprehensions):  # the first iterable is evaluated outside, the rest inside
            inner = local | stored(g.target for g in node.generators)
            for i, generator in enumerate(node.generators):
                yield from named(generator.iter, local if i == 0 else inner)
                for condition in generator.ifs:
                    yield from named(condition, inner)
            for part in ([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]):
                yield from named(part, inner)
        elif isinstance(node, (ast.For, ast.AsyncFor)):  # the loop variable is bound before the body reads it
            yield from named(node.iter, local)
            for part in [*node.body, *node.orelse]:
                yield from named(part, local | stored([node.target]))
        else:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
                yield node, node.id
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id not in local:
                yield node.target, node.target.id  # `total += x` reads `total` too
            elif isinstance(node, ast.Attribute):
                yield node, node.attr
            for child in ast.iter_child_nodes(node):
                yield from named(child, local)

    def root(node):
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return node.id if isinstance(node, ast.Name) else None

    def own(node):  # the statement's own nodes: not inside the functions, lambdas and classes it defines
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (*scopes, ast.ClassDef, *comprehensions)):
                yield child
            else:
                yield from own(child)

    statements = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            statements += [({a.name.rpartition(".")[2]}, set(), {(a.asname or a.name).split(".")[0]}, set(), "import")
                           for a in stmt.names]
            continue
        found = list(named(stmt, frozenset()))
        called = {id(n.func) for n in ast.walk(stmt) if isinstance(n, ast.Call)}
        reads = {name for n, name in found if isinstance(n, ast.Name)}
        values = {name for n, name in found if id(n) not in called}
        binds, changed = set(), set()
        definition = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        for node in ([stmt] if definition else own(stmt)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                binds.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                binds.add(node.id)
            elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                changed.add(root(node))
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                    and isinstance(node.value.func, ast.Attribute):
                changed.add(root(node.value.func))
        statements.append((reads, values, binds, changed - {None}, "def" if definition else ""))
    return statements


def _answer_lines(hidden: set[str]) -> set[str]:
    """The code lines (20 characters or more, docstring and comments left out) of the package functions the
    chapter's checkers withhold: text that must not appear in an output the learner edition keeps."""
    from marlhf_edu.teaching import exercises

    paths = {p for obj in vars(exercises).values() for p in getattr(obj, "withholds", ())
             if p.rpartition(".")[2] in hidden}
    lines = set()
    for path in paths:
        source = textwrap.dedent(inspect.getsource(exercises._resolve(path)))
        body = ast.parse(source).body[0].body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring: prose a chapter may quote
        for stmt in body:
            lines.update(l.strip() for l in ast.get_source_segment(source, stmt).splitlines()
                         if len(l.strip()) >= 20 and not l.strip().startswith("#"))
    return lines


def _output_text(outputs) -> str:
    parts = []
    for out in outputs:
        parts.append(out.get("text", "") if isinstance(out.get("text", ""), str) else "".join(out["text"]))
        for value in out.get("data", {}).values():
            parts.append(value if isinstance(value, str) else json.dumps(value))
    return "\n".join(parts)


def exercise_references() -> set[str]:
    """The answers `marlhf_edu.teaching.exercises` holds for its checkers to compare with (`gae_with_bootstrap_reference`):
    its public functions defined in `marlhf_edu.teaching` (the checker modules, not the package's math it compares
    with) other than the checkers (`check_…`) and the grading API (`case`, `grade`, `withheld`). A chapter that
    imports one to show what the exercise computes computes from the solution."""
    from marlhf_edu.teaching import exercises

    teaching = exercises.__name__.rpartition(".")[0] + "."
    return {name for name, obj in vars(exercises).items() if inspect.isfunction(obj)
            and obj.__module__.startswith(teaching) and not name.startswith(("_", "check_"))
            and name not in {"case", "grade", "withheld"}}


def kept_outputs(nb) -> set[str]:
    """Ids of the instructor notebook's code cells whose stored outputs the learner edition keeps: the results a
    learner reads before running anything (the stored records a chapter reads, its settings, a listing of the
    package's code, a demonstration of the package at work), never an answer.

    The rule, from the chapter's own structure, read in execution order. Tainted from the start are the references
    the checkers compare with (`exercise_references`); the learner's code is every name a solution or graded cell
    binds (the learner's function, the checks), tainted from there on. A statement is tainted when it reads a
    tainted name (through the functions it calls that the notebook defines, too), or reads a withheld function
    (`withheld_names`: the package's answers) as a value rather than calling it (`show(f)`, `timed(f)`, `g = f`);
    what a tainted statement binds or changes in place is tainted, what a clean one binds is clean again. A code
    cell keeps its outputs when it is neither a solution nor a graded cell, parses as Python, none of its
    statements is tainted, and its outputs contain no code line of a withheld function (`_answer_lines`, a net
    under the rule). A cell that calls a withheld function keeps its result: the student copy keeps such
    demonstrations (only the listing goes, `student_source`), and running the cell prints the same. So a cell that
    shows an answer, runs or checks the learner's code, or prints something computed from it, is blank until the
    learner runs it."""
    hidden = withheld_names(nb)
    answers = _answer_lines(hidden)
    tainted = exercise_references()
    defined: dict[str, set[str]] = {}  # a function or class the notebook defines -> the names its body reads
    imported: set[str] = set()  # modules such as `plt` and package functions: not changed in place by a call
    kept = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        grading = cell.metadata.get("nbgrader", {})
        graded = bool(grading.get("solution") or grading.get("grade"))
        statements = _statement_names(cell.source)
        clean = statements is not None and not graded
        if statements is None:  # not Python: every word it holds counts as read, as a value, and as bound
            words = set(re.findall(r"[A-Za-z_]\w*", cell.source))
            statements = [(words, words, words, set(), "")]
        for reads, values, binds, changed, kind in statements:
            seen, todo = set(), set(reads)
            while todo:  # what the notebook's own functions that this statement names read, at the time of the call
                name = todo.pop()
                seen.add(name)
                todo |= defined.get(name, set()) - seen
            if kind == "import":
                imported |= binds
                if reads & hidden:  # `from marlhf_edu import gae_advantages as gae`
                    hidden |= binds
            if graded or seen & tainted or values & hidden:
                tainted |= binds | (changed - imported)
                clean = False
            else:
                tainted -= binds
            for name in binds:
                if kind == "def":
                    defined[name] = reads
                else:
                    defined.pop(name, None)
        if clean and cell.get("outputs") and not any(line in _output_text(cell.outputs) for line in answers):
            kept.add(cell.id)
    return kept


def learner_copy(nb, stem: str):
    """The learner edition of an instructor notebook: what nbgrader releases to students, built without a course.
    The answers' `show()` cells go (as for an assignment), nbgrader's own preprocessors replace each solution with
    its stub, drop the hidden tests and the model answers, and clear the outputs; the outputs `kept_outputs` allows
    (results that give no answer away) are put back, so the chapter reads as the book does before the learner runs
    a cell. Paths stay as in notebooks/, so a copy runs from learner/ as the instructor copy does from notebooks/.
    The kernelspec is the one ipykernel installs ("Python 3 (ipykernel)"), what JupyterLab writes on saving."""
    from ipykernel.kernelspec import get_kernel_dict
    from nbgrader.preprocessors import ClearHiddenTests, ClearMarkScheme, ClearOutput, ClearSolutions

    kept = kept_outputs(nb)
    stored = {cell.id: (cell.outputs, cell.execution_count) for cell in nb.cells if cell.id in kept}
    nb, resources = student_source(nb, stem, set(), local_paths=False), {}
    for step in (ClearSolutions(), ClearHiddenTests(), ClearMarkScheme(), ClearOutput()):
        nb, resources = step.preprocess(nb, resources)
    for i, cell in enumerate(nb.cells):
        if cell.get("id") in stored:
            cell.outputs, cell.execution_count = stored[cell.id]
        elif not re.fullmatch(r"c\d{3}", cell.get("id", "")):  # a note `student_source` added: an id that
            cell["id"] = f"n{i:03d}"  # stays the same from build to build, as the chapter's own cells' ids do
    nb.metadata.pop("jupytext", None)  # not paired with chapters/: saving it must never write a chapter
    kernel = get_kernel_dict()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": kernel["display_name"],
                                 "language": kernel["language"]}
    return nb


def learner_server_config(config_dir: pathlib.Path) -> pathlib.Path:
    """A Jupyter configuration directory whose JupyterLab hides nbgrader (its menu, Validate button and panels,
    and the server extensions behind them): the learner's JupyterLab. `make teach` runs without it. Run as root
    (a container), the server refuses to start unless allowed: this configuration allows it there."""
    (config_dir / "labconfig").mkdir(parents=True, exist_ok=True)
    (config_dir / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyter/nbgrader": True}}, indent=1) + "\n")
    server = {f"nbgrader.server_extensions.{name}": False
              for name in ("formgrader", "validate_assignment", "assignment_list", "course_list")}
    settings = {"jpserver_extensions": server}
    if getattr(os, "geteuid", lambda: -1)() == 0:  # `jupyter lab --allow-root`
        settings["allow_root"] = True
    (config_dir / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": settings}, indent=1) + "\n")
    return config_dir


def _cells_as_edited(text: str) -> list[tuple[str, str]] | None:
    """What a learner edits in a notebook (JSON text): each cell's type and source; None when it is no notebook."""
    try:
        cells = json.loads(text)["cells"]
        return [(c["cell_type"], c["source"] if isinstance(c["source"], str) else "".join(c["source"])) for c in cells]
    except (ValueError, KeyError, TypeError):
        return None


def learner_edited(target: pathlib.Path, stamp: pathlib.Path) -> bool:
    """Whether the learner has edited a learner-edition notebook: its cells (types and sources) differ from those of
    the copy the build wrote, `stamp`. Outputs, execution counts and metadata do not count: JupyterLab rewrites the
    kernelspec and language_info of a notebook it opens, and running a cell is not editing it. A copy without a
    stamp, or one that no longer reads as a notebook, counts as edited (it is never overwritten)."""
    if not stamp.exists():
        return True
    mine = _cells_as_edited(target.read_text())
    return mine is None or mine != _cells_as_edited(stamp.read_text())


def cmd_learner(names: list[str] | None, out: pathlib.Path = LEARNER) -> list[pathlib.Path]:
    """learner/ (mirroring notebooks/) from the stored notebooks: the learner edition. Rebuilt from the instructor
    copies each time; a copy whose cells the learner has edited (`learner_edited`) is never overwritten: it is
    kept, with a line that names it and says how to get the book's copy."""
    import nbformat

    shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    written, kept = [], []
    for md in chapter_paths(names, problems=True):
        target = out / notebook_path(md).relative_to(NOTEBOOKS)
        nb = learner_copy(nbformat.read(notebook_path(md), as_version=4), md.stem)
        text = nbformat.writes(nb) + "\n"
        stamp = target.with_name(f".{target.stem}.built")
        if target.exists() and learner_edited(target, stamp):
            changed = stamp.exists() and _cells_as_edited(stamp.read_text()) != _cells_as_edited(text)
            mine = next(p for n in range(1, 1000) if not (p := target.with_name(
                f"{target.stem}.mine{n if n > 1 else ''}.ipynb")).exists())  # never a name that holds earlier work
            kept.append(f"{shown / target.relative_to(out)}: kept, you have edited it"
                        + ("; the book's copy has changed since" if changed else "")
                        + f". To get the book's copy, rename yours (mv {shown / target.relative_to(out)} "
                        f"{shown / mine.relative_to(out)}) or delete it, and run `make lab` again")
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        stamp.write_text(text)
        written.append(target)
    learner_server_config(out / ".jupyter")
    # jupytext reads the nearest jupytext.toml: the repository's pairs notebooks/ with chapters/, this one pairs nothing
    (out / "jupytext.toml").write_text("# the learner edition: plain notebooks, paired with nothing\nformats = \"ipynb\"\n")
    print(f"{shown}/: {len(written)} notebook(s) written" + (f", {len(kept)} kept:" if kept else ""))
    for line in kept:
        print(f"  {line}")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    nbp = sub.add_parser("notebooks")
    nbp.add_argument("names", nargs="*")
    site = sub.add_parser("site")
    site.add_argument("--execute", action="store_true", help="execute every chapter afresh before building")
    sub.add_parser("status")
    sub.add_parser("times")
    grading = sub.add_parser("grading")
    grading.add_argument("names", nargs="*")
    assignments = sub.add_parser("assignments")
    assignments.add_argument("names", nargs="*")
    learner = sub.add_parser("learner")
    learner.add_argument("names", nargs="*")
    args = parser.parse_args()
    if args.cmd == "notebooks":
        cmd_notebooks(args.names)
    elif args.cmd == "grading":
        cmd_grading(args.names)
    elif args.cmd == "assignments":
        cmd_assignments(args.names)
    elif args.cmd == "learner":
        cmd_learner(args.names)
    elif args.cmd == "site":
        cmd_site(args.execute)
    elif args.cmd == "times":
        cmd_times()
    else:
        problems = out_of_sync()
        print("\n".join(problems) if problems else "all chapter pairs in sync and executed")
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
