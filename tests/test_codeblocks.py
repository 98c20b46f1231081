"""The code-block runner (tests/codeblocks.py) on pages written for the purpose: it runs what it
must, fails loudly with the block's output, and refuses blocks that are neither run nor marked."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.kernel_independent("the code-block runner on pages written for the purpose: text and exit codes")


def run_pages(tmp_path, **pages) -> subprocess.CompletedProcess:
    docs = tmp_path / "docs"
    docs.mkdir(parents=True)
    for name, text in pages.items():
        (docs / f"{name}.md").write_text(textwrap.dedent(text))
    (tmp_path / "tmp").mkdir()  # the runner's TMPDIR, so a test can see what it leaves there
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(ROOT),
         "--codeblocks-docs", str(docs), str(docs)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
    )


def test_failing_shell_block_fails_with_its_output(tmp_path):
    result = run_pages(tmp_path, page="""
        ```bash
        echo "to stdout"; echo "to stderr" >&2
        python -c 'raise SystemExit(3)'
        ```
        """)
    assert result.returncode == 1
    assert "exited with status 3" in result.stdout
    assert "to stdout" in result.stdout and "to stderr" in result.stdout
    assert "python -c 'raise SystemExit(3)'" in result.stdout  # the code as it ran


def test_bash_stops_at_the_first_failing_command(tmp_path):
    result = run_pages(tmp_path, page="""
        ```sh
        false
        echo "not reached"
        ```
        """)
    assert result.returncode == 1
    assert "exited with status 1" in result.stdout


def test_fence_with_attributes_runs_and_includes_expand(tmp_path):
    result = run_pages(tmp_path, page="""
        ```python title="snippets/machine.py"
        --8<-- "snippets/machine.py:pick-device"
        import torch
        print("picked", pick_device("cpu"))
        ```
        """)
    # The section is a bare function (no import torch above it), so this fails *at run time*,
    # which proves it ran instead of being skipped as the stock pytest-codeblocks plugin would.
    assert result.returncode == 1
    assert "NameError: name 'torch' is not defined" in result.stdout
    # The block's script was written to a temporary directory, named after the block, and
    # removed afterwards, failure included.
    assert "docs_page_md_2.py" in result.stdout, result.stdout[-2000:]
    assert not [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("codeblock-")]


def test_expected_output_and_cont(tmp_path):
    result = run_pages(tmp_path, page="""
        ```python
        x = 6 * 7
        ```

        <!--pytest-codeblocks:cont-->
        ```python
        print(x)
        ```

        <!--pytest-codeblocks:expected-output-->
        ```text
        42
        ```

        ```python
        print("right")
        ```

        <!--pytest-codeblocks:expected-output-->
        ```text
        wrong
        ```
        """)
    assert result.returncode == 1
    assert "1 failed, 1 passed" in result.stdout
    assert "-wrong" in result.stdout and "+right" in result.stdout


def test_unknown_language_and_unmarked_blocks_fail(tmp_path):
    result = run_pages(tmp_path, page="""
        ```ini
        [section]
        ```

        ```
        no language at all
        ```

        ```text
        output is fine
        ```
        """)
    assert result.returncode == 1
    assert "2 failed" in result.stdout and "is neither run nor marked" in result.stdout
    assert "NEITHER RUN NOR MARKED: 2" in result.stdout
    assert "shown as text or diagrams: 1" in result.stdout


def test_skip_needs_a_reason_and_reasons_are_listed(tmp_path):
    no_reason = run_pages(tmp_path / "a", page="""
        <!--pytest.mark.skip-->
        ```bash
        exit 1
        ```
        """)
    assert no_reason.returncode != 0
    assert "needs a reason" in no_reason.stdout

    with_reason = run_pages(tmp_path / "b", page="""
        <!--pytest.mark.skip(reason="needs a 4-node cluster")-->
        ```bash
        exit 1
        ```
        """)
    assert with_reason.returncode == 0
    assert "page.md:3: needs a 4-node cluster" in with_reason.stdout


def test_data_blocks_are_parsed(tmp_path):
    result = run_pages(tmp_path, page="""
        ```json
        {"train_batch_size": 8}
        ```

        ```yaml
        a: [1, 2
        ```
        """)
    assert result.returncode == 1
    assert "this yaml block does not parse" in result.stdout
    assert "1 failed, 1 passed" in result.stdout


def test_excerpt_must_only_include_and_imports_its_module(tmp_path):
    ok = run_pages(tmp_path / "a", page="""
        <!--pytest.mark.excerpt-->
        ```python
        --8<-- "snippets/machine.py:machine-info"
        ```
        """)
    assert ok.returncode == 0, ok.stdout
    pasted = run_pages(tmp_path / "b", page="""
        <!--pytest.mark.excerpt-->
        ```python
        def pasted(): pass
        ```
        """)
    assert pasted.returncode == 1
    assert "may only hold --8<-- includes" in pasted.stdout


def test_missing_section_fails(tmp_path):
    result = run_pages(tmp_path, page="""
        ```python
        --8<-- "snippets/machine.py:no-such-section"
        ```
        """)
    assert result.returncode == 1
    assert "no-such-section" in result.stdout


def test_torchtitan_blocks_skip_with_reason_unless_required_then_need_the_extra(tmp_path, monkeypatch):
    """The plugin's own hooks on stand-in items, in-process (a pytest run per case would take
    seconds): skipped with the block's reason in `make test`; under REQUIRE_TORCHTITAN=1 not
    skipped, and failed when .venv-torchtitan's interpreter is missing."""
    from tests import codeblocks

    class Item:
        def __init__(self, *marks):
            self.marks = list(marks)

        def get_closest_marker(self, name):
            return next((m for m in self.marks if m.name == name), None)

        def add_marker(self, mark):
            self.marks.append(mark.mark)

    titan, plain = Item(pytest.mark.torchtitan(reason="FSDP2 run").mark), Item()
    monkeypatch.delenv("REQUIRE_TORCHTITAN", raising=False)
    codeblocks.skip_torchtitan_unless_required([titan, plain])
    assert [m.kwargs["reason"] for m in titan.marks if m.name == "skip"] == [
        "needs the torchtitan extra, run by `make test-torchtitan`: FSDP2 run"]
    assert plain.marks == []

    required = Item(pytest.mark.torchtitan(reason="FSDP2 run").mark)
    monkeypatch.setenv("REQUIRE_TORCHTITAN", "1")
    codeblocks.skip_torchtitan_unless_required([required])
    assert [m.name for m in required.marks] == ["torchtitan"]  # runs: a failing block fails
    monkeypatch.setattr(codeblocks, "TORCHTITAN_PYTHON", tmp_path / "no-venv" / "python")
    with pytest.raises(pytest.fail.Exception, match="REQUIRE_TORCHTITAN=1 but .* is missing: run "
                       r"`make torchtitan-env` \(FSDP2 run\)"):
        codeblocks.pytest_runtest_setup(required)
    monkeypatch.setattr(codeblocks, "TORCHTITAN_PYTHON", sys.executable)
    codeblocks.pytest_runtest_setup(required)  # the extra is there: the block runs


@pytest.mark.parametrize("require", ["0", "1"])
def test_cuda_blocks_skip_with_reason_or_fail_when_required(tmp_path, require, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the block would run; the CPU behaviour is tested elsewhere")
    monkeypatch.setenv("REQUIRE_GPU", require)
    result = run_pages(tmp_path, page="""
        <!--pytest.mark.cuda(reason="FP8 matmul")-->
        ```bash
        nvidia-smi
        ```
        """)
    if require == "1":
        assert result.returncode == 1 and "REQUIRE_GPU=1" in result.stdout
    else:
        assert result.returncode == 0 and "needs CUDA: FP8 matmul" in result.stdout


def test_markers_and_fences_that_would_hide_code_are_refused(tmp_path):
    """Each page would let a block pass without running it; the runner refuses each with the fix.
    One pytest run for all of them: a page's refusal is its own collection error. An indented
    code block is found by rendering the page, which is an item of its own, run once."""
    block = "```python\nraise SystemExit(1)\n```\n"
    pages = {
        "skipfile": "<!--pytest-codeblocks:skipfile-->\n" + block,
        "expect_error": "<!--pytest-codeblocks:expect-error-->\n" + block,
        "xfail": "<!--pytest.mark.xfail-->\n" + block,
        "importorskip": "<!--pytest-codeblocks:importorskip(torch)-->\n" + block,
        "tilde": "~~~python\nraise SystemExit(1)\n~~~\n",
        "bad_tolerance": block + "\n<!--pytest-codeblocks:expected-output(rtol=abc)-->\n```text\n1\n```\n",
        # Code typed into a page is usage, not a module: no definitions, no long programs.
        "defines": "```python\nimport torch\n\nclass Net:\n    def forward(self):\n        pass\n```\n",
        "long": "```python\n" + "x = 1\n" * 13 + "```\n",
    }
    result = run_pages(tmp_path, **pages)
    assert result.returncode != 0
    for expected in ("skipfile--> skips every block", "expect-error--> counts a failing block",
                     "pytest.mark.xfail...--> counts a failing block as a pass",
                     "importorskip(torch)--> turns a missing dependency into a skip",
                     "tilde.md:1: a ~~~ fence", "expected-output(rtol=abc): write",
                     "this block defines Net, forward in the page; move it into a module",
                     "13 lines of Python typed into the page (at most 12)"):
        assert expected in result.stdout, (expected, result.stdout[-3000:])
    assert f"{len(pages)} errors" in result.stdout
    # Blocks inside tabs, admonitions and list items are indented fences, not indented code;
    # an indented block after a blank line is code the site shows and the runner never sees.
    indented = "Some text.\n\n    raise SystemExit(1)\n\nMore text.\n"
    nested = run_pages(tmp_path / "nested", indented=indented, page="""
        === "CPU"

            ```bash
            echo tab
            ```

        ??? note "Solution"

            ```bash
            echo admonition
            ```

        1. A step.

            ```bash
            echo list
            ```
        """)
    assert nested.returncode == 1, nested.stdout[-2000:]
    assert ("indented.md: the site renders 1 code blocks but the page has 0 ``` fences"
            in nested.stdout), nested.stdout[-2000:]
    # page.md: its three blocks and its rendering pass; indented.md: its rendering fails.
    assert "1 failed, 4 passed" in nested.stdout, nested.stdout[-2000:]


def test_expected_output_with_a_numeric_tolerance(tmp_path):
    """rtol/atol apply to numbers with a decimal point or exponent; integers and words must match;
    a number beyond its bound fails and the message shows both values and the bound."""
    printed = 'print("step 20 | loss 4.8800 | lr 1.00e-03")'
    result = run_pages(tmp_path, page=f"""
        ```python
        {printed}
        ```

        <!--pytest-codeblocks:expected-output(rtol=0.01)-->
        ```text
        step 20 | loss 4.8700 | lr 1.00e-03
        ```

        ```python
        {printed}
        ```

        <!--pytest-codeblocks:expected-output(rtol=0.01)-->
        ```text
        step 20 | loss 4.7800 | lr 1.00e-03
        ```

        ```python
        {printed}
        ```

        <!--pytest-codeblocks:expected-output(rtol=0.5)-->
        ```text
        step 21 | loss 4.8800 | lr 1.00e-03
        ```

        ```python
        {printed}
        ```

        <!--pytest-codeblocks:expected-output(atol=0.1)-->
        ```text
        step 20 | loss 4.9500 | lr 1.00e-03
        ```
        """)
    assert "2 failed, 2 passed" in result.stdout, result.stdout[-3000:]
    assert "page 4.7800, got 4.8800: differs by 0.1 > bound 0.0478" in result.stdout
    assert "the text around the numbers differs" in result.stdout  # step 21: an integer


def test_expected_output_after_a_block_that_never_runs_is_refused(tmp_path):
    """pytest-codeblocks attaches an output to the block before it: after a skipped block (the
    4-GPU tab of a page, say), the output would be shown and compared with nothing."""
    result = run_pages(tmp_path, page="""
        ```bash
        echo 1
        ```

        <!--pytest.mark.skip(reason="needs 4 GPUs")-->
        ```bash
        echo 2
        ```

        <!--pytest-codeblocks:expected-output-->
        ```text
        1
        ```
        """)
    assert result.returncode != 0
    assert "expected-output block after it is never compared" in result.stdout
