"""The book's site, built as `make book` builds it and opened in headless Chromium.

Checks what a reader would see: equations rendered by MathJax (no raw LaTeX outside code), every internal
link and anchor resolving, figures loaded, search finding the GAE chapter, navigation between chapters.
One screenshot per checked page lands in build/site-check/ so a person can look.

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


def test_toc_lists_every_chapter_in_order():
    toc = re.search(r"```\{toctree\}\n:maxdepth: 1\n:caption: Chapters\n\n(.*?)```", (ROOT / "site" / "index.md").read_text(), re.S)
    listed = toc.group(1).split()
    assert listed == [f"chapters/{p.stem}" for p in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md"))]


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
               + [f"chapters/{p.stem}.html" for p in (ROOT / "chapters").glob("[0-9][0-9]_*.md")])


@pytest.mark.parametrize("name", PAGES)
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


def test_previous_next_navigation(browser, site):
    page = open_page(browser, site + "chapters/05_gae.html")
    prev = page.locator("a.left-prev").get_attribute("href")
    nxt = page.locator("a.right-next").get_attribute("href")
    assert prev.endswith("04_policy_gradient.html") and nxt.endswith("06_ppo_losses.html"), (prev, nxt)
    page.close()


# outputs that a reader would have to scroll sideways: wider than the article, or scrolling inside
TOO_WIDE = """() => {
  const right = (document.querySelector('article.bd-article') || document.querySelector('article')).getBoundingClientRect().right;
  return [...document.querySelectorAll('div.cell_output pre, div.cell_output table, div.cell_output img')]
    .filter(e => e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().right > right + 1)
    .map(e => (e.innerText || e.getAttribute('src') || '').slice(0, 80).replace(/\\n/g, ' '));
}"""


def test_outputs_wrap_to_the_text_column(browser, site):
    """Issue 36: cell outputs wrap (site/_static/marlhf.css); with the theme's defaults 155 output blocks of the
    book scrolled sideways at this width, among them the exercise checkers' FAIL lines."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    wide = {}
    for name in PAGES:
        if name.startswith("chapters/"):
            page.goto(site + name, wait_until="load")
            if blocks := page.evaluate(TOO_WIDE):
                wide[name] = blocks[:2]
    page.close()
    assert not wide, f"output blocks wider than the text column: {wide}"


def test_tables_render_and_outputs_keep_their_quotes(browser, site):
    """A chapter's Table output is an HTML table on the site (site/conf.py reads Markdown outputs as GitHub
    Markdown), and an output shows what the code printed: chapter 13's table of the answers' openings keeps the
    model's straight quotes, where Sphinx's smart quotes would print “I’m sorry for” (site/conf.py's
    OutputsAsPrinted). Prose keeps typographic quotes."""
    page = open_page(browser, site + "chapters/13_real_model.html")
    outputs = page.evaluate("() => [...document.querySelectorAll('div.cell_output')].map(e => e.textContent)")
    tables = page.evaluate("() => [...document.querySelectorAll('div.cell_output table')].map(e => e.textContent)")
    prose = page.evaluate(VISIBLE_PROSE)
    page.close()
    assert len(tables) >= 15, len(tables)
    openings = next(t for t in tables if "commonest opening" in t)
    assert "\"I'm sorry for\"\u00a04%" in openings or "\"I'm sorry for\" 4%" in openings, openings
    assert not [o[:80] for o in outputs if "“" in o or "’" in o]
    assert "“I’m sorry for any confusion" in prose  # the prose quoting an answer


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
