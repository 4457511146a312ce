"""Execute and render the book.

  python tools/book.py notebooks [NAME ...]   re-generate notebooks/ from chapters/ and execute them in place
  python tools/book.py build                  execute every chapter into build/ and render HTML + index
  python tools/book.py status                 list chapter pairs that are out of sync or unexecuted

`build` never writes to notebooks/; `notebooks` is the only command that rewrites stored outputs.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
NOTEBOOKS = ROOT / "notebooks"
BUILD = ROOT / "build"

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
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.perf_counter()
    client.execute()
    return time.perf_counter() - start


def cmd_notebooks(names: list[str] | None) -> None:
    import nbformat

    for md in chapter_paths(names):
        nb = read_chapter(md)
        seconds = execute(nb)
        out = NOTEBOOKS / f"{md.stem}.ipynb"
        nbformat.write(nb, out)
        print(f"{out.relative_to(ROOT)}: executed in {seconds:.1f} s")


def cmd_build() -> None:
    import nbformat
    from nbconvert import HTMLExporter

    BUILD.mkdir(exist_ok=True)
    exporter = HTMLExporter()
    rows, timings = [], {}
    total = 0.0
    for md in chapter_paths():
        nb = read_chapter(md)
        seconds = execute(nb)
        total += seconds
        timings[md.stem] = round(seconds, 1)
        nbformat.write(nb, BUILD / f"{md.stem}.ipynb")
        body, _ = exporter.from_notebook_node(nb)
        (BUILD / f"{md.stem}.html").write_text(body, encoding="utf-8")
        title = next((c.source.lstrip("# ").splitlines()[0] for c in nb.cells
                      if c.cell_type == "markdown" and c.source.startswith("# ")), md.stem)
        rows.append(f'<li><a href="{md.stem}.html">{html.escape(title)}</a> <small>({seconds:.1f} s)</small></li>')
        print(f"build/{md.stem}.html ({seconds:.1f} s)")
    timings["total"] = round(total, 1)
    (BUILD / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    (BUILD / "index.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>marlhf-edu</title>"
        "<h1>marlhf-edu: RLHF with PPO and multi-adapter PPO</h1><ol>" + "".join(rows) + "</ol>"
        f"<p>Executed in {total:.0f} s.</p>\n", encoding="utf-8")
    print(f"build/index.html — {len(rows)} chapters executed in {total:.1f} s")


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
    sub.add_parser("build")
    sub.add_parser("status")
    args = parser.parse_args()
    if args.cmd == "notebooks":
        cmd_notebooks(args.names)
    elif args.cmd == "build":
        cmd_build()
    else:
        problems = out_of_sync()
        print("\n".join(problems) if problems else "all chapter pairs in sync and executed")
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
