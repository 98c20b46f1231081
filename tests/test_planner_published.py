"""The scale planner against published formulas and published training runs. Pure arithmetic.

Sources:
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198): section 4 and Table 2, activation memory per layer; section 4.2.3, the
  interleaved schedule's activations.
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (arXiv:2104.04473): section 2.2.2, the interleaved bubble; Table 1, GPT models
  from 1.7B to 1T on A100 80GB; section 5.1 and Appendix, eq. (3), the FLOPs it counts.
- Llama Team 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783): section 3.3.2 and Table 4,
  the 405B layouts on 8,192 and 16,384 H100s.
- DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv:2412.19437): abstract (671B total,
  37B active), section 1 (180K H800 GPU hours per trillion tokens on 2048 H800s), section 3.2
  (16-way PP, 64-way EP over 8 nodes, ZeRO-1 DP, no TP), 3.2.1 (DualPipe hides the all-to-alls),
  3.2.2 (NVLink 160 GB/s, InfiniBand 50 GB/s), 4.2 (shapes; 4K sequences, batch 15360).
"""

import subprocess
import sys

import pytest

from snippets.planner import cost_model as cm
from tests.test_facts import stated

pytestmark = pytest.mark.kernel_independent("pure Python arithmetic, no tensor op")

H100 = cm.CLUSTERS["H100 SXM, 8 per node, InfiniBand 400 Gb/s"]
A100 = cm.CLUSTERS["A100 SXM 80GB, 8 per node, InfiniBand 200 Gb/s"]

# The one assumption behind every MFU prediction below: while a matmul runs it reaches this
# fraction of the GPU's dense bf16 peak. The same value for every layout of both papers; the
# planner then predicts what the bubble, communication and recomputation leave of it.
KERNEL_EFFICIENCY = 0.6


def gpt3(hidden, heads, layers, vocab=51200, seq=2048):
    """A GPT-3 style model as Megatron-LM builds it: 4h GELU MLP, learned positions, tied
    embeddings, multi-head attention."""
    return {"architecture": "gpt3", "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads,
            "tie_word_embeddings": True, "max_position_embeddings": seq}


def plan(**overrides):
    base = dict(dp=1, tp=1, pp=1, zero_stage=0, precision="bf16", recompute="none",
                micro_batch_size=1, micro_batches=1, seq_len=2048, schedule="1f1b",
                mfu=KERNEL_EFFICIENCY)
    return {**base, **overrides}


# --8<-- [start:korthikanti]
@pytest.mark.parametrize("case", ["none", "tp", "tp+selective", "tp+sp", "tp+sp+selective",
                                  "full"])
def test_activation_memory_per_layer_is_korthikanti_table_2(case):
    """Korthikanti et al. 2022, Table 2 (section 4, eq. 1-6): bytes per layer with 16-bit
    activations and 1-byte dropout masks, for their GPT-3 175B (a = 96, h = 12288, s = 2048),
    micro-batch b = 4 and t = 8. Exact: the planner counts the same tensors."""
    a, h, s, b, t = 96, 12288, 2048, 4, 8
    model = gpt3(h, a, 96)
    sbh = s * b * h
    expected, settings = {
        "none": (sbh * (34 + 5 * a * s / h), dict(tp=1)),
        "tp": (sbh * (10 + 24 / t + 5 * a * s / (h * t)), dict(tp=t)),
        "tp+selective": (sbh * (10 + 24 / t), dict(tp=t, recompute="selective")),
        "tp+sp": (sbh / t * (34 + 5 * a * s / h), dict(tp=t, sp=True)),
        "tp+sp+selective": (sbh * 34 / t, dict(tp=t, sp=True, recompute="selective")),
        "full": (2 * sbh, dict(tp=t, recompute="full")),
    }[case]
    got = cm.activation_bytes_per_layer(model, plan(micro_batch_size=b, seq_len=s, **settings))
    assert got == pytest.approx(expected, rel=1e-12)
# --8<-- [end:korthikanti]


def test_interleaved_schedule_bubble_and_activations():
    """Narayanan et al. 2021, section 2.2.2: with v model chunks per rank the bubble is
    (p - 1)/(v m) of the ideal step. Korthikanti et al. 2022, section 4.2.3: the first stage
    then holds p(1 + (p - 1)/(p v)) micro-batches' worth of its layers' activations."""
    model = cm.MODELS["llama-70b"]  # 80 layers: 4 stages x 4 chunks of 5
    p, m = 4, 16
    for v in (1, 2, 4):
        r = cm.plan_training(model, plan(dp=2, tp=8, pp=p, micro_batches=m, virtual_stages=v,
                                         seq_len=4096), H100)
        t = r["time_s"]
        ideal = t["compute"] + t["tensor_parallel"] + t["context_parallel"] + t["pipeline_p2p"]
        assert t["step"] - t["data_parallel_exposed"] == pytest.approx(ideal + t["bubble"])
        assert t["bubble"] / ideal == pytest.approx((p - 1) / (v * m))
        assert cm.micro_batches_in_flight(plan(pp=p, micro_batches=m, virtual_stages=v), 0) == \
            pytest.approx(p if v == 1 else p * (1 + (p - 1) / (p * v)))


def test_sequence_parallel_moves_the_same_bytes_and_shards_the_rest():
    """Korthikanti et al. 2022, section 4.2.2: an all-reduce is a reduce-scatter plus an
    all-gather, so sequence parallelism costs no extra communication."""
    model = cm.MODELS["llama-70b"]
    off = cm.plan_training(model, plan(dp=4, tp=8, micro_batches=4, seq_len=4096), H100)
    on = cm.plan_training(model, plan(dp=4, tp=8, micro_batches=4, seq_len=4096, sp=True), H100)
    assert on["time_s"]["tensor_parallel"] == pytest.approx(off["time_s"]["tensor_parallel"])
    assert on["memory_bytes"]["activations"] < off["memory_bytes"]["activations"] / 2


def test_context_parallel_shards_tokens_and_pays_ring_attention_traffic():
    model = cm.MODELS["llama-70b"]
    one = plan(dp=2, tp=8, seq_len=32768)
    four = plan(dp=2, tp=8, seq_len=32768, cp=4)
    assert cm.activation_bytes_per_layer(model, four) == pytest.approx(
        cm.activation_bytes_per_layer(model, one) / 4)
    exposed = cm.plan_training(model, four, H100)
    serial = cm.plan_training(model, {**four, "cp_overlap": False}, H100)
    assert exposed["gpus"] == 64
    # Per layer: 3 x (cp - 1) sends of a K+V chunk, 2 x 8192 tokens x 1024 (8 kv heads) / tp.
    chunk = 2 * 8192 * 1024 / 8 * 2
    link = cm.link(H100, True)  # tp x cp = 32 GPUs: across nodes
    assert serial["time_s"]["context_parallel"] == pytest.approx(
        80 * 3 * 3 * cm.send_recv_time(chunk, link))
    assert exposed["time_s"]["context_parallel"] < serial["time_s"]["context_parallel"]


def test_zero_traffic_per_micro_batch_under_gradient_accumulation():
    """ZeRO-1 synchronises once per step; ZeRO-2 reduce-scatters every micro-batch's gradients
    (only a shard is kept); ZeRO-3 also all-gathers the weights in every forward and backward."""
    model = cm.MODELS["llama-7b"]
    time = {stage: cm.plan_training(model, plan(dp=8, zero_stage=stage, micro_batches=4),
                                    H100)["time_s"]["data_parallel"] for stage in (0, 1, 2, 3)}
    all_reduce = time[0]
    assert time[1] == pytest.approx(all_reduce)
    assert time[2] == pytest.approx((4 + 1) / 2 * all_reduce)  # 4 reduce-scatters, 1 all-gather
    assert time[3] == pytest.approx(4 * 1.5 * all_reduce)  # per micro-batch: 1 RS + 2 AG


def test_flop_conventions_and_mfu():
    model = cm.MODELS["llama-70b"]
    p = plan(dp=128, tp=8, micro_batches=8, seq_len=4096)
    with_attention = cm.model_flops_per_token(model, p)
    assert with_attention - cm.model_flops_per_token(model, {**p, "flops": "matmuls"}) == \
        12 * 80 * 4096 * 8192
    assert cm.model_flops_per_token(model, {**p, "flops": "6N"}) == 6 * cm.parameter_count(model)
    r = cm.plan_training(model, p, H100)
    assert r["model_flops_utilization"] == pytest.approx(
        with_attention * r["tokens_per_s"] / (1024 * 989e12))
    # Recomputation costs time, but MFU counts the model's FLOPs only.
    full = cm.plan_training(model, {**p, "recompute": "full"}, H100)
    assert full["model_flops_utilization"] < r["model_flops_utilization"]


def test_the_issue_70b_layout_fits_with_sequence_parallelism():
    """Issue 15: Llama 70B, TP 8 x DP 128, ZeRO-1, 8 micro-batches of 4096 tokens, on 80 GB
    H100s. Without SP the replicated norm activations fill the GPU: 78.69 GB of tensors fit
    under 80 GB but not with the reserve on top; with SP it is 50.5 GB."""
    args = ["--model", "llama-70b", "--seq-len", "4096", "--dp", "128", "--tp", "8",
            "--zero-stage", "1", "--micro-batches", "8"]
    out = subprocess.run([sys.executable, "-m", "snippets.planner", *args, "--sp"],
                         capture_output=True, text=True, check=True).stdout
    assert "total             50.51 GB" in out
    assert "fits in 80 GB with 3 GB reserved (67%)" in out  # (50.51 + 3) / 80
    r = cm.plan_training(cm.MODELS["llama-70b"], plan(dp=128, tp=8, zero_stage=1,
                                                      micro_batches=8, seq_len=4096), H100)
    assert r["memory_bytes"]["total"] / 1e9 == pytest.approx(78.69, abs=0.005)
    assert not r["fits"] and r["memory_fraction"] == pytest.approx(81.69 / 80, abs=1e-4)


@pytest.mark.parametrize("flags, named", [(["--cp", "0"], "--cp"), (["--ep", "0"], "--ep"),
                                          (["--ep", "2"], "ep=2"),
                                          (["--model", "deepseek-v3", "--ep", "3"], "ep=3")])
def test_bad_cli_flags_are_refused_in_one_line(flags, named):
    out = subprocess.run([sys.executable, "-m", "snippets.planner", *flags],
                         capture_output=True, text=True)
    assert out.returncode != 0 and named in out.stderr and out.stderr.count("\n") <= 3


# --8<-- [start:megatron]
# Narayanan et al. 2021, Table 1 (page 8): parameters (billions), attention heads, hidden
# size, layers, tensor- and pipeline-parallel size, GPUs, batch size, and the teraFLOP/s per
# A100 they achieved. Vocabulary 51,200, sequence length 2048 (section 5.1).
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


@pytest.mark.parametrize("row", MEGATRON_TABLE_1, ids=lambda row: f"{row[0]}B")
def test_megatron_table_1_layouts_fit_and_mfu_is_within_1_3x(row):
    """Each layout fits in an A100's 80 GB and the planner's MFU is within a factor 1.3 of the
    reported one. The paper counts recomputation's FLOPs too (eq. 3: 96 B s l h^2 (1 + s/6h +
    V/16lh) per iteration, full recomputation in every run); MFU without them is the
    reported rate times 72 (1 + s/6h + V/12lh) / (96 (1 + s/6h + V/16lh)). Not in the
    table, so assumed: micro-batches of one sequence, plain 1F1B, no ZeRO (2021 Megatron)."""
    billions, heads, h, layers, tp, pp, gpus, batch, tflops = row
    s = 2048
    model = gpt3(h, heads, layers)
    assert cm.parameter_count(model) / 1e9 == pytest.approx(billions, abs=0.05)
    r, reported = megatron_run(row)
    assert r["gpus"] == gpus and r["tokens_per_step"] == batch * s
    assert r["fits"], r["memory_bytes"]["total"] / 1e9
    assert 1 / 1.3 < r["model_flops_utilization"] / reported < 1.3, \
        (r["model_flops_utilization"], reported)


def megatron_run(row):
    """The planner's run of a Table 1 row, and the reported MFU without recomputation's FLOPs."""
    billions, heads, h, layers, tp, pp, gpus, batch, tflops = row
    s, vocab = 2048, 51200
    dp = gpus // (tp * pp)
    r = cm.plan_training(gpt3(h, heads, layers),
                         plan(dp=dp, tp=tp, pp=pp, micro_batches=batch // dp, recompute="full"), A100)
    reported = (tflops / 312 * 72 * (1 + s / (6 * h) + vocab / (12 * layers * h))
                / (96 * (1 + s / (6 * h) + vocab / (16 * layers * h))))
    return r, reported
# --8<-- [end:megatron]


def test_one_kernel_efficiency_misses_the_trend_with_model_size():
    """The planner runs every matmul at one efficiency (`mfu`); real kernels get closer to peak
    as the matrices grow. Against Table 1 its MFU is too high for the small models and too low
    for the largest: a limit the calculator page states with these two ratios."""
    ratios = [r["model_flops_utilization"] / reported for r, reported in map(megatron_run, MEGATRON_TABLE_1)]
    assert ratios[0] > 1.2 and ratios[-1] < 1.0
    assert ratios[0] > ratios[3] > ratios[6] > ratios[-1]  # 1.7B > 18.4B > 145.6B > 1T
    [(line, (small, large))] = stated("reference/calculator.md",
                                      r"(\d\.\d\d)× the reported one for the 1\.7B model and (\d\.\d\d)× for the 1T model")
    assert (float(small), float(large)) == (round(ratios[0], 2), round(ratios[-1], 2)), f"docs/reference/calculator.md:{line}"
    [(line, (efficiency,))] = stated("reference/calculator.md", r"with `mfu` (0\.\d) there")
    assert float(efficiency) == KERNEL_EFFICIENCY, f"docs/reference/calculator.md:{line}"


# --8<-- [start:llama3]
# Llama 3 paper, Table 4 (section 3.3.2): the 405B runs on H100 80GB, TP 8 and PP 16, 16M tokens
# per batch: (CP, DP, sequence length, batch size per DP rank, BF16 MFU).
LLAMA3_TABLE_4 = [
    (1, 64, 8192, 32, 0.43),  # 8,192 GPUs, 430 TFLOP/s per GPU
    (1, 128, 8192, 16, 0.41),  # 16,384 GPUs, 400 TFLOP/s
    (16, 8, 131072, 16, 0.38),  # 16,384 GPUs, 380 TFLOP/s, long-context stage
]


def llama3_layout(cp, dp, seq_len, micro_batches):
    """The 126-layer model on Table 4's layout, with what section 3.3.2 states: the first and
    last stage one layer short (the planner's default split for 126 layers on 16 stages), no
    activation checkpointing ("we could pre-train Llama 3 on sequences of 8K tokens without
    activation checkpointing"), and FSDP sharding optimizer state and gradients but keeping the
    weights gathered between forward and backward (the planner's ZeRO-2).
    Where the paper is silent, assumed: micro-batches of one sequence (Table 4 gives the batch
    per DP rank, not the micro-batch), sequence parallelism with TP, and the file's one kernel
    efficiency. It interleaves its pipeline but does not state the chunks per rank: this plan
    has none (v = 1), the most bubble and the least activation memory any v gives.
    Context parallelism, also stated: all-gather based, not a ring, and "the all-gather
    communication latency is exposed in the critical path": cp_overlap off. MFU counts
    attention's full score matrix, PaLM's definition, which the paper cites ("MFU; Chowdhery et
    al. (2023)"); the step executes the causal half (flash attention). The paper's document
    mask, which cuts the executed attention further, is not modelled."""
    model = cm.MODELS["llama-405b"]
    p = plan(dp=dp, tp=8, pp=16, cp=cp, sp=True, zero_stage=2, recompute="none",
             micro_batches=micro_batches, seq_len=seq_len, cp_overlap=False)
    return cm.plan_training(model, p, H100)


@pytest.mark.parametrize("row", LLAMA3_TABLE_4, ids=lambda row: f"cp{row[0]}-dp{row[1]}")
def test_llama3_405b_stated_layouts(row):
    """What the planner reproduces of the stated layouts, and what it does not.
    - The split: 7, 8 and 7 layers on the first, middle and last stages, 16M tokens a step.
    - MFU: the reported one lies between the planner's at v = 1 and its bubble-free bound (the
      same step without the bubble), the range the unstated v spans.
    - Memory, not reproduced: with the course's block (unfused RMSNorm and SwiGLU, whose saved
      tensors tests/test_planner.py measures) and no recomputation, the busiest stage needs up
      to 1.2 x an 80 GB H100. A fused production block saves fewer tensors, and the paper also
      frees each stage's input and output tensors early; the planner has neither term. Asserted
      as the gap it is, so that a change in it shows."""
    cp, dp, seq_len, micro_batches, reported = row
    r = llama3_layout(cp, dp, seq_len, micro_batches)
    stages = r["memory_per_stage"]
    assert [stages[role]["layers"] for role in ("first", "middle", "last")] == [7, 8, 7]
    assert r["gpus"] in (8192, 16384) and r["tokens_per_step"] == 16 * 1024 * 1024
    bubble_free = r["model_flops_utilization"] * r["time_s"]["step"] / (
        r["time_s"]["step"] - r["time_s"]["bubble"])
    assert r["model_flops_utilization"] < reported < bubble_free, (r["model_flops_utilization"],
                                                                  bubble_free)
    assert 1 < r["memory_fraction"] < 1.2 and r["busiest_stage"] == 1, r["memory_fraction"]
    assert stages["last"]["total"] < stages["first"]["total"] / 4  # one micro-batch in flight


# Korthikanti et al. 2022, Table 3: the 1T model (160 heads, hidden 25600, 128 layers) on 512
# A100 80GB GPUs with TP 8 and PP 64 (so DP 1), global batch 512 of micro-batches of one
# sequence, trained with sequence parallelism and selective recomputation (Table 5, "present
# work"). Sequence length 2048 and vocabulary 51200 as in Narayanan et al. 2021.
def test_korthikanti_1t_layout_fits_stage_by_stage():
    """The paper is silent on the schedule (assumed plain 1F1B, no interleaving) and on the
    optimizer's sharding (moot: DP is 1). The first stage holds the embedding and 64 micro-
    batches of its 2 layers; the last holds the head and one micro-batch of its layers and of
    the fp32 logits: charged to the first stage for every micro-batch in flight, they would add
    23 GB and the layout would not fit."""
    model = gpt3(25600, 160, 128)
    assert cm.parameter_count(model) / 1e12 == pytest.approx(1.0, abs=0.01)
    r = cm.plan_training(model, plan(tp=8, pp=64, sp=True, recompute="selective",
                                     micro_batches=512), A100)
    assert r["gpus"] == 512 and r["tokens_per_step"] == 512 * 2048
    stages = r["memory_per_stage"]
    assert r["fits"] and r["busiest_stage"] == 0, r["memory_fraction"]
    assert stages["first"]["total"] / 1e9 == pytest.approx(62.7, abs=0.05)
    logits = 2048 * 4 * 51200 / 8  # fp32, vocabulary-parallel over TP 8
    assert stages["last"]["activations"] > logits
    assert stages["last"]["activations"] < stages["middle"]["activations"] / 30
# --8<-- [end:llama3]


# --8<-- [start:deepseek-v3]
def test_expert_parallel_memory_traffic_and_active_flops():
    """Each rank holds num_experts / ep experts of every MoE block on its stage, sharded by ZeRO
    over the dp / ep ranks that hold the same experts; per MoE block and micro-batch 4
    all-to-alls (dispatch and combine, forward and backward) each send tokens x top-k x h
    elements x (ep - 1)/ep off the rank; FLOPs count the active experts only."""
    model = cm.MODELS["deepseek-v3"]
    h, k, ep, dp, m = 7168, 8, 8, 16, 4
    expert = 3 * h * 2048  # SwiGLU
    moe = 61 - 3
    p = plan(dp=dp, ep=ep, zero_stage=1, micro_batches=m, seq_len=4096, recompute="full")
    r = cm.plan_training(model, p, H100)
    state = cm.model_state_bytes(model, p, 0)
    assert state["expert_parameters"] == moe * 256 / ep * expert
    optimizer = 12 * (state["dense_parameters"] / dp + state["expert_parameters"] / (dp / ep))
    assert state["optimizer"] == pytest.approx(optimizer, rel=1e-12)
    sent = 4096 * k * h * 2 * (ep - 1) / ep  # bf16
    one = (ep - 1) * 3e-6 + sent / 450e9  # ep x tp = 8 ranks: NVLink inside one node
    assert r["time_s"]["expert_parallel"] == pytest.approx(m * moe * 4 * one, rel=1e-12)
    active = cm.matmul_parameters(model)
    assert active == (3 * cm.matmul_parameters_per_layer(model) + 129280 * h
                      + moe * (cm.attention_parameters(model) + h * 256 + (1 + k) * expert))


# Section 1: "training DeepSeek-V3 on each trillion tokens requires only 180K H800 GPU hours".
DEEPSEEK_V3_TOKENS_PER_GPU_S = 1e12 / (180e3 * 3600)  # 1,543 tokens/s per H800


def deepseek_v3_layout(ep_overlap):
    """DeepSeek-V3's pre-training layout (section 3.2): PP 16 x DP 128 on 2048 H800s, EP 64
    inside DP, ZeRO-1, no TP; 4K-token sequences, batch 15360 (section 4.2), so 120
    micro-batches of one sequence per DP rank. The H800 is an H100 SXM with NVLink cut to the
    160 GB/s section 3.2.2 quotes (InfiniBand 50 GB/s, as the H100 preset)."""
    h800 = {**H100, "intra_node_gbps": 160}
    real = cm.MODELS["deepseek-v3"]
    model = {**real, "num_hidden_layers": 64}  # 61 layers do not split into 16 equal stages
    p = plan(dp=128, pp=16, ep=64, zero_stage=1, precision="fp8", recompute="full",
             micro_batches=120, seq_len=4096, ep_overlap=ep_overlap)
    return cm.plan_training(model, p, h800)


def test_deepseek_v3_is_671b_with_37b_active():
    model = cm.MODELS["deepseek-v3"]
    assert cm.parameter_count(model) / 1e9 == pytest.approx(671, abs=0.5)
    active = cm.matmul_parameters(model) + 129280 * 7168  # + the input embedding table
    assert active / 1e9 == pytest.approx(37, abs=0.6)


def test_deepseek_v3_layout_fits_and_throughput_is_within_1_3x():
    """Planned on 64 layers, 4 per stage (the most any of the 16 stages holds; the paper does
    not state its split of the 61), so the memory and the slowest stage's time are upper
    bounds. Assumed, not stated in the table: fp8 recipe (section 3.3: FP8
    GEMMs; the planner runs every matmul at the same fraction of the FP8 peak), full
    recomputation, 1F1B. What the planner lacks:
    - memory: without recomputation it needs about 195 GB. DeepSeek recomputes only RMSNorm
      and MLA's up-projections and caches FP8 activations (sections 3.2.3, 3.3.3); the
      planner has neither term, so it needs full recomputation to fit, and pays its FLOPs;
    - time: DualPipe's overlap (section 3.2.1). Without ep_overlap the all-to-alls (about
      1:1 with compute, as section 3.2.1 says) sit on the critical path and the prediction
      falls outside the 1.3x band: that comparison is asserted below as failing, not passed.
      Also missing: FP8 dispatch (half the dispatch bytes), node-limited routing (at most 4
      nodes per token), DualPipe's smaller bubble and the multi-token-prediction module."""
    r = deepseek_v3_layout(ep_overlap=True)
    assert r["gpus"] == 2048 and r["tokens_per_step"] == 15360 * 4096
    assert r["fits"], r["memory_bytes"]["total"] / 1e9
    predicted = r["tokens_per_s"] / r["gpus"]
    assert 1 / 1.3 < predicted / DEEPSEEK_V3_TOKENS_PER_GPU_S < 1.3, predicted
    serial = deepseek_v3_layout(ep_overlap=False)
    assert serial["tokens_per_s"] / serial["gpus"] / DEEPSEEK_V3_TOKENS_PER_GPU_S < 1 / 1.3
# --8<-- [end:deepseek-v3]
