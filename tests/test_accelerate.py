"""Hugging Face Accelerate on 2 CPU processes: the launch that works, the ones that do not.

The launches docs/course/week-1/accelerate.md shows are run by the code-block runner, which
checks their output: words and integers exactly, the losses and checksums within the band the
page states (their last digits depend on the CPU's kernels). The tests here assert what that
checked output proves (sharded data, replicas in sync, the trap's duplicate copies) without
launching them a second time; an equality the lesson rests on is made inside the run and printed
as a word or a count, so the band cannot hide a difference. The launches
the page does not run start the real `accelerate launch` in a subprocess, with HOME and HF_HOME in
a temporary folder so no user config (~/.cache/huggingface/accelerate/default_config.yaml) is
read, and every option the launcher would otherwise take from that config on the command line.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port

SCRIPT = "snippets/library/accelerate_train.py"
ACCELERATE = Path(sys.executable).parent / "accelerate"
STEPS = "1"  # the launches below are refused or checked for who starts


def accelerate_launch(tmp_path: Path, launch_args: list[str], *script_args: str,
                      extra_env: dict | None = None) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ACCELERATE_") and k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    env.update(HOME=str(home), HF_HOME=str(home / "hf"), OMP_NUM_THREADS="1", **(extra_env or {}))
    return subprocess.run(
        [str(ACCELERATE), "launch", *launch_args, "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no", "--main_process_port", str(free_port()), SCRIPT,
         "--steps", STEPS, "--state-dir", str(tmp_path / "state"), *script_args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


def processes(out: str) -> list[tuple[str, int, int, bool]]:
    """(launcher RANK, accelerate process index, accelerate process count, is main) per process."""
    return sorted((r, int(i), int(n), m == "True") for r, i, n, m in re.findall(
        r"launcher RANK=(\S+) -> accelerate process (\d+) of (\d+), main process: (\w+)", out))


def first_batches(out: str) -> list[list[int]]:
    return [[int(x) for x in batch.split(", ")]
            for batch in re.findall(r"first batch: examples \[(.*?)\]", out)]


def final_checksums(out: str) -> list[float]:
    # Exactly the 6 decimals printed: two processes share stdout, and another's text can follow
    # a number without a line break.
    return [float(x) for x in re.findall(r"final checksum (-?\d+\.\d{6})", out)]


PAGE = ROOT / "docs/course/week-1/accelerate.md"


# exact, or with the band the page states for its floats
CHECKED = re.compile(r"<!--pytest-codeblocks:expected-output(\(rtol=\S+, atol=\S+\))?-->\n")


def checked_output(command: str) -> str:
    """The expected output of the page's bash block that contains `command`. The code-block runner
    runs that block and compares its stdout with this text (floats within the marker's band), so
    the assertions below on the text hold for the real run; this function insists the block
    really is output-checked."""
    page = PAGE.read_text()
    end = page.index("\n```\n", page.index(command)) + 5  # the end of the block that runs it
    fence = page.index("```", end)  # the next block, the output, may follow some prose
    marker_line = page[page.rindex("\n", 0, fence - 1) + 1:fence]
    assert CHECKED.fullmatch(marker_line) and page.startswith("```text\n", fence), \
        f"the block running {command!r} is not followed by an output-checked text block"
    return page[fence + 8:page.index("\n```", fence + 8)]


def test_multi_gpu_launch_with_a_cpu_accelerator_trains_one_model_on_sharded_data():
    out = checked_output("snippets/library/accelerate_train.py --cpu --max-steps 5 --overwrite\n")
    assert processes(out) == [("0", 0, 2, True), ("1", 1, 2, False)]
    assert "MULTI_CPU: 2 processes, backend gloo" in out
    assert "model -> DistributedDataParallel" in out
    assert "577 batches -> 288 per process" in out  # each process loads half the batches
    batch0, batch1 = first_batches(out)
    assert not set(batch0) & set(batch1)  # different examples: the loader is sharded
    assert out.count("replicas in sync: True") == 5
    sums = final_checksums(out)
    # Exactly equal: DDP averaged every gradient. The run compares them itself ("replicas in
    # sync: True" after step 5, checked as a word); the page's digits are within a band.
    assert len(sums) == 2 and sums[0] == sums[1]
    assert ("saved runs/accelerate/state: model.safetensors, optimizer.bin, random_states_0.pkl, "
            "random_states_1.pkl") in out


def test_accelerate_use_cpu_env_and_torchrun_are_the_same_fix_as_cpu_true():
    out = checked_output("ACCELERATE_USE_CPU=1 accelerate launch")
    assert out.count("MULTI_CPU: 2 processes, backend gloo") == 2
    first_run = final_checksums(checked_output("--cpu --max-steps 5 --overwrite\n"))[0]
    assert final_checksums(out) == [first_run] * 4  # both launches, both processes
    # ... and the weights they saved are the first run's, compared byte for byte in the run:
    for run in ("env-var", "torchrun"):
        assert (f"runs/accelerate/{run}: the same weights as runs/accelerate/state, "
                "byte for byte") in out


def test_cpu_flag_of_accelerate_launch_starts_a_single_process():
    out = checked_output("accelerate launch --cpu --num_processes 2")
    assert processes(out) == [("-", 0, 1, True)]  # no RANK: not even a distributed launch
    assert "NO: 1 processes" in out
    assert len(final_checksums(out)) == 1


def test_multi_gpu_with_a_plain_accelerator_on_cpu_is_refused_naming_both_fixes():
    out = checked_output("2> runs/accelerate/trap.log")
    assert out.startswith("IndependentCopiesError: the launcher started 2 processes (WORLD_SIZE=2), "
                          "but Accelerate sees num_processes=1, distributed_type=NO in each")
    assert "Accelerator(cpu=True)" in out and "ACCELERATE_USE_CPU=1" in out
    assert "step" not in out  # the block prints stdout too: refused before training


def test_the_trap_trains_two_copies_of_a_one_process_run():
    out = checked_output("--allow-independent")
    batches = first_batches(out)
    assert len(batches) == 3 and batches[0] == batches[1] == batches[2]  # nothing is sharded
    assert out.count("not saving") == 2  # both copies are "the main process"
    # ... so neither touches the state the page's first launch saved (both once deleted it,
    # racing: one of them died of FileNotFoundError).
    assert out.endswith("model.safetensors\noptimizer.bin\nrandom_states_0.pkl\nrandom_states_1.pkl")
    # Each copy ends exactly where a single process ends, and nowhere near the real 2-process run
    # of the same 5 steps: the second process added nothing but a duplicate.
    single, copy0, copy1, counted = final_checksums(out)  # the last one from `uniq -c`
    assert single == copy0 == copy1 == counted
    assert "\n      3 final checksum " in out  # the run's own count: one checksum, three runs
    # 322.24 against 318.49: far apart, beyond either block's band
    assert single != final_checksums(checked_output("--cpu --max-steps 5 --overwrite\n"))[0]


def test_a_multi_cpu_config_file_also_starts_a_single_process(tmp_path):
    config = tmp_path / "multi_cpu.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n"
                      "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nuse_cpu: true\n")
    result = accelerate_launch(tmp_path, ["--config_file", str(config)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert processes(result.stdout) == [("-", 0, 1, True)]


def test_multi_gpu_and_cpu_flags_together_are_rejected(tmp_path):
    result = accelerate_launch(tmp_path, ["--multi_gpu", "--cpu", "--num_processes", "2"])
    assert result.returncode != 0
    assert "You can only use one of `--cpu`, `--multi_gpu`" in result.stderr


def test_a_run_refuses_a_folder_with_an_earlier_runs_state_in_one_line(tmp_path):
    (tmp_path / "optimizer.bin").write_text("x")
    (tmp_path / "notes.txt").write_text("x")
    result = subprocess.run([sys.executable, SCRIPT, "--steps", "1", "--state-dir", str(tmp_path)],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"error: rank ?: RunExistsError: an earlier run left optimizer.bin in {tmp_path}: pass "
        "another --state-dir to keep it, or --overwrite to replace it"]
    assert "step" not in result.stdout  # refused before training
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "optimizer.bin"]


def test_overwrite_removes_only_the_files_save_state_writes(tmp_path):
    from snippets.library.accelerate_train import check_state_dir, saved_state

    for name in ["model.safetensors", "optimizer.bin", "random_states_3.pkl", "notes.txt"]:
        (tmp_path / name).write_text("x")
    (tmp_path / "mine").mkdir()
    check_state_dir(str(tmp_path), overwrite=True)  # no error: the learner asked for it
    assert [p.name for p in saved_state(str(tmp_path))] == [
        "model.safetensors", "optimizer.bin", "random_states_3.pkl"]
    check_state_dir(str(tmp_path / "new"), overwrite=False)  # a folder not there yet is fine


@pytest.mark.parametrize("flag, value", [("--max-steps", "0"), ("--batch-size", "-1"),
                                         ("--lr", "0")])
def test_bad_numbers_are_refused_in_one_line_naming_the_flag(capsys, flag, value):
    from snippets.library.accelerate_train import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and flag in err
