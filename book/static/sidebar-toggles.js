/* Phone navigation: both sidebar toggles open their sidebar.

   pydata-sphinx-theme 0.17 (pinned in requirements.txt) binds its drawer handler to the first
   element with class primary-toggle (and secondary-toggle) only: document.querySelector. With
   sphinx-book-theme 1.3 the page has two primary toggles (the theme's navbar button and the
   book theme's article-header button), and the visible one never gets the handler: tapping it
   does nothing (pydata-sphinx-theme issue #2451). Each further toggle here forwards its click to
   the first one, which does what the theme means (on a phone: open the sidebar as a drawer; on a
   wide screen: sphinx-book-theme's collapse). Closing works as the theme has it: tap outside the
   drawer, or Escape. */
(function () {
  function forward(selector) {
    const toggles = Array.from(document.querySelectorAll(selector));
    if (toggles.length < 2) return;
    const bound = toggles[0];
    toggles.slice(1).forEach((toggle) => {
      toggle.addEventListener(
        "click",
        (event) => {
          event.preventDefault();
          event.stopImmediatePropagation();
          bound.click();
        },
        true,
      );
    });
  }
  function setup() {
    forward(".primary-toggle");
    forward(".secondary-toggle");
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setup);
  else setup();
})();
