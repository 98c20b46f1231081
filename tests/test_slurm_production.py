"""snippets/cluster/train_production.sbatch, checked without GPUs or a running cluster: bash syntax;
the installed sbatch accepts every #SBATCH option and value, and srun its options; torchrun and
the trainer parse theirs; and the resume logic picks --resume exactly when the run already has a
checkpoint. (`sbatch --test-only` would need slurmctld: tests/test_slurm.py starts one.)"""

import os
import re
import shlex
import shutil
import subprocess

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.kernel_independent("a batch script's text, options and shell logic")

SCRIPT = ROOT / "snippets" / "cluster" / "train_production.sbatch"
TEXT = SCRIPT.read_text()


def test_bash_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def slurm_accepts(tool: str, options: list[str], tmp_path) -> subprocess.CompletedProcess:
    """`sbatch OPTIONS --help` (or srun): Slurm parses every option, and checks many values,
    before it prints the help, and exits 255 naming the first it rejects. It reads a
    configuration first, so it gets a minimal one; no cluster is contacted."""
    if shutil.which(tool) is None:
        if os.environ.get("REQUIRE_SLURM") == "1":
            pytest.fail(f"REQUIRE_SLURM=1 but {tool} is not installed")
        pytest.skip(f"{tool} is not installed (Debian: apt-get install slurm-wlm)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=check\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\n"
                    "PartitionName=p Nodes=n1\n")
    return subprocess.run([tool, *options, "--help"], env={**os.environ, "SLURM_CONF": str(conf)},
                          capture_output=True, text=True, timeout=30)


def test_sbatch_accepts_every_option_and_value(tmp_path):
    options = re.findall(r"^#SBATCH\s+(\S+)", TEXT, flags=re.MULTILINE)
    assert len(options) == 13
    result = slurm_accepts("sbatch", options, tmp_path)
    assert result.returncode == 0, result.stderr
    # The check does catch a misspelled option, and a value sbatch checks (not every one is).
    for wrong in ("--exclusve", "--exclusive=bogus", "--open-mode=bogus"):
        assert slurm_accepts("sbatch", [*options, wrong], tmp_path).returncode == 255


def launch_words() -> list[str]:
    """The srun ... torchrun ... trainer command, as bash would split it (variables left in)."""
    launch = TEXT.split("# --8<-- [start:launch]")[1].split("# --8<-- [end:launch]")[0]
    command = re.search(r"^srun .*?&$", launch, flags=re.MULTILINE | re.DOTALL).group(0)
    return shlex.split(command.replace("\\\n", " ").rstrip("&"))


def test_srun_torchrun_and_trainer_flags_parse(tmp_path):
    from torch.distributed.run import get_args_parser

    from snippets.training.fsdp_trainer import parse_args

    words = launch_words()
    torchrun, trainer = words.index("torchrun"), words.index("snippets/training/fsdp_trainer.py")
    result = slurm_accepts("srun", words[1:torchrun], tmp_path)
    assert result.returncode == 0, result.stderr
    torchrun_args = get_args_parser().parse_args(words[torchrun + 1:trainer + 1])
    assert torchrun_args.numa_binding == "node"
    trainer_args = parse_args([w for w in words[trainer + 1:] if "RESUME" not in w])
    assert trainer_args.checkpoint == "sharded"


def resume_decision(tmp_path, restarts: int) -> str:
    section = TEXT.split("# --8<-- [start:resume]")[1].split("# --8<-- [end:resume]")[0]
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_NAME": "job", "SLURM_JOB_ID": "7",
           "SLURM_RESTART_COUNT": str(restarts)}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", section], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30, check=True).stdout.strip()


def test_a_requeued_job_resumes_when_there_is_a_checkpoint(tmp_path):
    assert resume_decision(tmp_path, 0) == "job 7, restart 0: new run in runs/job"
    # Requeued before its first checkpoint: nothing to resume, a new run.
    assert resume_decision(tmp_path, 1) == "job 7, restart 1: new run in runs/job"
    (tmp_path / "runs" / "job").mkdir(parents=True)
    (tmp_path / "runs" / "job" / "latest").write_text("ckpt-00000500.dcp\n")
    assert resume_decision(tmp_path, 2) == "job 7, restart 2: --resume in runs/job"
