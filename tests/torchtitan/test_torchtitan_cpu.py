"""The launcher refuses versions it was not written for; the assets script writes the same bytes
every time and never touches a file it did not write."""

import json
import subprocess

import pytest

from snippets.library import torchtitan_assets
from tests.codeblocks import TORCHTITAN_PYTHON
from tests.conftest import ROOT

pytestmark = pytest.mark.torchtitan(reason="runs the extra's interpreter")


def test_launcher_refuses_a_version_it_was_not_written_for():
    refuse = ("import sys, snippets.library.torchtitan_cpu as t; "
              "t.SUPPORTED['torchtitan'] = '0.2.2'; sys.exit(t.main())")
    result = subprocess.run([str(TORCHTITAN_PYTHON), "-c", refuse], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == ("torchtitan_cpu: torchtitan 0.3.0 is installed, but this launcher's "
                             "patches were written against torchtitan 0.2.2; refusing to run "
                             "(see SUPPORTED)\n")


def test_assets_are_the_same_bytes_and_a_foreign_file_is_refused(tmp_path):
    written = torchtitan_assets.write(tmp_path / "a")
    assert [line.split()[0] for line in written] == ["wrote"] * 3
    assert json.loads((tmp_path / "a/tokenizer/tokenizer_config.json").read_text())["eos_token"] \
        == "<|endoftext|>"
    assert [line.split()[0] for line in torchtitan_assets.write(tmp_path / "a")] == ["kept"] * 3
    foreign = tmp_path / "b/c4_test/train.jsonl"
    foreign.parent.mkdir(parents=True)
    foreign.write_text('{"text": "mine"}\n')
    with pytest.raises(FileExistsError, match="was not written by this script"):
        torchtitan_assets.write(tmp_path / "b")
    assert foreign.read_text() == '{"text": "mine"}\n'
    assert not (tmp_path / "b/tokenizer").exists()  # refused before writing anything
