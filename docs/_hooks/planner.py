"""MkDocs hook: put the planner's cost model, translated to JavaScript, into the built site.

The calculator page (docs/reference/calculator.md, driven by docs/assets/js/calculator.js) calls
`window.PlannerModel`, which is generated here from snippets/planner/cost_model.py on every build,
`mkdocs serve` rebuilds included: the browser and the tests run the same model.
"""

from mkdocs.structure.files import File

from snippets.planner.to_js import SOURCE, translate

GENERATED = "assets/js/planner-model.js"


def on_files(files, config):
    files.append(File.generated(config, GENERATED, content=translate(SOURCE.read_text())))
    return files
