"""The book's site, built as `make book` builds it and opened in headless Chromium.

Checks what a reader would see: equations rendered by MathJax (no raw LaTeX outside code), every internal
link and anchor resolving, figures loaded, search finding the GAE chapter, navigation between chapters, code
and aligned text tables fitting the column at 1280 px, the problem sets as pages with their fixes folded, and
the README's pipeline figure and reading path on the front page. One screenshot per checked page lands in
build/site-check/ so a person can look.

Needs Chromium (`apt-get install chromium`; CI's `.ci/run` installs it). Without it the browser checks are
skipped on a developer machine and fail under CI (`CI` set).
"""

from __future__ import annotations

import functools
import http.server
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SITE = ROOT / "build" / "site"
SHOTS = ROOT / "build" / "site-check"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# as the machine notes say: no background networking on a closed network, a fresh profile, no sandbox as root
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# LaTeX that MathJax should have consumed: display/inline delimiters, or a control word such as \delta
RAW_LATEX = re.compile(r"\$\$|\\\(|\\\)|\\\[|\\\]|\\[A-Za-z]{2,}")
# the visible text of a page without code, where LaTeX may legitimately appear (docstrings, listings)
VISIBLE_PROSE = """() => {
  const body = document.querySelector('article') || document.body;
  const copy = body.cloneNode(true);
  copy.querySelectorAll('pre, code, script, style, mjx-container, .highlight').forEach(e => e.remove());
  return copy.innerText;
}"""


PROBLEM_SETS = sorted(p.stem for p in (ROOT / "chapters" / "problems").glob("*.md"))


def toctree(caption: str) -> list[str]:
    """The documents the front page's table of contents lists under `caption`."""
    toc = re.search(rf"```\{{toctree\}}\n:maxdepth: 1\n:caption: {caption}\n\n(.*?)```",
                    (ROOT / "site" / "index.md").read_text(), re.S)
    return toc.group(1).split() if toc else []


def test_toc_lists_every_chapter_and_problem_set_in_order():
    assert toctree("Chapters") == [f"chapters/{p.stem}" for p in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md"))]
    assert len(PROBLEM_SETS) == 3 and toctree("Problem sets") == [f"problems/{stem}" for stem in PROBLEM_SETS]


def test_the_front_page_takes_the_readme_reading_path_with_site_links(tmp_path, monkeypatch):
    """tools/book.py readme_parts: the README's figure is referenced where it lies, and each link of its reading path
    names the site's page (a chapter's or problem set's notebook, a page of site/); a link the site has no page for
    stops the build instead of leaving a dead link."""
    sys.path.insert(0, str(ROOT / "tools"))
    import book

    src = ROOT / "build" / "site-src"
    parts = book.readme_parts(src)
    image = re.fullmatch(r"!\[[^\]]+\]\(([^)]+)\)\n", parts["_readme_figure.md"]).group(1)
    assert (src / image).resolve() == ROOT / "docs" / "figures" / "pipeline.png"
    path = parts["_readme_reading_path.md"]
    links = re.findall(r"\]\(([^)]+)\)", path)
    chapters = [f"chapters/{p.stem}.ipynb" for p in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md"))]
    assert links == ["benchmarks.md", *chapters, *(f"problems/{stem}.ipynb" for stem in PROBLEM_SETS)]
    assert "| **The math** |" in path and "Three problem sets" in path and "## " not in path
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text().replace("(chapters/05_gae.md)", "(notes/05.md)"))
    monkeypatch.setattr(book, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match="notes/05.md"):
        book.readme_parts(src)


@pytest.fixture(scope="module")
def site():
    """Build the site from the stored outputs (as `make book` does) and serve it on localhost."""
    subprocess.run([sys.executable, str(ROOT / "tools" / "book.py"), "site"], check=True, cwd=ROOT)
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


API_PAGES = [f"api/{p.stem}.html" for p in sorted((ROOT / "site" / "api").glob("*.md"))]


@pytest.mark.slow
def test_site_pages_exist(site):
    for name in ["index.html", "search.html", "api.html", "chapters/05_gae.html", "_static/mathjax/tex-chtml.js"]:
        assert (SITE / name).exists(), name
    # the API reference is one page per part, and every configuration field is described (site/conf.py)
    assert len(API_PAGES) >= 6 and all((SITE / name).exists() for name in API_PAGES)
    assert not [name for name in API_PAGES if "NO HELP WRITTEN" in (SITE / name).read_text()]
    engine, stages = ((SITE / "api" / f"{n}.html").read_text() for n in ("engine", "stages"))
    # PPOConfig's fields, each with its help in the class's parameter list, as every command's arguments
    assert re.search(r"<strong>cliprange</strong>.{0,400}ε of the clipped policy objective", engine, re.S)
    assert len(re.findall(r"<strong>\w+</strong> \(<em>", stages)) >= 80
    # MathJax is served by the site itself unless a CDN was asked for
    html = (SITE / "chapters" / "05_gae.html").read_text()
    assert 'src="../_static/mathjax/tex-chtml.js' in html and "cdn.jsdelivr" not in html


@pytest.fixture(scope="module")
def browser(site):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser checks: install Debian's chromium (.ci/run does)")
        pytest.skip("no chromium on this machine (apt-get install chromium); CI runs these checks")
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(url, wait_until="load")
    # MathJax typesets asynchronously after load; its startup promise resolves when the page is done
    page.wait_for_function("() => !window.MathJax || (MathJax.startup && MathJax.startup.promise)")
    page.evaluate("() => window.MathJax ? MathJax.startup.promise : null")
    return page


PAGES = sorted(["index.html", "api.html", "search.html", "genindex.html", "py-modindex.html", *API_PAGES]
               + [f"chapters/{p.stem}.html" for p in (ROOT / "chapters").glob("[0-9][0-9]_*.md")]
               + [f"problems/{stem}.html" for stem in PROBLEM_SETS])


@pytest.mark.parametrize("name", PAGES)
@pytest.mark.slow
def test_no_raw_latex_and_figures_load(browser, site, name):
    page = open_page(browser, site + name)
    prose = page.evaluate(VISIBLE_PROSE)
    raw = [m.group(0) for m in RAW_LATEX.finditer(prose)]
    context = [prose[max(0, m.start() - 40):m.end() + 40] for m in RAW_LATEX.finditer(prose)][:3]
    assert not raw, f"{name}: raw LaTeX in the visible text: {context}"
    broken = page.evaluate("() => [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)")
    assert broken == [], f"{name}: images that did not load: {broken}"
    page.close()


@pytest.mark.parametrize("name", ["index.html", "chapters/05_gae.html", "chapters/06_ppo_losses.html"])
@pytest.mark.slow
def test_math_rendered_and_screenshot(browser, site, name):
    page = open_page(browser, site + name)
    rendered = page.evaluate("() => document.querySelectorAll('mjx-container').length")
    assert rendered > (10 if "chapters" in name else 0), f"{name}: MathJax rendered {rendered} formulas"
    if "chapters" in name:
        # numbered equations and a numbered figure, each linked from the text
        assert page.locator("span.eqno").count() >= 2
        assert page.locator("a.reference[href^='#equation-']").count() >= 2
        chapter = int(name.split("/")[1][:2])
        # numbered per chapter (site/conf.py number_per_chapter): chapter 5's are (5.1) and Figure 5.1
        assert page.locator("span.eqno").first.inner_text().strip() == f"({chapter}.1)"
        caption = re.match(r"Figure (\d+)\.(\d+)", page.locator("figcaption").first.inner_text())
        assert caption and caption.group(1) == str(chapter), "a figure caption numbered in its chapter"
        assert page.locator("a.reference[href^='#fig-']").first.inner_text() == caption.group(0)
    page.screenshot(path=str(SHOTS / (name.replace("/", "_").removesuffix(".html") + ".png")))
    page.close()


@pytest.mark.slow
def test_every_internal_link_resolves(browser, site):
    """Every same-site link on every page answers 200, and every #anchor exists on its target page."""
    ids: dict[str, set[str]] = {}
    problems = []
    page = browser.new_page()
    for name in PAGES:
        page.goto(site + name, wait_until="load")
        links = page.evaluate("() => [...document.querySelectorAll('a[href]')].map(a => a.href)")
        for link in links:
            url, _, fragment = link.partition("#")
            if not url.startswith(site):
                continue  # external (the repository, Sphinx's own credit): not ours to check offline
            if url not in ids:
                response = page.request.get(url)
                if response.status != 200:
                    problems.append(f"{name}: {link} -> {response.status}")
                    ids[url] = set()
                    continue
                ids[url] = set(re.findall(r'\bid="([^"]+)"', response.text()))
            if fragment and urllib.parse.unquote(fragment) not in ids[url]:
                problems.append(f"{name}: {link}: no element with id {fragment!r}")
    page.close()
    assert not problems, "\n".join(sorted(set(problems))[:20])


@pytest.mark.slow
def test_search_finds_the_gae_chapter(browser, site):
    page = browser.new_page()
    page.goto(site + "search.html?q=advantage", wait_until="load")
    # Sphinx lists the hits one by one and ends with a summary line
    page.wait_for_function("() => /Search finished/.test(document.querySelector('#search-results')?.innerText || '')",
                           timeout=30_000)
    hits = page.evaluate("() => [...document.querySelectorAll('#search-results ul.search li a')].map(a => a.getAttribute('href'))")
    assert any("05_gae" in h for h in hits), hits
    page.screenshot(path=str(SHOTS / "search_advantage.png"))
    page.close()


@pytest.mark.slow
def test_previous_next_navigation(browser, site):
    page = open_page(browser, site + "chapters/05_gae.html")
    prev = page.locator("a.left-prev").get_attribute("href")
    nxt = page.locator("a.right-next").get_attribute("href")
    assert prev.endswith("04_policy_gradient.html") and nxt.endswith("06_ppo_losses.html"), (prev, nxt)
    page.close()


# outputs that a reader would have to scroll sideways: wider than the article, or scrolling inside; an aligned table
# with rows wider than the column (site/conf.py AlignedOutputs: `marlhf-aligned`) scrolls by design
TOO_WIDE = """() => {
  const right = (document.querySelector('article.bd-article') || document.querySelector('article')).getBoundingClientRect().right;
  return [...document.querySelectorAll('div.cell_output pre, div.cell_output table, div.cell_output img')]
    .filter(e => !e.closest('.marlhf-aligned'))
    .filter(e => e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().right > right + 1)
    .map(e => (e.innerText || e.getAttribute('src') || '').slice(0, 80).replace(/\\n/g, ' '));
}"""


@pytest.mark.slow
def test_outputs_wrap_to_the_text_column(browser, site):
    """Cell outputs wrap the lines that do not fit (site/_static/marlhf.css); with the theme's defaults 155 output
    blocks of the book scrolled sideways at this width, among them the exercise checkers' FAIL lines. Only an
    aligned table too wide for the column scrolls, and those are few."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    wide, aligned = {}, 0
    for name in PAGES:
        if name.startswith(("chapters/", "problems/")):
            page.goto(site + name, wait_until="load")
            if blocks := page.evaluate(TOO_WIDE):
                wide[name] = blocks[:2]
            aligned += page.locator("div.cell_output .marlhf-aligned").count()
    page.close()
    assert not wide, f"output blocks wider than the text column: {wide}"
    assert aligned <= 6, f"{aligned} outputs scroll sideways as aligned tables"


# Code cells (input) that scroll sideways, and their longest line; the chapters' code is written to about 120
# characters a line, which the column holds at 1280 px (site/_static/marlhf.css)
SCROLLING_CODE = """() => [...document.querySelectorAll('div.cell_input pre')]
  .filter(e => e.scrollWidth > e.clientWidth + 1)
  .map(e => e.textContent.split('\\n').reduce((a, b) => b.length > a.length ? b : a, '').slice(0, 80))"""
# Every row of an aligned text table in an output (a line with two or more spaces between fields) and the screen
# lines it takes: a wrapped row breaks its columns apart
WRAPPED_ROWS = """() => {
  const rows = [], wrapped = [];
  for (const pre of document.querySelectorAll('div.cell_output pre')) {
    if (!pre.getClientRects().length) continue;  // folded
    const walker = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT), texts = [];
    for (let n; (n = walker.nextNode());) texts.push(n);
    const at = offset => { for (const t of texts) { if (offset <= t.data.length) return [t, offset]; offset -= t.data.length; } };
    let start = 0;
    for (const line of texts.map(t => t.data).join('').split('\\n')) {
      if (/\\S {2,}\\S/.test(line.trim())) {
        const range = document.createRange();
        range.setStart(...at(start)); range.setEnd(...at(start + line.length));
        const tops = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
        rows.push(line);
        if (tops.size > 1) wrapped.push(line.slice(0, 80));
      }
      start += line.length + 1;
    }
  }
  return {rows, wrapped};
}"""


@pytest.mark.slow
def test_code_and_aligned_tables_fit_the_column(browser, site):
    """At 1280 px the text column holds the chapters' code (written to about 120 characters a line) and aligned
    text tables unwrapped: with the theme's column (690 px) 89 of the 123 code cells of chapters 10, 13 and 15
    scrolled sideways and chapter 10's `marlhf-edu memory` table broke its fourth column onto lines of its own.
    Prose keeps its own, narrower measure."""
    page = open_page(browser, site + "index.html")
    # the front page's first code block (the make targets) is whole, not cut at the column's edge
    first = page.locator("article pre").first
    assert "make test" in first.inner_text() and first.evaluate("e => e.scrollWidth <= e.clientWidth + 1"), \
        f"the front page's first code block is cut: {first.inner_text()[:200]!r}"
    cells, scrolling, wrapped = 0, {}, {}
    for name in [n for n in PAGES if n.startswith(("chapters/", "problems/"))]:
        page.goto(site + name, wait_until="load")
        rows = page.evaluate(WRAPPED_ROWS)
        if rows["wrapped"]:
            wrapped[name] = rows["wrapped"][:3]
        if name.startswith(("chapters/10", "chapters/13", "chapters/15")):
            cells += page.locator("div.cell_input pre").count()
            scrolling[name] = page.evaluate(SCROLLING_CODE)
        if name.startswith("chapters/10"):
            memory = [r for r in rows["rows"] if r.startswith(("weights ", "= peak ", "÷ four-model "))]
            assert len(memory) == 3 and "0.325" in memory[2], memory
            width = page.evaluate("() => document.querySelector('article p').getBoundingClientRect().width")
            assert width < 0.8 * page.evaluate("() => document.querySelector('div.cell_input pre').clientWidth")
        shown = {"chapters/10": "÷ four-model", "chapters/13": "def paired_changes"}.get(name[:11])
        if shown:  # a person looks: the memory table, and a stretch of chapter 13's longest code
            page.locator("pre", has_text=shown).first.evaluate("e => e.scrollIntoView()")
            page.evaluate("() => window.scrollBy(0, -300)")
            page.screenshot(path=str(SHOTS / (name.replace("/", "_").removesuffix(".html") + "_code.png")))
    page.close()
    assert not wrapped, f"aligned table rows wrapped onto two lines: {wrapped}"
    assert cells >= 90 and sum(map(len, scrolling.values())) <= 0.05 * cells, (cells, scrolling)


@pytest.mark.slow
def test_tables_render_and_outputs_keep_their_quotes(browser, site):
    """A chapter's Table output is an HTML table on the site (site/conf.py reads Markdown outputs as GitHub
    Markdown), and an output shows what the code printed: chapter 13's table of the answers' openings keeps the
    model's straight quotes, where Sphinx's smart quotes would print “I’m an AI” (site/conf.py's
    OutputsAsPrinted). Prose keeps typographic quotes."""
    page = open_page(browser, site + "chapters/13_real_model.html")
    outputs = page.evaluate("() => [...document.querySelectorAll('div.cell_output')].map(e => e.textContent)")
    tables = page.evaluate("() => [...document.querySelectorAll('div.cell_output table')].map(e => e.textContent)")
    prose = page.evaluate(VISIBLE_PROSE)
    page.close()
    assert len(tables) >= 10, len(tables)
    openings = next(t for t in tables if "commonest openings" in t)
    assert "\"I'm an AI\"\u00a03%" in openings or "\"I'm an AI\" 3%" in openings, openings
    assert not [o[:80] for o in outputs if "“" in o or "’" in o]
    assert "“I’m sorry for any confusion" in prose  # the prose quoting an answer


@pytest.mark.slow
def test_answers_are_folded_and_closed(browser, site):
    """The site shows the instructor copies with every answer folded (tools/book.py fold_answers): each model
    answer in a closed <details>, the exercise's solution source behind myst-nb's closed toggle."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "05_gae.ipynb", 4)
    answers = sum(c.cell_type == "markdown" and c.metadata.get("nbgrader", {}).get("solution", False)
                  for c in nb.cells)
    page = open_page(browser, site + "chapters/05_gae.html")
    folded = page.evaluate("() => [...document.querySelectorAll('details.marlhf-answer')].map(d => d.open)")
    assert answers >= 3 and folded == [False] * answers
    assert not page.locator("details.marlhf-answer p").first.is_visible()
    solution = page.locator("details.hide.above-input", has_text="def my_gae_bootstrap")
    assert solution.count() == 1 and solution.evaluate("d => d.open") is False
    assert not page.get_by_text("BEGIN SOLUTION").first.is_visible()
    page.locator("details.marlhf-answer summary").first.click()
    assert page.locator("details.marlhf-answer").first.evaluate("d => d.open")
    page.screenshot(path=str(SHOTS / "chapters_05_gae_answers.png"))
    page.close()


@pytest.mark.slow
def test_problem_sets_are_pages_with_their_fixes_folded(browser, site):
    """The problem sets are pages of the site (tools/book.py stage_site), listed in the navigation and the front
    page's contents under their own caption, with every fix (a solution cell) and every graded cell's hidden cases
    folded, closed, as the chapters' solutions are."""
    import nbformat

    page = open_page(browser, site + "index.html")
    for where in ("nav.bd-links", "article"):
        listed = page.evaluate(f"""() => [...document.querySelectorAll('{where} p.caption')]
          .filter(p => p.innerText.trim() === 'Problem sets')
          .map(p => [...p.nextElementSibling.querySelectorAll('a')].map(a => a.getAttribute('href')))""")
        assert listed == [[f"problems/{stem}.html" for stem in PROBLEM_SETS]], (where, listed)
    for stem in PROBLEM_SETS:
        nb = nbformat.read(ROOT / "notebooks" / "problems" / f"{stem}.ipynb", 4)
        hidden = sum(c.cell_type == "code" and (c.metadata.get("nbgrader", {}).get("solution", False)
                                                or "### BEGIN HIDDEN TESTS" in c.source) for c in nb.cells)
        page.goto(site + f"problems/{stem}.html", wait_until="load")
        folded = page.evaluate("() => [...document.querySelectorAll('details.hide.above-input')].map(d => d.open)")
        assert hidden >= 8 and folded == [False] * hidden, (stem, hidden, folded)
        assert not page.get_by_text("BEGIN SOLUTION").first.is_visible()
        assert page.locator("h1").first.inner_text().startswith("Problem set")
        if stem == PROBLEM_SETS[0]:
            page.screenshot(path=str(SHOTS / f"problems_{stem}.png"))
    page.close()


@pytest.mark.slow
def test_the_front_page_shows_the_pipeline_and_the_reading_path(browser, site):
    """The front page shows the README's pipeline figure (the file in docs/figures/) and its reading path, each
    chapter and problem set linked to its page."""
    assert (SITE / "_images" / "pipeline.png").read_bytes() == (ROOT / "docs" / "figures" / "pipeline.png").read_bytes()
    page = open_page(browser, site + "index.html")
    figure = page.locator("article img[src$='pipeline.png']")
    assert figure.count() == 1 and figure.evaluate("i => i.complete && i.naturalWidth > 0")
    table = page.locator("section#reading-path table")
    links = table.evaluate("t => [...t.querySelectorAll('a')].map(a => a.getAttribute('href'))")
    chapters = [f"chapters/{p.stem}.html" for p in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md"))]
    assert links == chapters
    assert [f"problems/{stem}.html" for stem in PROBLEM_SETS] == page.evaluate(
        "() => [...document.querySelectorAll('section#reading-path p a')].map(a => a.getAttribute('href'))"
        ".filter(h => h.startsWith('problems/'))")
    # every row as the README writes it: what the chapter teaches, its words and its run time
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\|[^|]*\| \[[^\]]+\]\(chapters/\w+\.md\) \| (.+) \|$", readme, re.M)
    shown = table.evaluate("t => [...t.querySelectorAll('tbody tr')]"
                           ".map(r => [...r.cells].slice(2).map(c => c.innerText.trim()).join(' | '))")
    shown = [r.replace("\u2019", "'") for r in shown]  # the site's typographic apostrophes
    assert len(rows) == len(chapters) and shown == [r.replace("`", "") for r in rows]
    page.locator("section#reading-path").scroll_into_view_if_needed()
    page.evaluate("() => document.querySelector('section#reading-path').scrollIntoView()")
    page.screenshot(path=str(SHOTS / "index_reading_path.png"))
    page.close()


def test_the_repository_buttons_appear_once_the_project_has_a_url(monkeypatch):
    """The theme's repository and issue buttons need the book's public URL, which the project does not have yet:
    site/conf.py adds them when MARLHF_EDU_REPOSITORY_URL (or its REPOSITORY_URL line) names one."""
    import runpy

    monkeypatch.delenv("MARLHF_EDU_REPOSITORY_URL", raising=False)
    conf = runpy.run_path(str(ROOT / "site" / "conf.py"))
    assert conf["html_theme_options"]["use_download_button"] and "repository_url" not in conf["html_theme_options"]
    monkeypatch.setenv("MARLHF_EDU_REPOSITORY_URL", "https://example.org/marlhf-edu")
    options = runpy.run_path(str(ROOT / "site" / "conf.py"))["html_theme_options"]
    assert options["repository_url"] == "https://example.org/marlhf-edu" and options["use_repository_button"]


def test_times_records_each_chapter_once_and_never_overwrites(tmp_path, monkeypatch):
    """tools/book.py times: the seconds execute_chapters returns (problem sets included), their total and the
    machine, in chapter_times_<cpu kind>.json; a second run refuses before executing anything."""
    import json

    sys.path.insert(0, str(ROOT / "tools"))
    import book

    calls = []

    def fake_execute(out_dir, names=None, problems=None):
        calls.append((out_dir, problems))
        return {"00_preface": 3.2, "01_reward_models": 4.4, "p1_math": 2.9}

    monkeypatch.setattr(book, "execute_chapters", fake_execute)
    record = book.cmd_times(out_dir=tmp_path)
    assert calls == [(book.BUILD / "executed", True)]
    (written,) = tmp_path.glob("chapter_times_*.json")
    assert json.loads(written.read_text()) == record
    assert record["seconds"]["p1_math"] == 2.9 and record["total_s"] == 10.5
    assert written.name == f"chapter_times_{record['cpu_kind']}.json" and record["command"] == "python tools/book.py times"
    with pytest.raises(SystemExit, match="exists; move it aside"):
        book.cmd_times(out_dir=tmp_path)
    assert len(calls) == 1
