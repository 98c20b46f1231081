"""The FSDP2 trainer (snippets/training/fsdp_trainer.py) against single-process training on the
same global batch: every sharding strategy, mixed precision, CPU offload, full and sharded (DCP)
checkpoints, and hybrid sharding on a 2 x 2 mesh (gloo, 2 and 4 processes).

One spawn runs many trainers so that the processes start once: each worker returns what it saw
and the assertions run here, in the test process."""

import copy
import functools

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from snippets.dist import spawn
from snippets.models.gpt import shift_for_next_token
from snippets.models.gpt import GPT, ConfigError, get_config
from snippets.training.ddp_trainer import DistributedTrainer, TrainConfig
from snippets.training.fsdp_trainer import FSDPConfig, FSDPTrainer

try:  # ZeRO-3 from scratch (Week 2), to compare with
    from snippets.scratch.zero import ZeRO3
except ImportError:
    ZeRO3 = None

STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16
TIMEOUT_S = 120
MODEL = get_config("tiny", max_position_embeddings=SEQ)


def train_config(world_size: int) -> TrainConfig:
    # batch_size is per process: every run below trains on the same global batch of 8.
    return TrainConfig(batch_size=GLOBAL_BATCH // world_size, seq_len=SEQ, max_steps=10,
                       warmup_steps=2, lr=1e-2, data="dummy")


def full_state(trainer) -> dict:
    """The unsharded weights, gathered on every rank (a collective)."""
    options = StateDictOptions(full_state_dict=True)
    return {k: v.clone() for k, v in get_model_state_dict(trainer.model, options=options).items()}


def first_moments(trainer) -> dict:
    """AdamW's exp_avg of every parameter, unsharded, by name (a collective)."""
    options = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(trainer.raw_model, trainer.optimizer, options=options)
    return {n: s["exp_avg"].clone() for n, s in state["state"].items()}


def train(trainer, steps: int, grad_norms: list | None = None) -> list[float]:
    """The losses of `steps` steps; appends each step's gradient norm (before clipping) to
    `grad_norms` if given."""
    batches, losses = trainer.micro_batches(), []
    for _ in range(steps):
        stats = trainer.train_step(batches)
        losses.append(stats["loss"])
        if grad_norms is not None:
            grad_norms.append(stats["grad_norm"])
    return losses


@functools.cache
def initial_weights() -> dict:
    torch.manual_seed(TrainConfig().seed)  # the seed every trainer starts from
    return GPT(MODEL).state_dict()


def single_process() -> dict:
    """The reference: one process, no sharding, the whole global batch each step."""
    trainer = DistributedTrainer(MODEL, train_config(1))
    grad_norms = []
    losses = train(trainer, 2, grad_norms)
    options = StateDictOptions(full_state_dict=True)  # AdamW's state keyed by parameter name
    after_two = {"state": {k: v.clone() for k, v in trainer.raw_model.state_dict().items()},
                 "optimizer": copy.deepcopy(get_optimizer_state_dict(
                     trainer.raw_model, trainer.optimizer, options=options))}  # live tensors
    losses += train(trainer, STEPS - 2, grad_norms)
    return {"losses": losses, "grad_norms": grad_norms, "after two steps": after_two,
            "state": trainer.raw_model.state_dict(), "moments": first_moments(trainer)}


# --8<-- [start:assert-close]
def assert_close(state: dict, reference: dict, what: str, start: dict | None = None,
                 rel: float = 1e-3):
    """Equal to single-process training up to fp32 rounding: the largest difference must be
    below `rel` times the distance training moved the values from `start` (the initial
    weights by default).

    Not bit-exact: the reduce-scatter averages two per-rank means where one process takes one
    mean over the global batch, the same numbers added in another order (relative ~1e-7).
    AdamW divides each element's update by that element's own gradient size, so where a
    gradient nearly cancels, that noise becomes a visible difference in the update: measured
    1.8e-4 of the distance the weights moved in 3 steps, so 1e-3 is allowed. A real mistake
    (gradients not averaged over ranks, a shard updated twice) is off by a whole step,
    ~lr = 1e-2, about 40% of that distance."""
    start = initial_weights() if start is None else start
    moved = max((reference[n] - start[n]).abs().max().item() for n in reference)
    worst = max((state[n].float() - reference[n]).abs().max().item() for n in reference)
    assert worst < rel * moved, f"{what}: differs by {worst:.2e}; training moved {moved:.2e}"


# Adam's update divides out the gradient's scale, so a gradient summed over the ranks instead of
# averaged (2x here) trains nearly the same weights; the first moment and the gradient norm are
# proportional to the gradient and come out 2x, an error as large as themselves (unless the
# gradient was clipped: then only the norm, measured before clipping, shows it). Rounding, and the weights
# of steps 2-3 already differing by the 1.8e-4 above, move it by ~1e-5 of its largest value.
# 1e-3 of the largest moment sits 100x above that and 1000x below the bug.
MOMENTS_REL = 1e-3
# --8<-- [end:assert-close]


# --8<-- [start:two-process-worker]
def two_process_worker(rank, world_size, tmp):
    seen = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        trainer = FSDPTrainer(MODEL, train_config(world_size), FSDPConfig(strategy))
        grad_norms = []
        seen[strategy] = {"losses": train(trainer, STEPS, grad_norms), "state": full_state(trainer),
                          "grad_norms": grad_norms, "moments": first_moments(trainer),
                          "stored": trainer.local_parameter_count()}

    # Checkpoints: save both kinds after 2 steps, take a 3rd step; then two fresh trainers
    # load one each and take the 3rd step from there.
    trainer = FSDPTrainer(MODEL, train_config(world_size))
    train(trainer, 2)
    trainer.save_checkpoint_once(f"{tmp}/ckpt.pt")
    trainer.save_sharded_checkpoint(f"{tmp}/ckpt_dcp")
    train(trainer, 1)
    seen["unbroken"] = full_state(trainer)
    for kind in ("full", "sharded"):
        resumed = FSDPTrainer(MODEL, train_config(world_size))
        if kind == "full":
            resumed.load_checkpoint(f"{tmp}/ckpt.pt")
        else:
            resumed.load_sharded_checkpoint(f"{tmp}/ckpt_dcp")
        train(resumed, 1)
        seen[f"resumed {kind}"] = full_state(resumed)

    # bf16 compute: what dtype the weights have while a block computes, and after the step.
    bf16 = FSDPTrainer(MODEL, train_config(world_size), FSDPConfig(mixed_precision="bf16"))
    computed_in = []
    bf16.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda module, args: computed_in.append((module.weight.dtype, args[0].dtype)))
    seen["bf16 losses"] = train(bf16, STEPS)
    seen["bf16 computed in"] = computed_in[0]
    seen["bf16 stored as"] = {p.dtype for p in bf16.model.parameters()}
    seen["bf16 sharded"] = all(type(p).__name__ == "DTensor" for p in bf16.model.parameters())
    seen["bf16 state"] = full_state(bf16)

    offload = FSDPTrainer(MODEL, train_config(world_size), FSDPConfig(cpu_offload=True))
    train(offload, STEPS)
    seen["offload"] = full_state(offload)
    if ZeRO3 is not None:
        seen["fully_shard vs ZeRO3"] = fully_shard_and_zero3(rank, world_size)
    return seen


# --8<-- [start:zero3-worker]
def fully_shard_and_zero3(rank, world_size) -> tuple[dict, dict]:
    """The same GPT, batches and plain AdamW, sharded by FSDP2 and by ZeRO-3 from scratch."""
    from torch.distributed.fsdp import fully_shard

    adamw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g).chunk(world_size)[rank]
               for _ in range(STEPS)]
    states = []
    for library in (True, False):
        torch.manual_seed(0)
        model = GPT(MODEL)
        if library:
            for block in model.layers:
                fully_shard(block)
            net = fully_shard(model)
            optimizer = torch.optim.AdamW(net.parameters(), **adamw)
        else:
            net = ZeRO3(model)  # blocks, then the root: the same units
            optimizer = torch.optim.AdamW(net.parameters(), **adamw)
        for batch in batches:
            net(*shift_for_next_token(batch))[1].backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
                      if library else net.full_state_dict())
    return tuple(states)
# --8<-- [end:zero3-worker]
# --8<-- [end:two-process-worker]


def two_process_and_command_line_worker(rank, world_size, tmp, second_port):
    seen = two_process_worker(rank, world_size, tmp)
    # Last: the command line ends by destroying the process group.
    seen["command line"] = command_line_worker(rank, world_size, command_line_argv(tmp),
                                               second_port)
    return seen


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    from snippets.dist import free_port

    tmp = tmp_path_factory.mktemp("fsdp")
    return spawn(two_process_and_command_line_worker, 2, str(tmp), free_port(),
                 timeout_s=TIMEOUT_S), tmp


@pytest.fixture(scope="module")
def reference():
    return single_process()


# --8<-- [start:equals-single-process]
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_every_strategy_equals_single_process_adamw(two_processes, reference, strategy):
    ranks, _ = two_processes
    zeros = {n: torch.zeros_like(m) for n, m in reference["moments"].items()}
    for rank in ranks:
        assert_close(rank[strategy]["state"], reference["state"], strategy)
        # AdamW's update hides a gradient twice too large, and so does clipping it to norm 1
        # (grad_clip): the moments then agree too. The norm before clipping does not.
        assert rank[strategy]["grad_norms"] == pytest.approx(reference["grad_norms"],
                                                             rel=MOMENTS_REL)
        assert_close(rank[strategy]["moments"], reference["moments"], f"{strategy} exp_avg",
                     start=zeros, rel=MOMENTS_REL)
    # The loss each step reports is the global batch's: the mean of the two ranks' losses.
    assert ranks[0][strategy]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
# --8<-- [end:equals-single-process]


# --8<-- [start:storage]
def test_each_rank_stores_one_nth_of_the_parameters(two_processes):
    ranks, _ = two_processes
    total = GPT(MODEL).num_parameters()
    for rank in ranks:
        assert rank["FULL_SHARD"]["stored"] == total // 2   # every dim 0 here is even
        assert rank["SHARD_GRAD_OP"]["stored"] == total // 2
        assert rank["NO_SHARD"]["stored"] == total           # a replica, as in DDP
# --8<-- [end:storage]


# --8<-- [start:checkpoints]
def test_full_checkpoint_is_a_plain_gpt_state_dict(two_processes, reference):
    ranks, tmp = two_processes
    state = torch.load(tmp / "ckpt.pt", weights_only=True)
    after_two_steps = reference["after two steps"]["state"]
    assert list(state["model"]) == list(after_two_steps)
    assert_close(state["model"], after_two_steps, "full checkpoint")
    plain = GPT(MODEL)
    plain.load_state_dict(state["model"])  # strict: every key, every full shape
    assert state["step"] == 2
    # AdamW's first moments, gathered by name (the bound: MOMENTS_REL).
    expected = reference["after two steps"]["optimizer"]
    moments = {n: s["exp_avg"] for n, s in state["optimizer"]["state"].items()}
    assert set(moments) == set(expected["state"]) and "embed_tokens.weight" in moments
    assert_close(moments, {n: s["exp_avg"] for n, s in expected["state"].items()},
                 "AdamW exp_avg", start={n: torch.zeros_like(m) for n, m in moments.items()},
                 rel=MOMENTS_REL)


def test_resuming_either_checkpoint_continues_identically(two_processes):
    ranks, _ = two_processes
    for rank in ranks:
        for kind in ("full", "sharded"):
            # Exact: the same shards, AdamW moments and batches as the unbroken run.
            for name, value in rank["unbroken"].items():
                assert torch.equal(rank[f"resumed {kind}"][name], value), (kind, name)
# --8<-- [end:checkpoints]


# --8<-- [start:bf16]
def test_bf16_computes_in_bf16_and_keeps_fp32_shards(two_processes, reference):
    ranks, _ = two_processes
    weight_dtype, input_dtype = ranks[0]["bf16 computed in"]
    assert weight_dtype == input_dtype == torch.bfloat16
    assert ranks[0]["bf16 stored as"] == {torch.float32} and ranks[0]["bf16 sharded"]
    # bf16 keeps 8 significant bits (~0.4% per value): the losses follow fp32's closely but
    # not exactly, at most 2.2e-3 apart in these 3 steps (measured); 2e-2 allows ten times
    # that. Identical losses would mean the policy was ignored.
    fp32_losses = ranks[0]["FULL_SHARD"]["losses"]
    assert ranks[0]["bf16 losses"] == pytest.approx(fp32_losses, abs=2e-2)
    assert ranks[0]["bf16 losses"] != fp32_losses


def test_cpu_offload_trains_the_same(two_processes):
    ranks, _ = two_processes
    # On a CPU-only machine the shards already live in CPU memory: offloading changes where
    # the optimizer step runs (nowhere new here), not the arithmetic, so the result is exact.
    for name, value in ranks[0]["FULL_SHARD"]["state"].items():
        assert torch.equal(ranks[0]["offload"][name], value), name
# --8<-- [end:bf16]


# --8<-- [start:zero3]
@pytest.mark.skipif(ZeRO3 is None, reason="snippets/scratch/zero.py (ZeRO-3 from scratch) "
                                          "is not there yet")
def test_fully_shard_equals_zero3_from_scratch_bit_for_bit(two_processes):
    ranks, _ = two_processes
    for rank in ranks:
        library, scratch = rank["fully_shard vs ZeRO3"]
        # Exact, not close: with two ranks every reduce-scatter adds two numbers (a + b is
        # b + a), halving is exact, and AdamW then does the same elementwise arithmetic on the
        # same shard values. Any difference at all is a real one.
        for name, value in scratch.items():
            assert torch.equal(library[name], value), name
# --8<-- [end:zero3]


# --8<-- [start:hybrid-worker]
def hybrid_worker(rank, world_size):
    # 4 ranks as 2 "nodes" of 2: shard within a node, replicate across nodes.
    trainer = FSDPTrainer(MODEL, train_config(world_size),
                          FSDPConfig("HYBRID_SHARD", shard_group_size=2))
    weight = trainer.model.embed_tokens.weight
    seen = {"mesh": (tuple(weight.device_mesh.shape), weight.device_mesh.mesh_dim_names),
            "placements": [repr(p) for p in weight.placements],
            "stored": trainer.local_parameter_count(), "losses": train(trainer, STEPS),
            "state": full_state(trainer)}
    try:
        FSDPTrainer(MODEL, train_config(world_size),
                    FSDPConfig("HYBRID_SHARD", shard_group_size=3))
    except ConfigError as err:  # raised on every rank before any collective
        seen["error"] = str(err)
    return seen
# --8<-- [end:hybrid-worker]


# --8<-- [start:hybrid]
def test_hybrid_sharding_on_a_2x2_mesh_equals_single_process(reference):
    ranks = spawn(hybrid_worker, 4, timeout_s=TIMEOUT_S)
    expected = reference["state"]
    total = GPT(MODEL).num_parameters()
    for rank in ranks:
        assert rank["mesh"] == ((2, 2), ("replicate", "shard"))
        assert rank["placements"] == ["Replicate()", "Shard(dim=0)"]
        assert rank["stored"] == total // 2  # 1/2 per rank: sharded over the node's 2 ranks
        assert_close(rank["state"], expected, "HYBRID_SHARD")
        assert "shard_group_size=3, which does not divide 4" in rank["error"]
# --8<-- [end:hybrid]


def test_bad_settings_are_refused_with_the_valid_choices():
    with pytest.raises(ConfigError, match="is not one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
                                          "HYBRID_SHARD"):
        FSDPConfig(sharding_strategy="ZERO3")
    with pytest.raises(ConfigError, match="is not one of bf16, fp16, fp32"):
        FSDPConfig(mixed_precision="float16")
    with pytest.raises(ConfigError, match="fp16.* needs loss scaling"):
        FSDPTrainer(MODEL, train_config(1), FSDPConfig(mixed_precision="fp16"))


def command_line_worker(rank, world_size, argv, second_port):
    """fsdp_trainer's command line, twice in the same processes: train 2 steps, damage the
    newest checkpoint, resume. Returns the exit codes and rank 0's log of the resumed run."""
    import contextlib
    import io
    import os

    from snippets.training.fsdp_trainer import main

    codes = [main(argv)]  # main() ends by destroying the process group...
    out = argv[argv.index("--out") + 1]
    if rank == 0:
        os.remove(f"{out}/ckpt-00000002.dcp/.metadata")  # a damaged newest checkpoint
    os.environ["MASTER_PORT"] = str(second_port)  # ...so the second joins a new one
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        codes.append(main(argv + ["--resume"]))
    return codes, log.getvalue()


def command_line_argv(tmp) -> list[str]:
    return ["--model_size", "tiny", "--data", "dummy", "--batch_size", "2", "--seq_len", "16",
            "--device", "cpu", "--checkpoint", "sharded", "--ckpt_every", "1", "--keep_last",
            "2", "--log_every", "100", "--max_steps", "2", "--out", f"{tmp}/command-line"]


def test_command_line_writes_step_numbered_dcp_checkpoints_and_skips_a_damaged_one(
        two_processes):
    ranks, tmp = two_processes
    out = tmp / "command-line"
    assert [rank["command line"][0] for rank in ranks] == [[0, 0], [0, 0]]
    # The damaged step-2 directory was skipped (one warning line on each rank's stderr),
    # step 2 trained again from step 1 and written again, whole; no temp directory is left.
    assert f"resumed from {out / 'ckpt-00000001.dcp'} at step 1" in ranks[0]["command line"][1]
    assert sorted(p.name for p in out.iterdir()) == [
        "ckpt-00000001.dcp", "ckpt-00000002.dcp", "latest"]
    assert (out / "ckpt-00000002.dcp" / ".metadata").is_file()
    assert (out / "latest").read_text() == "ckpt-00000002.dcp\n"


def test_one_process_run_ends_cleanly_without_a_launcher(tmp_path, monkeypatch):
    """`python snippets/training/fsdp_trainer.py` makes a process group of one for the mesh; it
    used to end with leave_process_group's LaunchError (exit 2) after training."""
    import torch.distributed as dist

    from snippets.training import fsdp_trainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert fsdp_trainer.main(["--model_size", "tiny", "--max_steps", "1",
                              "--out", str(tmp_path / "run")]) in (0, None)
    assert not dist.is_initialized()
