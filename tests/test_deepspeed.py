"""DeepSpeed ZeRO 1, 2, 3 and 3 + CPU offload on 2 CPU processes (gloo) against one process
training on the same global batches; DeepSpeed's memory estimators against the formulas; a ZeRO-3
checkpoint consolidated with zero_to_fp32 into a plain GPT."""

import shutil

import pytest
import torch

from snippets.cluster.deepspeed.consolidate import consolidate_zero_checkpoint
from snippets.cluster.deepspeed.memory_estimates import (SEVEN_B, count_params,
                                                         deepspeed_estimates,
                                                         deepspeed_estimator_bytes,
                                                         zero_paper_bytes)
from snippets.cluster.deepspeed.train_deepspeed import (STAGES, global_batches, load_ds_config,
                                                        train, zero_groups_with_timeout)
from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config, shift_for_next_token

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and not torch.cuda.is_available(),
    reason="DeepSpeed's CPU accelerator JIT-compiles a C++ op at start-up: install g++")

STEPS, CONTEXT = 3, 32


# --8<-- [start:worker]
def deepspeed_worker(rank, world_size, checkpoint_dir):
    """Train once per config in the same two processes; return losses and the full weights."""
    import deepspeed

    results = {}
    for name in STAGES:
        engine, losses = train(load_ds_config(name), STEPS, CONTEXT, log=lambda *_: None)
        params = list(engine.module.parameters())
        # ZeRO-3 leaves each rank only its shard of every parameter: gather them to compare.
        with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
            weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        results[name] = {
            "losses": losses, "weights": weights, "stage": engine.zero_optimization_stage(),
            # Outside a gather a ZeRO-3 parameter is an empty placeholder; its shard is ds_tensor.
            "visible_numel": sum(p.numel() for p in params),
            "shard_numel": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
                               for p in params)}
        if name == "zero3":
            engine.save_checkpoint(checkpoint_dir, tag="final")
    return results
# --8<-- [end:worker]


def worker_with_a_timeout(rank, world_size, checkpoint_dir):
    """The worker, with ZeRO's group made first with a timeout, as train_deepspeed's main does
    with --timeout; also returns the timeout the group that ZeRO used really has."""
    from deepspeed.utils import groups

    zero_groups_with_timeout(7)
    results = deepspeed_worker(rank, world_size, checkpoint_dir)
    backend = groups._get_data_parallel_group()._get_backend(torch.device("cpu"))
    return {**results, "zero group timeout": backend.options._timeout.total_seconds()}


# --8<-- [start:reference]
def single_process_reference():
    """Plain PyTorch on the whole global batch, with the configs' optimizer and clipping."""
    config = load_ds_config("zero1")
    opt = config["optimizer"]["params"]
    torch.manual_seed(0)
    model = GPT(get_config("tiny", max_position_embeddings=CONTEXT))
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=opt["betas"],
                                  eps=opt["eps"], weight_decay=opt["weight_decay"])
    losses = []
    global_batch = config["train_micro_batch_size_per_gpu"] * 2
    for batch in global_batches(STEPS, global_batch, CONTEXT):
        _, loss = model(*shift_for_next_token(batch))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["gradient_clipping"])
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
# --8<-- [end:reference]


# --8<-- [start:test-stages]
@needs_compiler
def test_zero_stages_match_single_process_and_checkpoint_consolidates(tmp_path):
    ref_losses, ref_weights = single_process_reference()
    ranks = spawn(worker_with_a_timeout, 2, str(tmp_path), timeout_s=120)
    assert [r["zero group timeout"] for r in ranks] == [7, 7]  # not torch's 30-minute default
    total = sum(p.numel() for p in ref_weights.values())
    for name in STAGES:
        got = ranks[0][name]
        # Tolerance 1e-5 relative: the same fp32 math, but the gradient is a mean of two
        # half-batch means summed by gloo, and clipping computes the norm from shards, so
        # results differ in the last bits. A wrong average or a lost shard moves the loss
        # by far more (a step of Adam at lr 3e-3 changes it by ~0.2).
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), name
        assert ranks[1][name]["losses"] == got["losses"], name
        for n, w in ref_weights.items():
            torch.testing.assert_close(got["weights"][n], w, rtol=1e-4, atol=1e-5, msg=n)
        # The parameters each rank holds: all of them for stages 1-2; for stage 3 only its
        # half (each tensor's shard is padded to divide by 2: a few elements more).
        if got["stage"] < 3:
            assert got["visible_numel"] == got["shard_numel"] == total, name
        else:
            assert got["visible_numel"] == 0, name
            assert total / 2 <= got["shard_numel"] <= total / 2 + len(ref_weights), name

    # zero_to_fp32: merge the two ranks' fp32 shards of the ZeRO-3 checkpoint into a plain GPT.
    plain = consolidate_zero_checkpoint(tmp_path, tag="final", context=CONTEXT)
    for n, p in plain.named_parameters():  # every parameter came from the checkpoint, exactly
        assert torch.equal(p, ranks[0]["zero3"]["weights"][n]), n
# --8<-- [end:test-stages]


# --8<-- [start:test-estimators]
@pytest.mark.parametrize("gpus_per_node,nodes", [(8, 1), (8, 2), (4, 16)])
def test_memory_estimators_follow_the_zero_formulas(gpus_per_node, nodes):
    total, largest = SEVEN_B["total_params"], SEVEN_B["largest_layer_params"]
    est = deepspeed_estimates(total, largest, gpus_per_node, nodes)
    n = gpus_per_node * nodes
    assert est["zero2_gpu"] == deepspeed_estimator_bytes(total, n, 2)
    assert est["zero3_gpu"] == deepspeed_estimator_bytes(total, n, 3, largest)
    # DeepSpeed counts 4 bytes more per sharded parameter than the paper (an fp32 gradient
    # partition), so it is above the paper by exactly 4P/N for stage 2, and 4P/N + the
    # gathered largest layer - the 16-bit parameter shard 2P/N for stage 3.
    assert est["zero2_gpu"] - zero_paper_bytes(total, n, 2) == pytest.approx(4 * total / n, abs=1)
    assert est["zero3_gpu"] - zero_paper_bytes(total, n, 3) == pytest.approx(
        4 * largest + 2 * total / n, abs=1)
    assert "per GPU" in est["tables"] and "offload_param" in est["tables"]


def test_parameter_count_counts_tied_embedding_once():
    model = GPT(get_config("tiny"))
    total, largest = count_params(model)
    assert total == model.num_parameters()  # GPT.num_parameters() also counts unique tensors
    assert largest == max(p.numel() for p in model.parameters())
# --8<-- [end:test-estimators]


def test_a_path_with_a_space_is_refused_before_the_build(monkeypatch, tmp_path):
    """A learner's checkout in "my course" broke `make`'s install step: PyTorch's extension
    builder links with -L<torch/lib> unquoted. One line names the cause and the fix instead."""
    from snippets.cluster.deepspeed import train_deepspeed

    monkeypatch.setattr(train_deepspeed, "torch_lib_dir", lambda: tmp_path / "my course" / "lib")
    with pytest.raises(RuntimeError, match=r"a path with a space.*VENV=\$HOME/\.venvs/course"):
        train_deepspeed.main(["--prebuild-ops"])


def test_a_run_refuses_an_earlier_checkpoint_of_as_many_steps_before_starting(tmp_path):
    from snippets.cluster.deepspeed import train_deepspeed
    from snippets.training.checkpoint import RunExistsError

    (tmp_path / "step5").mkdir()
    (tmp_path / "step5" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"earlier")
    # Refused before any process group starts (no launcher environment is needed to get here).
    with pytest.raises(RunExistsError, match="an earlier run left .*step5: pass another "
                                             "--save-dir to keep it, or --overwrite"):
        train_deepspeed.main(["--steps", "5", "--save-dir", str(tmp_path)])
    assert (tmp_path / "step5" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()


def test_consolidate_refuses_to_replace_model_pt_and_reports_a_missing_checkpoint(tmp_path,
                                                                                 capsys):
    from snippets.cluster.deepspeed.consolidate import main

    (tmp_path / "model.pt").write_bytes(b"the learner's")
    for argv, message in [([str(tmp_path)], "model.pt exists: pass --overwrite"),
                          ([str(tmp_path / "none"), "--overwrite"], "error: ")]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 1 and message in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "model.pt").read_bytes() == b"the learner's"
