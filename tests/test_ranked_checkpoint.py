"""Ranked checkpoints: 2 processes save their shards, 1 and 4 processes load them back by
re-sharding, consolidation equals the trained model, and damaged checkpoints name the rank."""

import shutil

import pytest
import torch
import torch.distributed as dist

from snippets.cluster.ranked_checkpoint import (_demo_save, consolidate, load_shard,
                                                saved_world_size, shard_bounds, shard_path)
from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config
from snippets.training.checkpoint import CheckpointError, CorruptCheckpointError, NoCheckpointError

STEP = 2


def reference_model(world_size: int = 2):
    """The demo's training, replayed in one process: each rank's half-batch gradient computed on
    its own, then averaged as all_reduce does (a + b is the same float in either order, so with 2
    ranks the replay is exact, on any machine's kernels)."""
    from snippets.cluster.ranked_checkpoint import adam_groups
    from snippets.models.gpt import shift_for_next_token

    torch.manual_seed(0)
    model = GPT(get_config("tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEP):
        grads = []
        for batch in torch.randint(0, 256, (2 * world_size, 17), generator=g).chunk(world_size):
            model(*shift_for_next_token(batch))[1].backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.zero_grad()
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = (per_rank[0] + per_rank[1]) / world_size
        optimizer.step()
        optimizer.zero_grad()
    return adam_groups(model, optimizer)


def load_and_gather(rank, world_size, directory):
    """Each of the new ranks loads its slice, then all-gather rebuilds the full buffers."""
    meta, shards = load_shard(directory, rank, world_size)
    full = {}
    for group, piece in shards.items():
        numel = meta["layouts"][group]["numel"]
        size = shard_bounds(numel, 0, world_size)[1]
        padded = torch.zeros(size)
        padded[:len(piece)] = piece  # the last slice may be short: pad to a common size
        gathered = [torch.empty(size) for _ in range(world_size)]
        dist.all_gather(gathered, padded)
        full[group] = torch.cat(gathered)[:numel]
    return meta["saved_world_size"], {g: len(s) for g, s in shards.items()}, full


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ranked") / f"step_{STEP}"
    spawn(_demo_save, 2, str(directory), STEP, timeout_s=120)
    return directory


# --8<-- [start:test-reshard]
def test_two_rank_checkpoint_loads_on_one_and_four_ranks(saved, one_thread):
    ref = reference_model()
    ref_flat = {g: torch.cat([t.detach().reshape(-1) for t in ts.values()]) for g, ts in ref.items()}
    assert saved_world_size(saved) == 2

    # 1 process: consolidation gives full tensors equal, bit for bit, to the same training
    # replayed in one process.
    meta, groups = consolidate(saved)
    assert meta["step"] == STEP
    for group, tensors in ref.items():
        for name, tensor in tensors.items():
            assert torch.equal(groups[group][name], tensor.detach()), (group, name)
    model = GPT(get_config("tiny"))
    model.load_state_dict(groups["model"], strict=False)
    for name, p in model.named_parameters():
        assert torch.equal(p, groups["model"][name]), name

    # 4 processes: each loads its quarter (re-sharded from 2 files); gathered, it is all of it.
    results = spawn(load_and_gather, 4, str(saved), timeout_s=120)
    numel = ref_flat["model"].numel()
    for rank, (saved_world, sizes, full) in enumerate(results):
        assert saved_world == 2
        lo, hi = shard_bounds(numel, rank, 4)
        assert sizes["model"] == hi - lo
        for group in ref_flat:  # exactly the consolidated bytes, nothing lost or doubled
            flat_consolidated = torch.cat([t.reshape(-1) for t in groups[group].values()])
            assert torch.equal(full[group], flat_consolidated), group
# --8<-- [end:test-reshard]


# --8<-- [start:test-errors]
def test_missing_truncated_and_mismatched_rank_files_are_named(saved, tmp_path):
    with pytest.raises(CheckpointError, match=r"saved by 2 ranks but this job has world_size=4"):
        load_shard(saved, 0, 4, reshard=False)

    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    victim = shard_path(broken, 1, 2)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # a killed copy
    with pytest.raises(CorruptCheckpointError, match=r"rank 1's shard is damaged.*truncated"):
        consolidate(broken)
    with pytest.raises(CorruptCheckpointError, match="rank 1"):
        load_shard(broken, 3, 4)  # new rank 3 reads from old rank 1's file
    load_shard(broken, 0, 4)  # new rank 0 needs only old rank 0's file: still loads

    victim.unlink()
    with pytest.raises(NoCheckpointError, match=r"rank 1's shard rank_00001-of-00002.pt is missing"):
        consolidate(broken)
    with pytest.raises(NoCheckpointError, match="no ranked checkpoint files"):
        consolidate(tmp_path / "empty")
# --8<-- [end:test-errors]


def test_merge_logs_never_writes_over_a_file_it_did_not_write(tmp_path, capsys):
    from snippets.cluster.merge_logs import main

    (tmp_path / "logs/rank_0").mkdir(parents=True)
    rank0 = tmp_path / "logs/rank_0/train.log"
    rank0.write_text("12:00:00 rank 0 | step 1\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")

    def refused(*args: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            main([str(tmp_path / "logs"), *args])
        assert exit_.value.code == 2
        return capsys.readouterr().err

    assert "is one of the logs it reads" in refused("--out", str(rank0), "--overwrite")
    assert f"--out {notes} exists: pass another --out, or --overwrite" in refused("--out", str(notes))
    assert rank0.read_text() == "12:00:00 rank 0 | step 1\n" and notes.read_text() == "mine"
    with pytest.raises(SystemExit):
        main([str(tmp_path / "no-such-dir")])
    assert len(capsys.readouterr().err.strip().splitlines()) == 1  # one line, no traceback
    main([str(tmp_path / "logs"), "--out", str(notes), "--overwrite"])
    assert notes.read_text() == "12:00:00 rank 0 | step 1\n"


def test_shard_bounds_cover_the_buffer_once():
    for numel in (0, 1, 7, 115_520):
        for world in (1, 2, 3, 4, 8):
            bounds = [shard_bounds(numel, r, world) for r in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


# --8<-- [start:test-merge-logs]
def test_merge_logs_orders_ranks_by_time_and_labels_every_line(tmp_path):
    from snippets.cluster.merge_logs import last_line_per_rank, merge_rank_logs
    from snippets.scripts.ddp_simulation_train import rank_logger

    # The real format, written by the trainer's own logger...
    for rank in (0, 1):
        log = rank_logger(str(tmp_path / "real"), rank)
        log.info(f"started: RANK={rank}")
        for handler in log.handlers[:]:  # the logger is global: leave none behind
            handler.close()
            log.removeHandler(handler)
    real = merge_rank_logs(tmp_path / "real")
    assert [(e.rank, e.text) for e in real] == [(0, "started: RANK=0"), (1, "started: RANK=1")]

    # ...and a hand-made pair: interleaving, a traceback, a run past midnight.
    (tmp_path / "logs/rank_0").mkdir(parents=True)
    (tmp_path / "logs/rank_1").mkdir(parents=True)
    (tmp_path / "logs/rank_0/train.log").write_text(
        "23:59:58 rank 0 | step 1\n23:59:59 rank 0 | step 2\n00:00:01 rank 0 | step 3\n")
    (tmp_path / "logs/rank_1/train.log").write_text(
        "23:59:58 rank 1 | step 1\n00:00:00 rank 1 | failed\nTraceback (most recent call last):\n"
        "RuntimeError: simulated failure on rank 1\n")
    merged = [str(e) for e in merge_rank_logs(tmp_path / "logs")]
    assert merged == [
        "23:59:58 rank 0 | step 1", "23:59:58 rank 1 | step 1", "23:59:59 rank 0 | step 2",
        "00:00:00 rank 1 | failed", "00:00:00 rank 1 | Traceback (most recent call last):",
        "00:00:00 rank 1 | RuntimeError: simulated failure on rank 1", "00:00:01 rank 0 | step 3"]
    last = last_line_per_rank(merge_rank_logs(tmp_path / "logs"))
    assert last[1].text.startswith("RuntimeError") and last[0].text == "step 3"
    with pytest.raises(FileNotFoundError, match="rank_N/train.log"):
        merge_rank_logs(tmp_path / "nothing")
# --8<-- [end:test-merge-logs]


def test_the_command_line_never_writes_over_an_earlier_save_and_errors_are_one_line(tmp_path,
                                                                                   capsys):
    from snippets.cluster.ranked_checkpoint import main

    saved = tmp_path / "step_3"
    saved.mkdir()
    (saved / "rank_00000-of-00003.pt").write_bytes(b"an earlier save")
    model = tmp_path / "model.pt"
    model.write_bytes(b"the learner's consolidated model")

    def error(*argv: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            main(list(argv))
        assert exit_.value.code == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
        return err

    assert (f"an earlier run left rank_00000-of-00003.pt in {saved}: pass another directory to "
            "keep it, or --overwrite") in error("save", str(saved))
    assert f"{model} exists: pass another output path, or --overwrite" in error(
        "consolidate", str(saved), str(model))
    assert "no ranked checkpoint files" in error("inspect", str(tmp_path / "nothing"))
    assert (saved / "rank_00000-of-00003.pt").read_bytes() == b"an earlier save"
    assert model.read_bytes() == b"the learner's consolidated model"
