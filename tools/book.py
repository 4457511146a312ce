"""Execute the chapters and build the book's site.

  python tools/book.py notebooks [NAME ...]   re-generate notebooks/ from chapters/ and execute them in place
  python tools/book.py site                   build the site into build/site/ from the stored outputs
  python tools/book.py site --execute         execute every chapter into build/executed/ first, build from those
  python tools/book.py status                 list chapter pairs that are out of sync or unexecuted

The site is Sphinx + myst-nb + sphinx-book-theme (`site/conf.py`), with MathJax installed from the npm
registry (`site/package.json`, `site/package-lock.json`) and served locally. `site` never writes to
notebooks/; `notebooks` is the only command that rewrites stored outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
NOTEBOOKS = ROOT / "notebooks"
BUILD = ROOT / "build"
SITE = ROOT / "site"
# the parts of MathJax's es5 distribution that TeX input with CHTML output loads
MATHJAX_PARTS = ["tex-chtml.js", "input", "output", "ui", "a11y", "adaptors", "sre"]

# What every kernel that executes a chapter sees (nbval's kernel gets the same from the Makefile).
QUIET_ENV = {
    "TQDM_DISABLE": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
}


def chapter_paths(names: list[str] | None = None) -> list[pathlib.Path]:
    paths = sorted(CHAPTERS.glob("[0-9][0-9]_*.md"))
    if names:
        wanted = {n.removesuffix(".md").removesuffix(".ipynb") for n in names}
        paths = [p for p in paths if p.stem in wanted or p.stem[:2] in wanted]
        if not paths:
            sys.exit(f"no chapter matches {sorted(wanted)}")
    return paths


def read_chapter(md: pathlib.Path):
    import jupytext

    nb = jupytext.read(md)
    # stable cell ids, so re-executing an unchanged chapter leaves an unchanged notebook
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"c{i:03d}"
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["jupytext"] = {"formats": "notebooks///ipynb,chapters///md:myst"}
    return nb


def execute(nb, timeout: int = 900):
    from nbclient import NotebookClient

    os.environ.update(QUIET_ENV)
    # the kernel listens on loopback only; ipykernel's notice that such TCP is unencrypted is not for
    # readers of the build log, so its own log stops at errors
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.perf_counter()
    client.execute()
    return time.perf_counter() - start


def execute_chapters(out_dir: pathlib.Path, names: list[str] | None = None) -> dict[str, float]:
    """Execute chapters (all, or `names`) from chapters/ into `out_dir`; returns seconds per chapter."""
    import nbformat

    timings = {}
    for md in chapter_paths(names):
        nb = read_chapter(md)
        timings[md.stem] = round(execute(nb), 1)
        out = out_dir / f"{md.stem}.ipynb"
        nbformat.write(nb, out)
        print(f"{out.relative_to(ROOT)}: executed in {timings[md.stem]:.1f} s")
    return timings


def cmd_notebooks(names: list[str] | None) -> None:
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
    """build/site-src/: the Sphinx sources of site/ plus the executed notebooks under chapters/."""
    src = BUILD / "site-src"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(SITE, src, ignore=shutil.ignore_patterns("package*.json", "__pycache__"))
    (src / "chapters").mkdir()
    for md in chapter_paths():
        shutil.copy(notebooks / f"{md.stem}.ipynb", src / "chapters" / f"{md.stem}.ipynb")
    if os.environ.get("MARLHF_MATHJAX_CDN") != "1":
        install_mathjax(src / "_static")
    return src


def execute_all() -> pathlib.Path:
    """Execute every chapter afresh into build/executed/ (stored outputs in notebooks/ stay untouched)."""
    out = BUILD / "executed"
    out.mkdir(parents=True, exist_ok=True)
    timings = execute_chapters(out)
    timings["total"] = round(sum(timings.values()), 1)
    (out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    print(f"{len(timings) - 1} chapters executed in {timings['total']:.1f} s")
    return out


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
    """Problems with chapter/notebook pairs: missing partner, differing cells, unexecuted code cells."""
    import jupytext

    problems = []
    md_stems = {p.stem for p in CHAPTERS.glob("*.md")}
    nb_stems = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    problems += [f"chapters/{s}.md has no notebooks/{s}.ipynb" for s in sorted(md_stems - nb_stems)]
    problems += [f"notebooks/{s}.ipynb has no chapters/{s}.md" for s in sorted(nb_stems - md_stems)]
    for stem in sorted(md_stems & nb_stems):
        source = jupytext.read(CHAPTERS / f"{stem}.md")
        stored = jupytext.read(NOTEBOOKS / f"{stem}.ipynb")
        a = [(c.cell_type, c.source.strip()) for c in source.cells]
        b = [(c.cell_type, c.source.strip()) for c in stored.cells]
        if a != b:
            diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            problems.append(f"{stem}: chapter and notebook differ from cell {diff} on "
                            f"(run `make notebooks` or sync with jupytext)")
        for i, c in enumerate(stored.cells):
            if c.cell_type == "code" and c.source.strip() and c.get("execution_count") is None:
                problems.append(f"notebooks/{stem}.ipynb: code cell {i} has no stored execution")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    nbp = sub.add_parser("notebooks")
    nbp.add_argument("names", nargs="*")
    site = sub.add_parser("site")
    site.add_argument("--execute", action="store_true", help="execute every chapter afresh before building")
    sub.add_parser("status")
    args = parser.parse_args()
    if args.cmd == "notebooks":
        cmd_notebooks(args.names)
    elif args.cmd == "site":
        cmd_site(args.execute)
    else:
        problems = out_of_sync()
        print("\n".join(problems) if problems else "all chapter pairs in sync and executed")
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
