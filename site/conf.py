"""Sphinx configuration of the book's site (`make book`; staged and built by `tools/book.py site`).

The chapters are rendered from the executed notebooks in `notebooks/`, never re-executed here: nbval already
regresses those outputs. MathJax comes from the npm registry (`site/package.json`) and is served from the
site itself, so equations render without internet.
"""

from __future__ import annotations

import os
import re

import marlhf_edu
from docutils import nodes
from sphinx.transforms import SphinxTransform

project = "marlhf-edu"
author = "the marlhf-edu authors"
copyright = "the marlhf-edu authors, Apache-2.0"
release = version = marlhf_edu.__version__

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.mathjax", "sphinx.ext.viewcode"]
# _readme_*.md: the README's parts that the front page includes (tools/book.py readme_parts), not pages of their own
exclude_patterns = ["_build", "node_modules", "**.ipynb_checkpoints", "_readme_*.md"]

# --- notebooks: stored outputs only, MyST math ---------------------------------------------------------
nb_execution_mode = "off"
nb_merge_streams = True
# Markdown outputs (marlhf_edu.teaching.book.Table, show()) read as GitHub Markdown, which has tables; CommonMark has none
nb_render_markdown_format = "gfm"
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
numfig = True  # numbered figures and equations, referenced with {numref} and {eq}
math_numfig = True
math_eqref_format = "({number})"
numfig_format = {"figure": "Figure %s"}

# --- MathJax: a local copy unless MARLHF_MATHJAX_CDN=1 ----------------------------------------------
if os.environ.get("MARLHF_MATHJAX_CDN") != "1":
    mathjax_path = "mathjax/tex-chtml.js"
mathjax3_config = {"tex": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]]}}

# --- API reference from the docstrings ---------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
default_role = "literal"  # docstrings write `name` for code

CHAPTERS = {}  # "05" -> "chapters/05_gae", filled from the staged source directory
_here = os.path.dirname(os.path.abspath(__file__))
for _name in sorted(os.listdir(os.path.join(_here, "chapters"))) if os.path.isdir(os.path.join(_here, "chapters")) else []:
    if re.match(r"\d\d_.*\.ipynb$", _name):
        CHAPTERS[_name[:2]] = "chapters/" + _name.removesuffix(".ipynb")

_CHAPTER_RE = re.compile(r"\b([Cc]hapters?) (\d\d)\b(?: \(`chapters/\d\d_\w+\.md`\))?")


def link_chapters(app, what, name, obj, options, lines):
    """'Taught in chapter 05' in a docstring becomes a link to chapter 05."""
    for i, line in enumerate(lines):
        lines[i] = _CHAPTER_RE.sub(
            lambda m: f":doc:`{m.group(1)} {m.group(2)} </{CHAPTERS[m.group(2)]}>`" if m.group(2) in CHAPTERS else m.group(0),
            line)


def number_per_chapter(app, env):
    """Figures, tables and equations numbered per chapter, as d2l does: chapter 5's first equation is (5.1) and
    its first figure Figure 5.1. Sphinx numbers them across the whole book unless the toctree numbers its
    sections (which would make chapter 00 number 1); this runs after its numbering and renumbers each chapter's
    own, in the order Sphinx found them. References ({eq}, {numref}) read the same numbers."""
    changed = []
    for docname, kinds in env.toc_fignumbers.items():
        match = re.match(r"chapters/(\d\d)_", docname)
        if not match:
            continue
        for kind, numbers in kinds.items():
            for k, node_id in enumerate(sorted(numbers, key=numbers.get), start=1):
                numbers[node_id] = (int(match.group(1)), k)
        changed.append(docname)
    return changed


def field_help(app, what, name, obj, options, lines):
    """A configuration dataclass (YAML keys, `--key value` overrides) describes every field in its parameter list:
    the field's `help` (its metadata, which the command line shows too), beside the type autodoc adds. A field
    without help says so, which `tests/test_site.py` refuses."""
    import dataclasses

    if what != "class" or not dataclasses.is_dataclass(obj):
        return
    fields = dataclasses.fields(obj)
    if not any(f.metadata.get("help") for f in fields):  # a record (a rollout, a report), not a configuration
        return
    lines.append("")
    for f in fields:
        text = f.metadata.get("help") or "NO HELP WRITTEN"
        # literal text: a help's `*` or backquotes are not reStructuredText markup
        text = text.replace("\\", "\\\\").replace("*", "\\*").replace("`", "\\`").replace("|", "\\|")
        lines.append(f":param {f.name}: {text}")


class OutputsAsPrinted(SphinxTransform):
    """Cell outputs show what the code printed: Sphinx's smart quotes leave them alone, so a model's answer quoted
    in a table ("I'm sorry for") keeps its straight quotes. Prose keeps typographic quotes."""

    default_priority = 700  # before SphinxSmartQuotes (750)

    def apply(self, **kwargs):
        for node in self.document.findall(nodes.container):
            if "cell_output" in node.get("classes", []):
                node["support_smartquotes"] = False


#: Characters of a monospace line that fit the text column at 1280 px (site/_static/marlhf.css: a 1024 px article
#: with code at 0.78rem holds 127; tests/test_site.py measures it).
OUTPUT_COLUMN = 126
#: A line of an aligned text table: two or more spaces between printed fields ("weights       13.91 GiB").
ALIGNED_ROW = re.compile(r"\S {2,}\S")


class AlignedOutputs(SphinxTransform):
    """An output that prints an aligned table with rows wider than the text column scrolls sideways instead of
    wrapping (class `marlhf-aligned`, site/_static/marlhf.css): wrapped, its rows would break apart mid-column.
    Every other output wraps its lines that do not fit (a checker's FAIL line, a long sentence); lines that fit,
    such as chapter 10's memory table under its long preamble, are never wrapped."""

    default_priority = 700

    def apply(self, **kwargs):
        for node in self.document.findall(nodes.literal_block):
            parent = node.parent
            if not (isinstance(parent, nodes.container) and "cell_output" in parent.get("classes", [])):
                continue
            if any(len(line) > OUTPUT_COLUMN and ALIGNED_ROW.search(line.strip())
                   for line in node.astext().splitlines()):
                node["classes"].append("marlhf-aligned")


def setup(app):
    app.add_transform(OutputsAsPrinted)
    app.add_transform(AlignedOutputs)
    app.connect("autodoc-process-docstring", link_chapters)
    app.connect("autodoc-process-docstring", field_help)
    app.connect("env-get-updated", number_per_chapter, priority=900)  # after Sphinx's own numbering (500)
    # MathJax on every page, not only on pages with equations: the navigation shows chapter 2's title,
    # which has math, on the search and index pages too
    app.set_html_assets_policy("always")
    app.add_css_file("marlhf.css")
    app.add_js_file("marlhf.js")  # the article header's outline button opens the outline (marlhf.js says why)


# --- theme --------------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "marlhf-edu: RLHF with PPO and multi-adapter PPO"
html_static_path = ["_static"]
html_last_updated_fmt = None
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": True,
    "show_navbar_depth": 1,
    "use_download_button": True,
    "home_page_in_toc": True,
}
html_show_sourcelink = False
#: The book's public repository. The project has none yet; once it has, set it here (or in the environment for
#: one build) and every page gets the theme's repository and issue buttons, next to the download button.
REPOSITORY_URL = os.environ.get("MARLHF_EDU_REPOSITORY_URL", "")
if REPOSITORY_URL:
    html_theme_options.update(repository_url=REPOSITORY_URL, repository_branch="main",
                              use_repository_button=True, use_issues_button=True)
