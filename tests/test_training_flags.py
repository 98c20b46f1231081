"""Every numeric flag of the training scripts is range-checked when the command line is parsed:
one line naming the flag and what it accepts, exit status 2, no traceback."""

import pytest

from snippets.labs import lab1_sweep
from snippets.scripts import ddp_simulation_train, train_tiny_transformer
from snippets.training import ddp_trainer, fsdp_trainer

pytestmark = pytest.mark.kernel_independent("command-line parsing: messages and exit codes")

CASES = [
    # (script, argv, the one line it must print after "<prog>: error: ")
    (train_tiny_transformer, ["--max-steps", "-1"],
     "argument --max-steps: must be a whole number >= 1, got -1"),
    (train_tiny_transformer, ["--steps-per-epoch", "0"],
     "argument --steps-per-epoch: must be a whole number >= 1, got 0"),
    (train_tiny_transformer, ["--epochs", "0"],
     "argument --epochs: must be a whole number >= 1, got 0"),
    (train_tiny_transformer, ["--keep-last", "0"],
     "argument --keep-last: must be a whole number >= 1, got 0"),
    (train_tiny_transformer, ["--batch-size", "two"],
     "argument --batch-size: must be a whole number >= 1, got two"),
    (train_tiny_transformer, ["--lr", "0"], "argument --lr: must be a number > 0, got 0"),
    (train_tiny_transformer, ["--val-fraction", "1"],
     "argument --val-fraction: must be a number between 0 and 1 (exclusive), got 1"),
    (train_tiny_transformer, ["--resume", "--overwrite"],
     "--resume continues the run in --out and --overwrite replaces it: pass one"),
    (ddp_trainer, ["--max_steps", "0"],
     "argument --max-steps: must be a whole number >= 1, got 0"),
    (ddp_trainer, ["--grad_accum_steps", "0"],
     "argument --grad-accum-steps: must be a whole number >= 1, got 0"),
    (ddp_trainer, ["--keep_last", "0"],
     "argument --keep-last: must be a whole number >= 1, got 0"),
    (ddp_trainer, ["--lr", "1e-3", "--min_lr", "1e-2"],
     "argument --min-lr: must be at most --lr (0.001), got 0.01"),
    (fsdp_trainer, ["--shard_group_size", "0"],
     "argument --shard-group-size: must be a whole number >= 1, got 0"),
    (ddp_simulation_train, ["--steps", "0"],
     "argument --max-steps: must be a whole number >= 1, got 0"),
    (ddp_simulation_train, ["--ckpt-every", "0"],
     "argument --ckpt-every: must be a whole number >= 1, got 0"),
    (ddp_simulation_train, ["--fail-rank", "1"],
     "--fail-rank and --fail-step go together: pass both (e.g. --fail-rank 1 --fail-step 3) "
     "or neither"),
    (ddp_simulation_train, ["--fail-step", "3"],
     "--fail-rank and --fail-step go together: pass both (e.g. --fail-rank 1 --fail-step 3) "
     "or neither"),
    (ddp_simulation_train, ["--fail-rank", "2", "--fail-step", "3"],  # WORLD_SIZE=2 below
     "argument --fail-rank: must be a rank of this job, 0 to 1 (WORLD_SIZE=2), got 2"),
    (ddp_simulation_train, ["--steps", "6", "--fail-rank", "1", "--fail-step", "6"],
     "argument --fail-step: must be below --max-steps 6 or the failure never happens, got 6"),
]


@pytest.mark.parametrize("script, argv, message", CASES,
                         ids=[f"{s.__name__.split('.')[-1]} {' '.join(a)}" for s, a, _ in CASES])
def test_bad_flag_is_one_line_naming_it(script, argv, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc_per_node=2 sets it
    with pytest.raises(SystemExit) as exit_:
        script.parse_args(argv)
    assert exit_.value.code == 2  # SystemExit from argparse: no traceback on the terminal
    assert capsys.readouterr().err.split(": error: ", 1)[1] == message + "\n"


def test_sweep_checks_its_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        lab1_sweep.main(["--steps", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        "error: argument --max-steps: must be a whole number >= 1, got 0\n")


def test_good_flags_parse(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = ddp_simulation_train.parse_args(["--steps", "6", "--fail-rank", "2",
                                            "--fail-step", "3"])  # Lab 2's failure
    assert (args.fail_rank, args.fail_step) == (2, 3)
    assert train_tiny_transformer.parse_args(["--max-steps", "1", "--threads", "0"]).threads == 0
    assert ddp_trainer.parse_args(["--grad_clip", "0"]).grad_clip == 0  # 0 = no clipping



SCRIPTS = [
    # (module, argv, the one line after "<prog>: error: ") for the lesson scripts beside the trainers
    ("snippets.debugging.out_of_memory", ["--micro-batches", "8", "0"],
     "argument --micro-batches: must be a whole number >= 1, got 0"),
    ("snippets.cluster.node_ranks", ["--nnodes", "0"],
     "argument --nnodes: must be a whole number >= 1, got 0"),
    ("snippets.cluster.ranked_checkpoint", ["save", "--world-size", "0"],
     "argument --world-size: must be a whole number >= 1, got 0"),
    ("snippets.cluster.coordination", ["--timeout", "0"],
     "argument --timeout: must be a number > 0, got 0"),
    ("snippets.cluster.coordination", ["--missing-ranks", "-1"],
     "argument --missing-ranks: must be a whole number >= 0, got -1"),
    ("snippets.scripts.precision_and_accumulation", ["--threads", "0"],
     "argument --threads: must be a whole number >= 1, got 0"),
    ("snippets.scripts.low_precision", ["--steps", "0"],
     "argument --max-steps: must be a whole number >= 1, got 0"),
    ("snippets.library.accelerate_sharding", ["--processes", "0"],
     "argument --processes: must be a whole number >= 1, got 0"),
    ("snippets.scripts.profile_step", ["--data-delay-ms", "-5"],
     "argument --data-delay-ms: must be a number >= 0, got -5"),
]


MAIN_CASES = [
    # (module, argv of its main(), the one line after "<prog>: error: ")
    ("snippets.cluster.fake_multi_node_launcher", ["--master-port", "70000", "x.py"],
     "argument --master-port: must be a port from 1 to 65535 (leave it out for a free one), "
     "got 70000"),
    ("snippets.cluster.fake_multi_node_launcher", ["--nnodes", "0", "x.py"],
     "argument --nnodes: must be a whole number >= 1, got 0"),
    ("snippets.debugging.slow_data", ["--steps", "1"],
     "argument --steps: must be a whole number >= 2, got 1"),
    ("snippets.cluster.hang_demo", ["--timeout", "0"],
     "argument --timeout: must be a number > 0, got 0"),
    ("snippets.debugging.out_of_memory", ["--config", "smal"],
     "argument --config: unknown config 'smal'; use one of tiny, small, medium, gpt2-small or a "
     "path to a .json file"),
    ("snippets.cluster.multi_node_train", ["--lr", "0"],
     "argument --lr: must be a number > 0, got 0"),
    ("snippets.cluster.deepspeed.train_deepspeed", ["--steps", "0"],
     "argument --max-steps: must be a whole number >= 1, got 0"),
    ("snippets.scripts.train_tiny_transformer", ["--seed", "-1"],
     "argument --seed: must be a whole number >= 0, got -1"),
    ("snippets.tools.read_logs", ["/no/such/run"],
     "/no/such/run/metrics.jsonl not found: give the --out folder of a finished run"),
    ("snippets.library.pipeline", ["--stages", "0", "--micro-batches", "0"],
     "argument --stages: must be a whole number >= 2, got 0"),
    ("snippets.library.pipeline", ["--micro-batches", "0"],
     "argument --micro-batches: must be a whole number >= 1, got 0"),
    ("snippets.library.pipeline", ["--stages", "3", "--micro-batches", "2"],
     "argument --micro-batches: must be at least --stages (3) for Schedule1F1B, got 2"),
    ("snippets.library.pipeline", ["--micro-batches", "3"],
     "argument --batch-size: must be a multiple of --micro-batches (3), got 8"),
    # The library demos that take no flags refuse one rather than ignore it.
    *[(f"snippets.library.{name}", ["--stages", "4"], "unrecognized arguments: --stages 4")
      for name in ("tensor_parallel", "sequence_parallel", "context_parallel", "three_d")],
]


@pytest.mark.parametrize("module, argv, message", SCRIPTS + MAIN_CASES,
                         ids=[f"{m.split('.')[-1]} {' '.join(a)}" for m, a, _ in SCRIPTS + MAIN_CASES])
def test_bad_input_is_refused_in_one_line(module, argv, message, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.split(": error: ", 1)[1] == message + "\n"


def test_a_reversed_exercise_range_is_refused_not_passed():
    from snippets.exercises.__main__ import main

    with pytest.raises(SystemExit, match="a range like 12-15, or 'all', not '15-12'"):
        main(["check", "15-12"])
