"""The scale planner's cost model against the course's own model and measurements, and against
published figures."""

import functools
import json
import shutil
import subprocess
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from snippets.models.gpt import GPT, GPTConfig, RMSNorm, get_config, shift_for_next_token
from snippets.planner import cost_model as cm
from snippets.planner.flops import training_flops_per_token
from snippets.planner.memory import measure_held_activation_bytes, selective_policy
from snippets.planner.__main__ import model_of, parse_args, plan_of
from snippets.planner.to_js import SOURCE, Unsupported, translate
from tests.test_planner_published import gpt3

COURSE_MODELS = ["tiny", "small", "medium", "gpt2-small"]


def plan(**overrides):
    base = dict(dp=1, tp=1, pp=1, zero_stage=0, precision="fp32", recompute=False,
                micro_batch_size=1, micro_batches=1, seq_len=64, schedule="1f1b", mfu=0.5)
    return {**base, **overrides}


# Planner keys that are not GPTConfig fields: grouped-query attention (the course's GPT has
# none), and how the course's GPT keeps its norms and residual stream under autocast (fp32).
PLANNER_ONLY = ("num_key_value_heads", "norm", "residual")


def as_config(model: dict, **extra) -> GPTConfig:
    kwargs = {k: v for k, v in model.items() if k not in PLANNER_ONLY}
    return GPTConfig(**kwargs, **extra)


@pytest.mark.parametrize("name", COURSE_MODELS)
def test_presets_are_the_course_configs_and_count_parameters_exactly(name):
    model = cm.MODELS[name]
    config = get_config(name)
    assert as_config(model, max_position_embeddings=config.max_position_embeddings) == config
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        gpt = GPT(config)
    assert cm.parameter_count(model) == gpt.num_parameters()  # exact: the same tensors
    assert cm.training_flops_per_token(model, 128) == training_flops_per_token(config, 128)


def test_llama_parameter_counts_match_the_published_checkpoints():
    # Parameter counts of the released Llama 2 checkpoints (7B, 13B, 70B with 8 KV heads).
    assert cm.parameter_count(cm.MODELS["llama-7b"]) == 6_738_415_616
    assert cm.parameter_count(cm.MODELS["llama-13b"]) == 13_015_864_320
    assert cm.parameter_count(cm.MODELS["llama-70b"]) == 68_976_648_192


def test_zero_paper_figure_1_model_state_per_device():
    # ZeRO paper, Figure 1: Psi = 7.5B parameters, N_d = 64 devices, mixed-precision Adam (K=12):
    # 120 GB baseline, 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p).
    psi = 7.5e9
    expected_gb = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expected_gb.items():
        total = cm.sharded_state_bytes(psi, "bf16", stage, 64)["total"]
        assert total / 1e9 == pytest.approx(gb, abs=0.05), stage  # the paper rounds to 0.1 GB
    assert cm.sharded_state_bytes(1, "bf16", 0, 1)["total"] == 16  # 16 bytes per parameter


def test_fp32_main_grads_count_18_bytes_per_parameter_and_reduce_in_fp32():
    # Megatron-LM keeps fp32 main gradients (--accumulate-allreduce-grads-in-fp32): bf16 weights
    # 2 + fp32 gradients 4 + fp32 master weights 4 + Adam's m and v 8 = 18 bytes per parameter,
    # against the ZeRO paper's 2 + 2 + 12 = 16.
    model = cm.MODELS["llama-7b"]
    n = cm.parameter_count(model)
    bf16, main = plan(dp=8, precision="bf16"), plan(dp=8, precision="bf16", fp32_main_grads=True)
    assert cm.bytes_per_parameter(bf16) == {"weights": 2, "gradients": 2, "optimizer": 12}
    assert cm.bytes_per_parameter(main) == {"weights": 2, "gradients": 4, "optimizer": 12}
    for stage, (grads, optimizer) in {0: (4 * n, 12 * n), 1: (4 * n, 12 * n / 8),
                                      2: (4 * n / 8, 12 * n / 8)}.items():
        state = cm.model_state_bytes(model, {**main, "zero_stage": stage}, 0)
        assert (state["weights"], state["gradients"], state["optimizer"]) == (2 * n, grads,
                                                                           optimizer), stage
    assert cm.model_state_bytes(model, main, 0)["total"] == 18 * n  # ZeRO-0
    assert cm.model_state_bytes(model, bf16, 0)["total"] == 16 * n
    # The data-parallel gradient exchange moves the fp32 gradients: twice the bytes, and the
    # all-reduce's bandwidth term doubles (the latency term does not).
    assert cm.messages_per_rank(model, main)["dp"] == 4 * n == 2 * cm.messages_per_rank(
        model, bf16)["dp"]
    cluster = cm.CLUSTERS["H100 SXM, 8 per node, InfiniBand 400 Gb/s"]
    times = [cm.plan_training(model, p, cluster)["time_s"]["data_parallel"] for p in (bf16, main)]
    latency = 2 * 7 * 3e-6  # 2(N - 1) messages of 3 us on NVLink
    assert times[1] - latency == pytest.approx(2 * (times[0] - latency), rel=1e-12)
    assert cm.model_state_bytes(model, {**main, "precision": "fp32"}, 0)["total"] == 16 * n
    assert plan_of(parse_args(["--fp32-main-grads"]))["fp32_main_grads"] is True


# --8<-- [start:activation-test]
class SelectiveBlock(torch.nn.Module):
    """A block of the course's GPT under the planner's selective policy: torch's selective
    activation checkpointing keeps the outputs of the ops in memory.SELECTIVE_SAVE (matmuls,
    attention) in a cache of its own and recomputes the rest (norms, RoPE, SiLU, products) in
    backward."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, selective_policy))


def held_activation_bytes(recompute, run="fp32"):
    """Bytes the small GPT (one micro-batch of 4 x 64 tokens) holds for its backward under a
    recompute mode, measured, and as the planner counts them. The run: "fp32"; "bf16" under
    CPU bf16 autocast with fp32 weights, as the course trains (fp32 residual stream); or
    "bf16-weights", weights in bf16 but the norms' in fp32, as the scratch FSDP's
    MixedPrecision(fp32_modules=(RMSNorm,)) runs it (snippets/scratch/fsdp_check.py), whose
    residual stream is bf16."""
    model = dict(cm.MODELS["small"])
    if run == "bf16-weights":
        model["residual"] = "activations"
    config = as_config(model, max_position_embeddings=64,
                       gradient_checkpointing=recompute == "full")
    torch.manual_seed(0)
    gpt = GPT(config).train()
    if run == "bf16-weights":
        gpt.to(torch.bfloat16)
        for module in gpt.modules():
            if isinstance(module, RMSNorm):
                module.float()
    if recompute == "selective":
        gpt.layers = torch.nn.ModuleList(SelectiveBlock(block) for block in gpt.layers)
    tokens = torch.randint(0, config.vocab_size, (4, 65))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run == "bf16"):
        measured = measure_held_activation_bytes(gpt, *shift_for_next_token(tokens))
    precision = "fp32" if run == "fp32" else "bf16"
    predicted = cm.activation_bytes(model, plan(micro_batch_size=4, seq_len=64,
                                                recompute=recompute, precision=precision), 0)
    return measured, predicted


RUNS = ["fp32", "bf16", "bf16-weights"]


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_model_matches_saved_tensors_of_the_real_model(recompute, run):
    # The planner's per-tensor count against every tensor the real model holds for its
    # backward: what autograd saves, and under selective recomputation what the checkpoint's
    # cache keeps; in bf16, with the norms computing in fp32 and the residual stream in fp32
    # (autocast over fp32 weights) or bf16 (bf16 weights). Within 2%: the model leaves out a
    # few scalars and the int64 index tensors' exact count; the issue's target is 10%.
    measured, predicted = held_activation_bytes(recompute, run)
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)


@pytest.mark.parametrize("run", RUNS)
def test_selective_recomputation_frees_exactly_the_elementwise_tensors(run):
    # What the selective policy frees against none, per block: the two norms' tensors (input,
    # normalised vector, output as its matmuls keep it, and the fp32 1/rms), SiLU(gate) and
    # the product (2 x intermediate); it keeps the block's input and the o and down outputs
    # instead, and q and k before RoPE instead of after (the same size). The rest of the model
    # cancels, so the planner's difference must equal the measured one to the byte.
    none, selective = held_activation_bytes("none", run), held_activation_bytes("selective", run)
    assert none[1] - selective[1] == none[0] - selective[0]
# --8<-- [end:activation-test]


def test_held_bytes_under_autocast_do_not_depend_on_an_earlier_forward():
    # Autocast keeps its bf16 copies of the weights for its whole region; a second measurement
    # in the same region must still recognise them as model state, not activations.
    torch.manual_seed(0)
    gpt = GPT(get_config("tiny")).train()
    batch = shift_for_next_token(torch.randint(0, 256, (2, 17)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = measure_held_activation_bytes(gpt, *batch)
        assert measure_held_activation_bytes(gpt, *batch) == first


def test_pipeline_in_flight_micro_batches_and_bubble():
    model = cm.MODELS["medium"]  # 6 layers
    gpipe = cm.activation_bytes(model, plan(pp=3, micro_batches=8, schedule="gpipe"), 0)
    one_f_one_b = cm.activation_bytes(model, plan(pp=3, micro_batches=8, schedule="1f1b"), 0)
    assert gpipe / one_f_one_b == pytest.approx(8 / 3)
    cluster = cm.CLUSTERS["H100 SXM, 8 per node, InfiniBand 400 Gb/s"]
    r = cm.plan_training(model, plan(pp=3, micro_batches=8), cluster)
    assert r["bubble_fraction"] == pytest.approx(2 / 10)


def test_zero_stages_shrink_memory_and_zero3_costs_one_and_a_half_times_the_traffic():
    model = cm.MODELS["llama-7b"]
    cluster = cm.CLUSTERS["H100 SXM, 8 per node, InfiniBand 400 Gb/s"]
    runs = [cm.plan_training(model, plan(dp=8, zero_stage=s, precision="bf16", seq_len=2048),
                             cluster) for s in range(4)]
    totals = [r["memory_bytes"]["total"] for r in runs]
    assert totals == sorted(totals, reverse=True)
    dp_time = [r["time_s"]["data_parallel"] for r in runs]
    assert dp_time[0] == dp_time[1] == dp_time[2]  # reduce-scatter + all-gather = all-reduce
    assert dp_time[3] == pytest.approx(1.5 * dp_time[0])
    # With gradient accumulation ZeRO-3 reduce-scatters and gathers for every micro-batch.
    four = cm.plan_training(model, plan(dp=8, zero_stage=3, precision="bf16", micro_batches=4),
                            cluster)
    assert four["time_s"]["data_parallel"] == pytest.approx(6 * dp_time[0])
    assert not runs[0]["fits"] and runs[3]["fits"]  # 7B with plain DP: 108 GB of state alone


def test_fits_leaves_the_reserve_free():
    # A GPU loses RESERVED_GB to the CUDA context, NCCL's buffers and fragmentation before the
    # model's tensors: a plan fits when its tensors and the reserve fit together.
    assert cm.RESERVED_GB == 3
    cluster = cm.CLUSTERS["H100 SXM, 8 per node, InfiniBand 400 Gb/s"]
    p = plan(dp=8, zero_stage=3, precision="bf16", seq_len=2048)
    total = cm.plan_training(cm.MODELS["llama-7b"], p, cluster)["memory_bytes"]["total"]
    for room, fits in ((3e9, True), (3e9 - 1, False), (2e9, False)):
        gpu = {**cluster, "gpu_memory_gb": (total + room) / 1e9}
        r = cm.plan_training(cm.MODELS["llama-7b"], p, gpu)
        assert r["reserved_bytes"] == 3e9 and r["fits"] is fits, room
        assert r["memory_fraction"] == pytest.approx((total + 3e9) / (total + room), rel=1e-12)
    out = subprocess.run([sys.executable, "-m", "snippets.planner", "--model", "llama-7b",
                          "--zero-stage", "3"], capture_output=True, text=True, check=True).stdout
    assert "  fits in 80 GB with 3 GB reserved (36%)\n" in out  # (25.75 + 3) / 80


def test_full_recomputation_runs_the_tensor_parallel_forward_all_reduces_again():
    # Llama 70B, tp 8, one micro-batch of 4096 tokens, bf16: each all-reduce moves 4096 x 8192
    # x 2 bytes over NVLink, 2(8 - 1) messages of an eighth of it. Per layer 2 forward and 2
    # backward, and under full recomputation the forward's 2 once more: 6 x 80 = 480. Selective
    # recomputation reruns attention's core inside the TP region: no messages, 4 x 80 = 320.
    cluster = cm.CLUSTERS["H100 SXM, 8 per node, InfiniBand 400 Gb/s"]
    all_reduce = 2 * 7 * (3e-6 + 4096 * 8192 * 2 / 8 / 450e9)
    for recompute, count in (("none", 320), ("selective", 320), ("full", 480)):
        p = plan(tp=8, precision="bf16", seq_len=4096, recompute=recompute)
        assert cm.messages_per_rank(cm.MODELS["llama-70b"], p)["tp_count"] == count, recompute
        r = cm.plan_training(cm.MODELS["llama-70b"], p, cluster)
        assert r["time_s"]["tensor_parallel"] == pytest.approx(count * all_reduce, rel=1e-12)
        sp = cm.plan_training(cm.MODELS["llama-70b"], {**p, "sp": True}, cluster)
        assert sp["time_s"]["tensor_parallel"] == pytest.approx(count * all_reduce, rel=1e-12)


def test_ring_collective_times_follow_the_alpha_beta_model():
    link = {"alpha": 1e-5, "beta": 1e9}
    # 2(N-1) messages of size/N: latency-bound for small messages, 2(N-1)/N x size / beta for big
    assert cm.ring_all_reduce_time(0, 8, link) == pytest.approx(14e-5)
    assert cm.ring_all_reduce_time(8e9, 8, link) == pytest.approx(14e-5 + 14.0)
    assert cm.ring_all_gather_time(8e9, 8, link) == pytest.approx(7e-5 + 7.0)
    assert cm.ring_all_reduce_time(8e9, 1, link) == 0


@pytest.mark.parametrize("change,field", [
    (dict(pp=5), "num_hidden_layers=32 does not divide into pp=5"),
    (dict(tp=16), "tp=16"),
    (dict(dp=0), "dp=0 must be a whole number"),
    (dict(precision="fp4"), "precision=fp4"),
    (dict(zero_stage=4), "zero_stage=4"),
])
def test_bad_plans_name_the_field(change, field):
    cluster = cm.CLUSTERS["H100 SXM, 8 per node, InfiniBand 400 Gb/s"]
    with pytest.raises(cm.PlannerError, match=field.replace("(", r"\(")):
        cm.plan_training(cm.MODELS["llama-7b"], plan(**change), cluster)


@pytest.mark.parametrize("field", ["norm", "residual"])
def test_bad_norm_or_residual_precision_names_the_field(field):
    cluster = cm.CLUSTERS["H100 SXM, 8 per node, InfiniBand 400 Gb/s"]
    with pytest.raises(cm.PlannerError, match=f"{field}=bf16 must be"):
        cm.plan_training(cm.MODELS["small"] | {field: "bf16"}, plan(), cluster)


def test_translator_refuses_python_it_cannot_mirror():
    translate("def f(x):\n    return x // 2 + max(x, 1)\n")
    with pytest.raises(Unsupported, match="line 2: While"):
        translate("def f(x):\n    while x:\n        x = x - 1\n    return x\n")
    with pytest.raises(Unsupported, match="format specification"):
        translate("def f(x):\n    return f'{x:.2f}'\n")


def test_planner_matches_the_course_benchmarks_in_bench_json():
    """Against the measurements `make bench` committed: model state per rank of DDP and ZeRO 1-3
    on the small GPT (fp32, 2 and 4 ranks) within 10%, and the pipeline bubble the 1F1B
    benchmark measured within 20% of the planner's (p-1)/(m+p-1)."""
    import json

    from tests.conftest import ROOT

    results = json.loads((ROOT / "bench.json").read_text())["results"]
    zero = results["zero_memory"]
    model = cm.MODELS[zero["config"]]
    assert cm.parameter_count(model) == zero["parameters"]
    stages = {"DDP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3, "FSDP2": 3}
    for n, rows in zero["by_world_size"].items():
        for name, row in rows.items():
            predicted = cm.sharded_state_bytes(zero["parameters"], "fp32", stages[name], int(n))
            assert predicted["total"] == pytest.approx(row["state_bytes"]["total"], rel=0.10), \
                (n, name)
    for row in results["pipeline_bubble"]["bubble"]:
        p, m = row["stages"], row["micro_batches"]
        # The small GPT's 4 layers split into the benchmark's 2 or 4 stages, one process each.
        cluster = cm.CLUSTERS["This course's 2-core CPU (gloo)"] | {"gpus_per_node": 4}
        r = cm.plan_training(cm.MODELS["small"], plan(pp=p, micro_batches=m), cluster)
        assert r["bubble_fraction"] == pytest.approx(row["theory"], abs=5e-4)  # 3 decimals
        assert row["1f1b"] == pytest.approx(r["bubble_fraction"], rel=0.20), (p, m)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run generated JavaScript")
def test_generated_javascript_gives_the_python_numbers_for_the_new_options():
    """The calculator's translated model on sequence, context and interleaved pipeline
    parallelism, selective recomputation, the GPT-3 block, expert parallelism, fp32 main
    gradients and the course's fp32 norms and residual stream under bf16 (tests/test_browser.py
    checks the page itself in Chromium). Equal to rounding: the same arithmetic in the same
    order."""
    gpt3 = {"architecture": "gpt3", "vocab_size": 51200, "hidden_size": 12288,
            "intermediate_size": 49152, "num_hidden_layers": 96, "num_attention_heads": 96,
            "num_key_value_heads": 96, "tie_word_embeddings": True,
            "max_position_embeddings": 2048}
    cases = [
        (cm.MODELS["llama-70b"], plan(dp=128, tp=8, zero_stage=1, precision="bf16",
                                      seq_len=4096, micro_batches=8, sp=True)),
        (cm.MODELS["llama-70b"], plan(dp=16, tp=8, pp=4, zero_stage=2, precision="bf16",
                                      virtual_stages=4, micro_batches=16, recompute="selective")),
        (cm.MODELS["llama-405b"], plan(dp=8, tp=8, pp=9, cp=4, sp=True, zero_stage=3,
                                       recompute="full", seq_len=32768, micro_batches=9,
                                       cp_overlap=False, flops="6N")),
        (gpt3, plan(dp=4, tp=8, pp=8, sp=True, recompute="selective", micro_batches=8,
                    precision="bf16", flops="matmuls")),
        (cm.MODELS["deepseek-v3"] | {"num_hidden_layers": 64},
         plan(dp=128, pp=16, ep=64, zero_stage=1, precision="fp8", recompute="full",
              seq_len=4096, micro_batches=120, ep_overlap=True)),
        (cm.MODELS["deepseek-v3"], plan(dp=16, ep=8, zero_stage=3, precision="bf16",
                                        recompute="selective", micro_batches=4,
                                        fp32_main_grads=True)),
        (cm.MODELS["llama-405b"], plan(dp=8, tp=8, pp=9, cp=4, sp=True, precision="bf16",
                                       recompute="selective", seq_len=32768, micro_batches=9,
                                       flops="matmuls+causal-attention")),
        (cm.MODELS["gpt2-small"], plan(dp=4, pp=2, precision="bf16", seq_len=1024,
                                       micro_batch_size=4, micro_batches=4)),
        (cm.MODELS["medium"], plan(dp=4, tp=2, sp=True, precision="bf16",
                                   recompute="selective")),
    ]
    cluster = "H100 SXM, 8 per node, InfiniBand 400 Gb/s"
    runner = ("globalThis.window = {};\n" + translate(SOURCE.read_text()) +
              "const M = window.PlannerModel;\n"
              "const cases = JSON.parse(require('fs').readFileSync(0, 'utf8'));\n"
              f"console.log(JSON.stringify(cases.map(([m, p]) => M.plan_training(m, p, "
              f"M.CLUSTERS[{json.dumps(cluster)}]))));\n")
    out = subprocess.run(["node", "-e", runner], input=json.dumps(cases), capture_output=True,
                         text=True, check=True).stdout
    for (model, p), js in zip(cases, json.loads(out)):
        expected = cm.plan_training(model, p, cm.CLUSTERS[cluster])
        assert js["memory_bytes"] == pytest.approx(expected["memory_bytes"], rel=1e-12)
        assert js["time_s"] == pytest.approx(expected["time_s"], rel=1e-12)
        assert js["fits"] is expected["fits"]
        assert js["model_flops_utilization"] == pytest.approx(
            expected["model_flops_utilization"], rel=1e-12)


def test_attention_activations_count_the_key_value_width():
    # Grouped-query attention: k and v are num_key_value_heads x head_dim wide, not hidden.
    # Llama 70B: 8 KV heads of 128, so per token k and v save 2 x (8192 - 1024) elements fewer.
    gqa = cm.MODELS["llama-70b"]
    mha = {**gqa, "num_key_value_heads": 64}
    p = plan(precision="bf16", seq_len=4096, tp=8)
    saved = cm.activation_bytes_per_layer(mha, p) - cm.activation_bytes_per_layer(gqa, p)
    assert saved == 4096 * 2 * (8192 - 1024) * 2 / 8


def test_llama3_split_puts_one_layer_fewer_on_the_first_and_last_stage():
    # Llama 3 paper, section 3.3.2: 126 layers on 16 stages, "we reduce one Transformer layer
    # each from the first and the last stages": 7 + 14 x 8 + 7.
    model = cm.MODELS["llama-405b"]
    p = plan(pp=16, precision="bf16")
    assert cm.stage_layers(model, p) == {"first": 7, "middle": 8, "last": 7}
    assert cm.stage_layers(cm.MODELS["llama-70b"], plan(pp=4)) == {"first": 20, "middle": 20,
                                                                 "last": 20}
    # A split of one's own: DeepSeek-V3's 61 layers on 16 stages as 4 + 14 x 4 + 1.
    deepseek = cm.MODELS["deepseek-v3"]
    with pytest.raises(cm.PlannerError, match="num_hidden_layers=61 does not divide into pp=16"):
        cm.validate_stages(deepseek, plan(pp=16))
    mine = plan(pp=16, first_stage_layers=4, last_stage_layers=1)
    cm.validate_stages(deepseek, mine)
    assert cm.stage_layers(deepseek, mine) == {"first": 4, "middle": 4, "last": 1}
    # The first stage's first 3 blocks are dense; the MoE blocks are the rest.
    assert [cm.moe_layers_on_stage(deepseek, mine, s) for s in (0, 1, 15)] == [1, 4, 1]
    with pytest.raises(cm.PlannerError, match="leave 55 layers, which do not divide into pp - 2"):
        cm.validate_stages(deepseek, plan(pp=16, first_stage_layers=5, last_stage_layers=1))


@pytest.mark.parametrize("name, pp, extra", [("llama-405b", 16, {}), ("gpt2-small", 3, {}),
                                             ("deepseek-v3", 16, dict(first_stage_layers=4,
                                                                      last_stage_layers=1))])
def test_stages_add_up_to_the_whole_model(name, pp, extra):
    model = cm.MODELS[name]
    p = plan(pp=pp, precision="bf16", recompute="full", **extra)
    stages = (0, 1, pp - 1)
    middles = pp - 2
    flops = [cm.stage_flops_per_token(model, p, s) for s in stages]
    assert flops[0] + middles * flops[1] + flops[2] == pytest.approx(
        cm.executed_flops_per_token(model, p), rel=1e-12)
    params = [cm.stage_dense_parameters(model, p, s) for s in stages]
    moe = [cm.moe_layers_on_stage(model, p, s) for s in stages]
    routed = (moe[0] + middles * moe[1] + moe[2]) * routed_parameters_per_moe_block(model)
    tied_copy = model["vocab_size"] * model["hidden_size"] * model["tie_word_embeddings"]
    assert params[0] + middles * params[1] + params[2] + routed == cm.parameter_count(model) + \
        tied_copy  # a tied head is copied onto the last stage


def routed_parameters_per_moe_block(model):
    if cm.moe_layers(model) == 0:
        return 0
    return model["num_experts"] * cm.expert_parameters(model)


def test_logits_live_on_the_last_stage_one_micro_batch_at_a_time():
    model = cm.MODELS["medium"]  # 6 layers on 3 stages
    p = plan(pp=3, micro_batches=8, seq_len=64)
    per_layer = cm.activation_bytes_per_layer(model, p)
    ids = 64 * 8
    last = cm.last_stage_extra_activation_bytes(model, p)
    # final norm (input, normalised, output; fp32 1/rms), fp32 log-softmax, targets
    assert last == 64 * (3 * 256 * 4 + 4 + 4 * 256 + 8)
    assert cm.activation_bytes(model, p, 0) == 3 * (2 * per_layer + ids)  # p in flight
    assert cm.activation_bytes(model, p, 1) == 2 * 2 * per_layer
    assert cm.activation_bytes(model, p, 2) == 2 * per_layer + last  # one in flight
    gpipe = {**p, "schedule": "gpipe"}
    assert cm.activation_bytes(model, gpipe, 2) == 8 * (2 * per_layer + last)


def planner_cli(*flags):
    return subprocess.run([sys.executable, "-m", "snippets.planner", *flags],
                          capture_output=True, text=True)


def test_cli_takes_llama_405b_on_16_uneven_stages():
    out = planner_cli("--model", "llama-405b", "--dp", "128", "--tp", "8", "--pp", "16",
                      "--seq-len", "8192")
    assert out.returncode == 0, out.stderr
    assert "stage              first (0)   middle (1)    last (15)" in out.stdout
    assert "layers                     7            8            7" in out.stdout


def test_cli_model_shape_flags_build_the_gpt3_block():
    # GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads) with
    # Megatron-LM's vocabulary of 51,200 (Narayanan et al. 2021, section 5.1).
    args = parse_args(["--architecture", "gpt3", "--layers", "96", "--hidden", "12288",
                       "--ffn", "49152", "--heads", "96", "--kv-heads", "96", "--vocab", "51200",
                       "--seq-len", "2048"])
    assert model_of(args) == {**cm.MODELS["llama-7b"], **gpt3(12288, 96, 96)}
    assert cm.parameter_count(model_of(args)) / 1e9 == pytest.approx(174.6, abs=0.05)


@pytest.mark.parametrize("flags, line", [
    (["--kv-heads", "0"], "argument --kv-heads: must be a whole number >= 1, got 0"),
    (["--heads", "7"], "hidden_size=4096 is not divisible by num_attention_heads=7"),
    (["--heads", "32", "--kv-heads", "5"], "(flags: --heads, --kv-heads)"),
    (["--model", "llama-70b", "--pp", "3"], "or set first_stage_layers and last_stage_layers"),
    (["--model", "llama-70b", "--pp", "4", "--first-stage-layers", "31"], "--first-stage-layers"),
    (["--model", "llama-70b", "--tp", "16"], "tp=16 exceeds gpus_per_node=8"),
])
def test_cli_refuses_a_bad_shape_in_one_line_naming_the_flag(flags, line):
    out = planner_cli(*flags)
    assert out.returncode != 0 and line in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_the_slowest_stage_sets_the_pace():
    # Even stages: the last one also runs the output head, so every stage waits for it. Llama
    # 3's split takes a layer off the last stage, and a middle stage is the slowest again.
    cluster = cm.CLUSTERS["H100 SXM, 8 per node, InfiniBand 400 Gb/s"]
    p = plan(dp=2, tp=8, pp=4, micro_batches=16, precision="bf16", seq_len=4096)
    r = cm.plan_training(cm.MODELS["llama-70b"], p, cluster)
    head = 6 * 32000 * 8192 * 4096 * 16 / 8 / (989e12 * 0.5)  # 16 micro-batches, tp 8
    assert r["slowest_stage"] == 3
    assert r["time_s"]["compute"] == pytest.approx(head + 16 * 4096 * 20 * cm.block_flops_per_token(
        cm.MODELS["llama-70b"], p, False) / 8 / (989e12 * 0.5), rel=1e-12)
    llama3 = cm.plan_training(cm.MODELS["llama-405b"], {**p, "pp": 16, "seq_len": 8192}, cluster)
    assert llama3["slowest_stage"] == 1


def test_step_time_runs_causal_attention_and_mfu_counts_what_the_plan_says():
    # A causal flash-attention kernel ("llama") computes half of the score matrix; the "gpt3"
    # block (Megatron-LM 2021: scores materialised, then masked) all of it. The step's compute
    # follows what runs; MFU's numerator follows the plan's convention, and only it.
    cluster = cm.CLUSTERS["H100 SXM, 8 per node, InfiniBand 400 Gb/s"]
    llama, g = cm.MODELS["llama-70b"], gpt3(12288, 96, 96)
    p = plan(dp=8, tp=8, precision="bf16", seq_len=8192)
    full = 12 * 80 * 8192 * 8192  # 12 x layers x seq_len x hidden
    assert cm.training_flops_per_token(llama, 8192) == 6 * cm.matmul_parameters(llama) + full
    assert cm.executed_flops_per_token(llama, p) == 6 * cm.matmul_parameters(llama) + full / 2
    assert cm.executed_flops_per_token(g, p) == cm.training_flops_per_token(g, 8192)
    conventions = {"matmuls+attention": full, "matmuls+causal-attention": full / 2,
                   "matmuls": 0}
    runs = {}
    for convention, attention in conventions.items():
        q = {**p, "flops": convention}
        assert cm.model_flops_per_token(llama, q) == 6 * cm.matmul_parameters(llama) + attention
        runs[convention] = cm.plan_training(llama, q, cluster)
    assert len({r["time_s"]["step"] for r in runs.values()}) == 1  # the convention is not time
    first = runs["matmuls+attention"]
    assert first["time_s"]["compute"] == pytest.approx(
        8192 * cm.executed_flops_per_token(llama, p) / 8 / (989e12 * 0.5), rel=1e-12)
    ratio = first["model_flops_utilization"] / runs["matmuls+causal-attention"][
        "model_flops_utilization"]
    assert ratio == pytest.approx(cm.training_flops_per_token(llama, 8192) / (
        6 * cm.matmul_parameters(llama) + full / 2), rel=1e-12)


def test_selective_recomputation_of_a_llama_block_keeps_matmul_outputs_for_free():
    # The "llama" block's selective policy recomputes elementwise ops only: no matmul FLOPs, no
    # tensor-parallel messages, and per token 3h outside the TP regions plus q, k, v, the
    # attention output, gate and up inside, and the fp32 softmax statistic.
    model = cm.MODELS["llama-70b"]
    h, kv, f, heads = 8192, 1024, 28672, 64
    p = plan(tp=8, sp=True, precision="bf16", seq_len=4096)
    selective = {**p, "recompute": "selective"}
    assert cm.executed_flops_per_token(model, selective) == cm.executed_flops_per_token(model, p)
    assert cm.activation_bytes_per_layer(model, selective) == 4096 * (
        3 * h * 2 / 8 + ((2 * h + 2 * kv + 2 * f) * 2 + 4 * heads) / 8)
    none = cm.activation_bytes_per_layer(model, p)
    assert cm.activation_bytes_per_layer(model, selective) / none == pytest.approx(0.55, abs=0.005)
    assert cm.messages_per_rank(model, selective)["tp_count"] == 4 * 80


def test_the_1000_gpu_page_conclusions_follow_from_the_planner():
    # docs/course/week-4/scaling-to-1000-gpus.md compares four layouts of Llama 70B on 1024
    # H100s, SP on both sides: the 2-D one with ZeRO-2 is the fastest and with ZeRO-1 the
    # slowest, interleaving lifts the 3-D one past the 2-D one under ZeRO-1, and the spread is
    # the "3% difference" the page says not to choose on without measuring.
    from tests.test_facts import stated

    def tokens_per_s(flags):
        args = parse_args(["--model", "llama-70b", "--seq-len", "4096", "--sp", *flags.split()])
        return cm.plan_training(model_of(args), plan_of(args),
                                cm.CLUSTERS[args.cluster])["tokens_per_s"]

    two_d = {z: tokens_per_s(f"--tp 8 --dp 128 --zero-stage {z} --micro-batches 8") for z in (1, 2)}
    three_d = {z: tokens_per_s(f"--tp 8 --pp 4 --dp 32 --zero-stage {z} --micro-batches 32 "
                               f"--virtual-stages 5") for z in (1, 2)}
    assert two_d[1] < three_d[1] < three_d[2] < two_d[2]
    [(line, (spread,))] = stated("course/week-4/scaling-to-1000-gpus.md",
                                 r"measure before choosing on a (\d+)% difference")
    assert int(spread) == round(100 * (two_d[2] / two_d[1] - 1)), \
        f"docs/course/week-4/scaling-to-1000-gpus.md:{line}"
