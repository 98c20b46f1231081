// Typeset math with the KaTeX shipped in assets/vendor (no CDN). Arithmatex (generic mode) wraps
// Markdown math in \( \) and \[ \]; executed lessons (mkdocs-jupyter) keep the notebook's $ and $$.
// document$ re-fires on every instant-navigation page change.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "$$", right: "$$", display: true },
      { left: "$", right: "$", display: false },
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    ignoredClasses: ["highlight", "jp-OutputArea-output"],
    throwOnError: false,
  });
});
