// The page outline ("On this page") opens as a drawer from the button at the right of the article header, the
// only way to reach it where the outline has no column of its own (below 1600 px, site/_static/marlhf.css).
// sphinx-book-theme 1.4 draws that button, but pydata-sphinx-theme 0.20 wires only the first `.secondary-toggle`
// of the page, the navbar's, which the book theme hides: the article header's button hands its click on to it.
document.addEventListener("DOMContentLoaded", () => {
  const wired = document.querySelector(".bd-header .secondary-toggle");
  const shown = document.querySelector(".bd-header-article .secondary-toggle");
  if (wired && shown && wired !== shown) {
    shown.addEventListener("click", (event) => { event.preventDefault(); wired.click(); });
  }
});
