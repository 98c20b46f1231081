"""Figures for the site, each drawn by a small script from the course's own code.

Every module here has `render() -> str` (the SVG text) and writes docs/assets/figures/<name>.svg
when run: `python -m snippets.figures.pipeline_schedules`. tests/test_figures.py checks that
rendering again gives exactly the committed file, so a figure cannot drift from its generator.
"""
