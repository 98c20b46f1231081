"""The course's sbatch scripts, submitted to a real SLURM cluster of two nodes on this machine.

snippets/cluster/local_slurm.sh starts slurmctld and two slurmd (node1, node2) once for this
module and stops them at the end. Without SLURM (not installed and not installable, or the
daemons do not start) the tests skip with the reason; REQUIRE_SLURM=1 (set by .ci/run) turns
that skip into a failure, so CI cannot pass without running them.
"""

import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from snippets.training.checkpoint import load_checkpoint
from tests.conftest import ROOT

pytestmark = pytest.mark.kernel_independent("SLURM job lifecycle: submission, states, files, exit codes")

SCRIPT = ROOT / "snippets" / "cluster" / "local_slurm.sh"
USER = pwd.getpwuid(os.getuid()).pw_name  # what `id -un` prints in local_slurm.sh
STATE = Path(os.environ.get("LOCAL_SLURM_DIR", f"/tmp/course-slurm-{USER}"))
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def unavailable(reason: str):
    if os.environ.get("REQUIRE_SLURM") == "1":
        pytest.fail(f"REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


def as_root(env: dict) -> list[str]:
    """The daemons run as root (slurmd must start jobs as the submitting user): use sudo where
    the tests themselves do not run as root, as on CI runners with passwordless sudo."""
    if os.geteuid() == 0 or shutil.which("sudo") is None:
        return []
    if subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode != 0:
        return []  # no passwordless sudo: try as this user; start reports what fails
    return ["sudo", "-n", "env", f"LOCAL_SLURM_DIR={env['LOCAL_SLURM_DIR']}", f"PATH={env['PATH']}"]


@pytest.fixture(scope="module")
def slurm_env():
    """The environment sbatch needs: SLURM_CONF, and the project's python/torchrun on PATH
    (a job inherits the submitting shell's environment, as on a real cluster)."""
    if not SCRIPT.is_file():
        unavailable(f"{SCRIPT} is missing")
    env = {**os.environ, "LOCAL_SLURM_DIR": str(STATE),
           "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    root = as_root(env)
    started = subprocess.run([*root, "bash", str(SCRIPT), "start"], env=env, capture_output=True,
                             text=True, timeout=900)
    if started.returncode == 3:
        unavailable(f"SLURM is not installed and cannot be installed here: {started.stderr.strip()}")
    if started.returncode != 0:
        subprocess.run([*root, "bash", str(SCRIPT), "stop"], env=env, capture_output=True,
                       timeout=60)
        unavailable(f"the local SLURM cluster did not start:\n{started.stderr[-3000:]}")
    env["SLURM_CONF"] = str(STATE / "slurm.conf")
    yield env
    subprocess.run([*root, "bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=60)


def sbatch(env, script: str, out_dir: Path) -> str:
    result = subprocess.run(
        ["sbatch", "--parsable", f"--output={out_dir}/%x-%j.out", f"--chdir={ROOT}", script],
        env=env, capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.strip().split(";")[0]


def job_fields(env, job_id: str) -> dict:
    """`scontrol show job` as a dict (slurmctld keeps finished jobs for MinJobAge seconds)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return dict(re.findall(r"(\S+?)=(\S*)", out))


def wait_for(env, job_ids: list[str], timeout_s: float = 300) -> dict:
    """Poll every half second (`sbatch --wait` polls only every 10 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = {j: job_fields(env, j) for j in job_ids}
        if all(f["JobState"] in FINISHED for f in jobs.values()):
            return jobs
        if time.monotonic() > deadline:
            subprocess.run(["scancel", *job_ids], env=env, timeout=30)
            pytest.fail(f"jobs not finished within {timeout_s:.0f} s: "
                        f"{ {j: f['JobState'] for j, f in jobs.items()} }")
        time.sleep(0.5)


# --8<-- [start:both-jobs]
def test_single_node_and_two_node_jobs_train_and_complete(slurm_env, tmp_path):
    one = sbatch(slurm_env, "snippets/cluster/train_single_node.sbatch", tmp_path)
    two = sbatch(slurm_env, "snippets/cluster/train_two_nodes.sbatch", tmp_path)
    jobs = wait_for(slurm_env, [one, two])
    outputs = {j: (tmp_path / f"{jobs[j]['JobName']}-{j}.out").read_text() for j in jobs}
    for j, fields in jobs.items():
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), outputs[j]

    single = outputs[one]
    assert jobs[one]["NumNodes"] == "1"
    ranks = re.findall(r"rank (\d)/(\d): node 0 \(host (node\d)\)", single)
    assert sorted(ranks) == [("0", "2", ranks[0][2]), ("1", "2", ranks[0][2])], single

    double = outputs[two]
    assert jobs[two]["NodeList"] == "node[1-2]" and jobs[two]["NumNodes"] == "2", jobs[two]
    assert "first node node1, rendezvous 127.0.0.1:" in double, double
    # Not anchored on srun's "0:"/"1:" labels: two ranks of one task share its stdout, and their
    # lines can run together without a newline between them.
    ranks = re.findall(r"rank (\d)/4: node (\d) \(host (node\d)\)", double)
    assert sorted(r[0] for r in ranks) == ["0", "1", "2", "3"], double
    hosts = {host: sorted(int(r) for r, _, h in ranks if h == host) for host in ("node1", "node2")}
    # Two ranks on each node, consecutive ones: node rank x 2 + local rank.
    assert sorted(hosts.values()) == [[0, 1], [2, 3]], double

    for out, world in ((single, 2), (double, 4)):
        losses = [float(x) for x in re.findall(r"step \d \| global loss (\S+)", out)]
        assert len(losses) == 3 and losses[-1] < losses[0], out  # 3 steps, and it learned
        assert f"done: world size {world}" in out, out
    # Without accounting storage there is no sacct; the job completion log records both jobs.
    completions = (STATE / "log" / "jobcomp.log").read_text()
    for j in (one, two):
        assert re.search(rf"JobId={j} .*JobState=COMPLETED", completions), completions
        assert_no_workers_left(f"--ckpt runs/slurm/{j}/ckpt.pt")
# --8<-- [end:both-jobs]


# --8<-- [start:save-on-signal]
def test_the_trainer_saves_when_the_batch_script_gets_its_warning_signal(slurm_env, tmp_path):
    """`#SBATCH --signal=B:USR1@60` sends USR1 to the batch script; here scancel sends it now,
    the same delivery, instead of waiting for a time limit (SLURM checks it every 30-60 s)."""
    job = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path}/%x-%j.out", f"--chdir={ROOT}",
         "--export=ALL,STEPS=1000", "snippets/cluster/train_single_node.sbatch"],
        env=slurm_env, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    out = tmp_path / f"tiny-1node-{job}.out"
    deadline = time.monotonic() + 120
    while not re.search(r"step 2 \|", out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_env, timeout=30,
                   check=True)
    fields = wait_for(slurm_env, [job], timeout_s=120)[job]
    text = out.read_text()
    assert "batch script: USR1, the time limit is near: asking the trainer to save" in text
    stopped = re.search(r"rank 0: stop requested \(SIGTERM\) after step (\d+): saving", text)
    assert stopped, text
    saved_at = int(stopped[1])
    assert 2 <= saved_at < 1000, text  # it stopped early, at a step boundary
    ckpt = ROOT / "runs" / "slurm" / job / "ckpt.pt"
    assert f"checkpoint: runs/slurm/{job}/ckpt.pt" in text, text
    assert load_checkpoint(ckpt)["step"] == saved_at
    # torchrun exits 1 after a signal even though its workers saved and exited 0.
    assert "SignalException: Process" in text and "got signal: 15" in text, text
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "1:0"), text
    assert_no_workers_left(f"--ckpt runs/slurm/{job}/ckpt.pt")
# --8<-- [end:save-on-signal]


def assert_no_workers_left(marker: str) -> None:
    """No process of the job outlives it (SLURM kills what it tracks; a worker it did not
    track would keep training, unseen). Any found are killed, and the test fails."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            left.append(f"{pid}: {cmdline}")
            os.kill(int(pid), signal.SIGKILL)
    assert not left, f"processes left after the job ended: {left}"


def test_start_refuses_a_state_folder_it_did_not_write(tmp_path):
    """`start` clears its own job state (ctld/, log/, spool/) in LOCAL_SLURM_DIR: a folder that
    holds anything else is refused, and nothing in it is touched."""
    if shutil.which("slurmctld") is None:
        unavailable("slurmctld is not installed")
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "mine.txt").write_text("the learner's")
    result = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True,
                            env={**os.environ, "LOCAL_SLURM_DIR": str(tmp_path)}, timeout=120)
    assert result.returncode == 1
    assert f"error: {tmp_path} holds files this script did not write" in result.stderr
    assert (tmp_path / "log" / "mine.txt").read_text() == "the learner's"
