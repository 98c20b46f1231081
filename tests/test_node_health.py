"""snippets/cluster/node_health.sh on a PATH the test controls: without nvidia-smi it says so and
exits 3; with stand-ins for nvidia-smi and dcgmi (in the layout of `nvidia-smi -q`, which this
GPU-less machine cannot confirm: NVIDIA does not promise it stays the same) it passes a healthy node and fails a pending row remap, a missing GPU and
a failed diagnostic with exit 1, naming each; bad usage exits 2."""

import os
import shutil
import subprocess
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.kernel_independent("a shell script's output and exit codes")

SCRIPT = ROOT / "snippets" / "cluster" / "node_health.sh"
TOOLS = ("awk", "grep", "cat", "tail", "timeout")  # what the script runs besides bash builtins

GPU_LIST = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"


def remapper(pending_on_second: bool) -> str:
    block = """
        GPU 00000000:{bus}:00.0
            Remapped Rows
                Correctable Error                 : 0
                Uncorrectable Error               : {bad}
                Pending                           : {pending}
                Remapping Failure Occurred        : No
        """
    return "Attached GPUs : 2" + "".join(
        textwrap.dedent(block).format(bus=bus, bad=int(pending), pending="Yes" if pending else "No")
        for bus, pending in (("18", False), ("2A", pending_on_second)))


def run(tmp_path, *args, nvidia_smi=None, dcgmi=None, env=None):
    """The script with a PATH holding only the tools it needs and the stand-ins given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for name, body in (("nvidia-smi", nvidia_smi), ("dcgmi", dcgmi)):
        if body is not None:
            (bin_dir / name).write_text(f"#!{shutil.which('bash')}\n{body}\n")
            (bin_dir / name).chmod(0o755)
    return subprocess.run([shutil.which("bash"), str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=60, env={"PATH": str(bin_dir), **(env or {})})


def fake_smi(tmp_path, pending: bool = False, gpus: str = GPU_LIST) -> str:
    (tmp_path / "remapper.txt").write_text(remapper(pending))
    (tmp_path / "list.txt").write_text(gpus + "\n")
    return (f'if [ "$1" = -L ]; then cat {tmp_path / "list.txt"}; '
            f'else cat {tmp_path / "remapper.txt"}; fi')


def test_no_gpu_here_says_so_and_exits_3(tmp_path):
    result = run(tmp_path, "8")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "missing: nvidia-smi (no NVIDIA driver)" in result.stdout
    assert result.stdout.splitlines()[-1] == "node_health: no NVIDIA GPU on this node (exit 3)"


def test_healthy_node_without_dcgm(tmp_path):
    result = run(tmp_path, "2", nvidia_smi=fake_smi(tmp_path))
    assert result.returncode == 0, result.stdout
    assert "row remapping: nothing pending, no failures" in result.stdout
    assert "missing: dcgmi (NVIDIA DCGM is not installed): diagnostics skipped" in result.stdout


def test_pending_row_remap_fails_naming_the_gpu(tmp_path):
    result = run(tmp_path, "2", nvidia_smi=fake_smi(tmp_path, pending=True), dcgmi="exit 0")
    assert result.returncode == 1
    assert ("FAIL: 00000000:2A:00.0: row remapping pending: reset the GPU (nvidia-smi -r) "
            "before use") in result.stdout
    assert "00000000:18:00.0" not in result.stdout  # the healthy GPU is not blamed
    assert "dcgmi diag -r 1: passed" in result.stdout


def test_missing_gpu_and_failed_diagnostic(tmp_path):
    dcgmi = 'echo "level $3"; echo "| Memory | Fail - GPU 1 |"; exit 226'
    result = run(tmp_path, "8", nvidia_smi=fake_smi(tmp_path), dcgmi=dcgmi,
                 env={"DCGM_LEVEL": "2"})
    assert result.returncode == 1
    assert "FAIL: 2 GPUs visible, 8 expected" in result.stdout
    assert "FAIL: dcgmi diag -r 2 did not pass" in result.stdout
    assert "level 2" in result.stdout and "Fail - GPU 1" in result.stdout


@pytest.mark.parametrize("args,env", [(["0"], {}), (["two"], {}), ([], {"DCGM_LEVEL": "4"})])
def test_bad_usage_exits_2(tmp_path, args, env):
    result = run(tmp_path, *args, env=env)
    assert result.returncode == 2 and "usage: node_health.sh" in result.stderr


def test_runs_from_a_prolog_environment(tmp_path):
    """A Slurm prolog runs with a minimal environment: the script needs nothing but PATH."""
    assert os.access(SCRIPT, os.X_OK)
    assert run(tmp_path).returncode == 3
