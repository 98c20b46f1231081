"""Ring attention against one process's F.scaled_dot_product_attention: from scratch on 2 and 4
ranks, and PyTorch's own ring (below its public API, which fails on CPU), on gloo; bytes sent
per rank against the formula and the planner's CP term; saved activations per rank against
the formula, one process and the planner; a missing neighbour fails within the timeout.

Each world size is spawned once (a module-scoped fixture) and every test reads its results."""

import time
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

from snippets.dist import spawn
from snippets.library.context_parallel import library_ring_attention, public_api_error
from snippets.planner import cost_model as cm
from snippets.scratch.context_parallel import (
    Ring,
    RingAttention,
    block_scores,
    causal_scores_per_rank,
    ring_bytes_per_rank,
    saved_bytes_per_rank,
    shard_sequence,
    unshard_sequence,
)

BATCH, HEADS, SEQ, HEAD_DIM = 2, 2, 32, 8


def inputs():
    """q, k, v and the gradient of the output, (B, heads, T, head_dim)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=g) for _ in range(4)]


# --8<-- [start:bound]
def fp32_error_bounds(q, k, v, d_out, world_size: int) -> list[float]:
    """How far ring attention's output, dQ, dK and dV may lie from one process's, in fp32.

    Both compute the same sums in different orders, so neither is exact. With u = 2^-24 (fp32
    rounding), a sum of n products is off by at most about n*u times the sum of the terms'
    absolute values (Higham, Accuracy and Stability of Numerical Algorithms, section 3.1). Per
    query row, along the chain:
    - a score s = q.k / sqrt(D) sums D products: off by D*u*S, S the largest |q|.|k| / sqrt(D);
    - lse = log(sum of T exps) is off by that, plus T*u from the sum, plus u per exp and log;
    - p = exp(s - lse): an error e in the exponent is a relative error e in p; the subtraction
      rounds once more, by u*|s - lse| <= u*2S: p is off by u*(2DS + 2S + T + 2), relatively;
    - out = sum_j p_j v_j adds T*u; each of the N-1 ring merges about 5u (logaddexp, exp, *, +);
    - backward adds one D-term sum (dP = dO.v, and the row term dO.out) and one T-term sum
      (over keys for dQ, over queries for dK and dV).
    So each result is off by at most eps = u*(2DS + 2S + 3T + 2D + 5N + 10) times the sum of
    its terms' absolute values, M below; the two implementations differ by at most twice
    that. Worst-case bounds grow with n where typical rounding grows with sqrt(n), so the
    observed difference sits far below; a mistake (a wrong mask, a missing block) is off by
    the size of the values themselves.
    """
    q, k, v, d_out = (t.double() for t in (q, k, v, d_out))
    head_dim, seq_len = q.shape[-1], q.shape[-2]
    scale = head_dim ** -0.5
    big_s = (q.abs() @ k.abs().transpose(-2, -1)).max().item() * scale
    u = 2.0 ** -24
    eps = u * (2 * head_dim * big_s + 2 * big_s + 3 * seq_len + 2 * head_dim
               + 5 * world_size + 10)
    p = torch.exp(block_scores(q, k, causal=True) - block_scores(q, k, True).logsumexp(-1, True))
    out = p @ v
    # |terms| of dS_ij = p_ij (dO_i.v_j - dO_i.out_i): the two dot products' absolute sums
    abs_ds = p * (d_out.abs() @ v.abs().transpose(-2, -1) + (d_out * out).abs().sum(-1, True))
    magnitudes = [p @ v.abs(), scale * abs_ds @ k.abs(),
                  scale * abs_ds.transpose(-2, -1) @ q.abs(), p.transpose(-2, -1) @ d_out.abs()]
    return [2 * eps * m.max().item() for m in magnitudes]  # out, dQ, dK, dV
# --8<-- [end:bound]


# --8<-- [start:saved-bytes]
def saved_bytes(fn, *args) -> int:
    """Bytes autograd saves for backward while fn(*args) runs, once per storage."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args)
    return sum(storages.values())
# --8<-- [end:saved-bytes]


def scratch(rank, world_size):
    q, k, v, d_out = inputs()
    ring = Ring()
    mine = [shard_sequence(t, rank, world_size).requires_grad_() for t in (q, k, v)]
    out = RingAttention.apply(*mine, ring)
    out.backward(shard_sequence(d_out, rank, world_size))
    saved = saved_bytes(RingAttention.apply, *mine, Ring())
    return {"out": out.detach(), "grads": [t.grad for t in mine], "sent": dict(ring.bytes_sent),
            "messages": dict(ring.messages), "scores": dict(ring.scores),
            "overlapped": dict(ring.overlapped), "saved": saved}


def library(rank, world_size):
    q, k, v, d_out = inputs()
    return library_ring_attention(*(shard_sequence(t, rank, world_size) for t in (q, k, v, d_out)))


def missing_neighbour(rank):
    """Rank 1 never answers; rank 0's pass must fail within the ring's timeout."""
    if rank == 1:
        # Stay alive well past rank 0's timeout, so it is the timeout that fires, not the
        # connection closing: rank 0 may start its pass a second or more after rank 1 under load.
        time.sleep(5.0)
        return None
    ring, start = Ring(timeout=timedelta(seconds=0.3)), time.monotonic()
    try:
        ring.wait(ring.start_pass(torch.ones(4), "forward")[1])
    except RuntimeError as err:
        return time.monotonic() - start, str(err)
    return None


def bad_length_message():
    try:
        shard_sequence(torch.zeros(1, 1, 30, 1), 0, 4)
    except ValueError as e:
        return str(e)
    return "no error"


def two_rank_worker(rank, world_size):
    return {"scratch": scratch(rank, world_size), "library": library(rank, world_size),
            "public_api": public_api_error(*inputs()[:3]), "bad_length": bad_length_message(),
            "missing": missing_neighbour(rank)}  # last: it leaves a send unanswered


def four_rank_worker(rank, world_size):
    return {"scratch": scratch(rank, world_size), "library": library(rank, world_size)}


@pytest.fixture(scope="module")
def single_process():
    q, k, v, d_out = inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(d_out)
    saved = saved_bytes(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), *leaves)
    return {"results": [out.detach(), *(t.grad for t in leaves)], "saved": saved}


@pytest.fixture(scope="module")
def ranks():
    """world size -> each rank's results; each world spawned once for all tests below."""
    return {2: spawn(two_rank_worker, 2, timeout_s=60),
            4: spawn(four_rank_worker, 4, timeout_s=60)}


# --8<-- [start:tests-equal]
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_forward_and_backward_equal_one_process(ranks, single_process, world_size):
    results = [r["scratch"] for r in ranks[world_size]]
    got = [unshard_sequence([r["out"] for r in results]),
           *(unshard_sequence([r["grads"][i] for r in results]) for i in range(3))]
    # Derived in fp32_error_bounds' docstring: a few units of fp32 rounding (u = 6e-8) per
    # term of each sum on the way from scores to gradients, times the size of those terms.
    bounds = fp32_error_bounds(*inputs(), world_size)
    for name, a, b, bound in zip(("output", "dQ", "dK", "dV"), got, single_process["results"],
                                 bounds):
        assert a.shape == b.shape
        worst = (a - b).abs().max().item()
        assert worst <= bound, f"{name}: differs by {worst:.2e}, bound {bound:.2e}"
# --8<-- [end:tests-equal]


# --8<-- [start:tests-library]
@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_ring_attention_equals_ours_and_one_process(ranks, single_process, world_size):
    library = [unshard_sequence([r["library"][i] for r in ranks[world_size]]) for i in range(4)]
    ours = [unshard_sequence([r["scratch"]["out"] for r in ranks[world_size]]),
            *(unshard_sequence([r["scratch"]["grads"][i] for r in ranks[world_size]])
              for i in range(3))]
    # Its per-block kernel is the CPU flash kernel instead of our matmuls: the same sums in
    # yet another order, so the same bound applies between any two of the three.
    bounds = fp32_error_bounds(*inputs(), world_size)
    for theirs, mine, expected, bound in zip(library, ours, single_process["results"], bounds):
        assert (theirs - expected).abs().max().item() <= bound
        assert (theirs - mine).abs().max().item() <= bound


def test_the_public_api_does_not_run_on_cpu(ranks):
    for r in ranks[2]:  # DTensor has no rule for the CPU kernel (see the lesson page)
        assert r["public_api"] == (
            "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu"
            ".default does not have a sharding strategy registered.")
# --8<-- [end:tests-library]


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_k_v_pass_moves_while_a_block_is_computed(ranks, world_size):
    """The page's claim that the transfer hides behind the attention work, as a property of the
    order: every K/V pass, forward and backward, is waited on only after a block's scores were
    computed since it started (a pass waited on at once would not count). The gradients'
    passes in backward are waited on at once, as the page says (its exercise changes that)."""
    hops = world_size - 1
    for r in ranks[world_size]:
        assert r["scratch"]["overlapped"].get("forward", 0) == hops
        assert r["scratch"]["overlapped"].get("backward", 0) == hops  # of 2 x hops passes
        assert r["scratch"]["messages"]["backward"] == 2 * hops


# --8<-- [start:tests-bytes]
@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_sent_per_rank_match_the_formula_and_the_planner(ranks, world_size, monkeypatch):
    theory = ring_bytes_per_rank(BATCH, HEADS, SEQ, HEAD_DIM, world_size)
    for r in ranks[world_size]:
        for phase, (messages, sent) in theory.items():
            assert (r["scratch"]["messages"][phase], r["scratch"]["sent"][phase]) == (
                messages, sent), phase
    # The planner prices one K/V message per hop and 3(cp-1) hops per layer (forward and
    # backward together). Record the message it prices for our shapes.
    priced = []
    monkeypatch.setattr(cm, "send_recv_time", lambda size, link: priced.append(size) or 0.0)
    model = {**cm.MODELS["tiny"], "hidden_size": HEADS * HEAD_DIM, "num_attention_heads": HEADS,
             "num_key_value_heads": HEADS}
    plan = dict(dp=1, tp=1, pp=1, zero_stage=0, precision="fp32", recompute=False,
                micro_batch_size=BATCH, micro_batches=1, seq_len=SEQ, schedule="1f1b", mfu=0.5,
                cp=world_size, cp_overlap=False)
    cm.plan_training(model, plan, next(iter(cm.CLUSTERS.values())))
    message = theory["forward"][1] // (world_size - 1)
    assert priced == [message]
    assert theory["forward"][1] + theory["backward"][1] == 3 * (world_size - 1) * message
# --8<-- [end:tests-bytes]


# --8<-- [start:tests-memory]
@pytest.mark.parametrize("world_size", [2, 4])
def test_saved_activations_per_rank_match_formula_one_process_and_planner(
        ranks, single_process, world_size):
    formula = saved_bytes_per_rank(BATCH, HEADS, SEQ, HEAD_DIM, world_size)
    # The planner's attention share of a block: q, k, v, the output (4h elements) and one
    # fp32 softmax statistic per head, per token. Read it off activation_bytes_per_layer with
    # no MLP (intermediate_size 0); it divides the share by tp, so twice the drop from tp=1
    # to tp=2 is the share alone.
    model = {**cm.MODELS["tiny"], "hidden_size": HEADS * HEAD_DIM, "num_attention_heads": HEADS,
             "num_key_value_heads": HEADS, "intermediate_size": 0}
    plan = dict(precision="fp32", recompute=False, micro_batch_size=BATCH, seq_len=SEQ,
                cp=world_size, sp=False)
    planner = 2 * (cm.activation_bytes_per_layer(model, {**plan, "tp": 1})
                   - cm.activation_bytes_per_layer(model, {**plan, "tp": 2}))
    for r in ranks[world_size]:
        assert r["scratch"]["saved"] == formula == planner
        # what SDPA saves on one process (the same tensors for all T tokens), split N ways
        assert r["scratch"]["saved"] * world_size == single_process["saved"]
# --8<-- [end:tests-memory]


# --8<-- [start:tests-balance]
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_computes_the_same_number_of_scores(ranks, world_size):
    computed = [r["scratch"]["scores"]["forward"] for r in ranks[world_size]]
    assert len(set(computed)) == 1
    needed = causal_scores_per_rank(SEQ, world_size, balanced=True)
    assert len(set(needed)) == 1 and sum(needed) == SEQ * (SEQ + 1) // 2
    # Computed beyond the need: step 0 scores my 2c tokens against each other (4c^2), and
    # masks the early chunk's queries against the late chunk's keys (c^2) and the upper
    # triangles of the two diagonal blocks (c(c-1)); every later step is all needed.
    c = SEQ // (2 * world_size)
    assert computed[0] // (BATCH * HEADS) - needed[0] == c * c + c * (c - 1)
    contiguous = causal_scores_per_rank(SEQ, world_size, balanced=False)
    assert sum(contiguous) == sum(needed) and contiguous == sorted(set(contiguous))
# --8<-- [end:tests-balance]


def test_a_missing_neighbour_fails_within_the_timeout(ranks):
    took, message = ranks[2][0]["missing"]
    # 0.3 s timeout; under 3 s, so before rank 1 (asleep for 5 s) could have closed the connection
    assert took < 3.0 and "Timed out" in message


def test_a_sequence_that_does_not_divide_is_a_clear_error(ranks):
    assert ranks[2][0]["bad_length"] == "sequence length 30 does not divide into 2 x 4 chunks"
