// MathJax's settings, read before MathJax itself (mkdocs.yml's extra_javascript):
// it typesets only what pymdownx.arithmatex marked (`class="arithmatex"`), written
// as \( ... \) inline and \[ ... \] on their own lines.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};
