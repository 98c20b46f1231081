"""One cost model of training a GPT on a cluster: memory per GPU, FLOPs, step time, bubble.

The calculator page runs this same model in the browser: `snippets/planner/to_js.py` translates
this file into JavaScript when the site is built. So the file keeps to a small subset of Python
that has a direct JavaScript meaning: functions of dicts and numbers, arithmetic, `if`, `min`,
`max`, `math.ceil`, f-strings and `raise PlannerError(...)`. The translator refuses anything else.

Units: bytes, FLOPs, seconds. "Rank" and "GPU" mean the same thing here.
"""

import math


class PlannerError(ValueError):
    pass


# --8<-- [start:presets]
# Model shapes. The course's own configs (snippets/models/gpt.py) and Llama-style models, whose
# published parameter counts the tests check: 6.74B, 13.0B, 69.0B, 405.9B.
MODELS = {
    "tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 172,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "tie_word_embeddings": True},
    "small": {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 344,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
              "tie_word_embeddings": True},
    "medium": {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 688,
               "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 8,
               "tie_word_embeddings": True},
    "gpt2-small": {"vocab_size": 50257, "hidden_size": 768, "intermediate_size": 2048,
                   "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
                   "tie_word_embeddings": True},
    "llama-7b": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                 "tie_word_embeddings": False},
    "llama-13b": {"vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824,
                  "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
                  "tie_word_embeddings": False},
    "llama-70b": {"vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
                  "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                  "tie_word_embeddings": False},
    "llama-405b": {"vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248,
                   "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
                   "tie_word_embeddings": False},
}

# One GPU (or this CPU) and its links. Peak FLOP/s are dense (no sparsity), per precision.
# Link bandwidths are per GPU, one direction; latencies are per message.
CLUSTERS = {
    "H100 SXM, 8 per node, InfiniBand 400 Gb/s": {
        "gpus_per_node": 8, "gpu_memory_gb": 80,
        "peak_tflops": {"fp32": 67, "bf16": 989, "fp8": 1979},
        "intra_node_gbps": 450, "intra_node_latency_us": 3,
        "inter_node_gbps": 50, "inter_node_latency_us": 10},
    "A100 SXM 80GB, 8 per node, InfiniBand 200 Gb/s": {
        "gpus_per_node": 8, "gpu_memory_gb": 80,
        "peak_tflops": {"fp32": 19.5, "bf16": 312, "fp8": 312},
        "intra_node_gbps": 300, "intra_node_latency_us": 3,
        "inter_node_gbps": 25, "inter_node_latency_us": 10},
    # This course's 2-core CPU as two ranks of one core each: the matmul peak `make bench`
    # measured on both cores (195 GFLOP/s fp32, 434 bf16), halved, and a gloo loopback link.
    "This course's 2-core CPU (gloo)": {
        "gpus_per_node": 2, "gpu_memory_gb": 24,
        "peak_tflops": {"fp32": 0.0975, "bf16": 0.217, "fp8": 0.217},
        "intra_node_gbps": 1.0, "intra_node_latency_us": 300,
        "inter_node_gbps": 1.0, "inter_node_latency_us": 300},
}
# --8<-- [end:presets]


# --8<-- [start:precision]
# Bytes per parameter for AdamW, and per saved activation element, by training recipe.
PRECISIONS = {
    # everything fp32: weights 4, gradients 4, Adam's two moments 4 + 4
    "fp32": {"weights": 4, "gradients": 4, "optimizer": 8, "activations": 4},
    # the ZeRO paper's mixed precision: bf16 weights and gradients, and an fp32 master copy of
    # the weights plus the two fp32 moments in the optimizer: K = 12, 16 bytes in all
    "bf16": {"weights": 2, "gradients": 2, "optimizer": 12, "activations": 2},
    # fp8 matmuls keep the bf16 recipe's state and add an fp8 copy of the weights (1 byte); saved
    # activations stay bf16 here (the conservative choice: recipes differ in what they store)
    "fp8": {"weights": 3, "gradients": 2, "optimizer": 12, "activations": 2},
}
# --8<-- [end:precision]


def check_positive_int(inputs, name):
    value = inputs[name]
    if not (value >= 1 and math.floor(value) == value):
        raise PlannerError(f"{name}={value} must be a whole number of at least 1")


# --8<-- [start:parameters]
def parameters_per_layer(model):
    h = model["hidden_size"]
    kv = model["num_key_value_heads"] * (h // model["num_attention_heads"])
    attention = 2 * h * h + 2 * h * kv  # q and o are h x h; k and v are h x kv (fewer with GQA)
    mlp = 3 * h * model["intermediate_size"]  # SwiGLU: gate, up, down
    return attention + mlp + 2 * h  # plus the two RMSNorm gains


def embedding_parameters(model):
    table = model["vocab_size"] * model["hidden_size"]
    if model["tie_word_embeddings"]:
        return table
    return 2 * table  # a separate output head


def parameter_count(model):
    return (model["num_hidden_layers"] * parameters_per_layer(model)
            + embedding_parameters(model) + model["hidden_size"])  # + the final RMSNorm
# --8<-- [end:parameters]


# --8<-- [start:model-state]
def sharded_state_bytes(params, precision, zero_stage, dp):
    """Weights, gradients and optimizer state of `params` parameters on one of dp ranks: ZeRO
    shards the optimizer state (stage >= 1), the gradients (stage >= 2) and the weights (3)."""
    bytes_per = PRECISIONS[precision]
    weights = params * bytes_per["weights"] / (dp if zero_stage >= 3 else 1)
    gradients = params * bytes_per["gradients"] / (dp if zero_stage >= 2 else 1)
    optimizer = params * bytes_per["optimizer"] / (dp if zero_stage >= 1 else 1)
    return {"weights": weights, "gradients": gradients, "optimizer": optimizer,
            "total": weights + gradients + optimizer}


def model_state_bytes(model, plan):
    """Model state held by the busiest rank. Tensor parallelism splits every matrix tp ways;
    pipeline parallelism gives each stage num_hidden_layers / pp layers, and the first stage
    also holds the embedding (so it is the busiest)."""
    layers = model["num_hidden_layers"] // plan["pp"]
    params = (layers * parameters_per_layer(model) + embedding_parameters(model)) / plan["tp"]
    if plan["pp"] == 1:
        params = params + model["hidden_size"] / plan["tp"]
    state = sharded_state_bytes(params, plan["precision"], plan["zero_stage"], plan["dp"])
    # ZeRO-3 gathers one block's full weights to compute with it (and prefetches the next).
    gathered = 0
    if plan["zero_stage"] >= 3 and plan["dp"] > 1:
        gathered = (2 * parameters_per_layer(model) / plan["tp"]
                    * PRECISIONS[plan["precision"]]["weights"])
    return {"parameters": params, "weights": state["weights"], "gradients": state["gradients"],
            "optimizer": state["optimizer"], "zero3_gathered": gathered,
            "total": state["total"] + gathered}
# --8<-- [end:model-state]


# --8<-- [start:activations]
def activation_bytes_per_layer(model, plan):
    """Bytes one block saves for backward for one micro-batch: the course's GPT block counted
    tensor by tensor (tests/test_planner.py checks it against a measurement).

    Per token: 3h for each RMSNorm (its input, the normalised vector, the output), 4h inside
    attention (q and k after RoPE, v, the attention output), 4 x intermediate in the SwiGLU MLP
    (gate, up, SiLU(gate), their product), and per head one softmax statistic. Tensor
    parallelism splits attention and MLP tensors tp ways; the norms' 6h are replicated.
    Recomputation keeps only the block's input.
    """
    h, f, heads = model["hidden_size"], model["intermediate_size"], model["num_attention_heads"]
    tokens = plan["micro_batch_size"] * plan["seq_len"]
    element = PRECISIONS[plan["precision"]]["activations"]
    if plan["recompute"]:
        return tokens * h * element
    split = (4 * h + 4 * f) / plan["tp"]
    fp32_statistics = 4 * (2 + heads / plan["tp"])  # RMSNorm's 1/rms twice, softmax per head
    return tokens * ((6 * h + split) * element + fp32_statistics)


def activation_bytes_outside_layers(model, plan):
    """The embedding output and final norm (3h per token), the fp32 log-softmax over the
    vocabulary kept for the loss's backward, and the int64 input ids and targets."""
    tokens = plan["micro_batch_size"] * plan["seq_len"]
    element = PRECISIONS[plan["precision"]]["activations"]
    return tokens * (3 * model["hidden_size"] * element + 4 * model["vocab_size"] / plan["tp"]
                     + 16)


def micro_batches_in_flight(plan):
    """How many micro-batches' activations a pipeline stage holds at once: GPipe runs every
    forward before any backward (all m); 1F1B starts backwards after pp forwards (at most pp)."""
    if plan["pp"] == 1:
        return 1
    if plan["schedule"] == "gpipe":
        return plan["micro_batches"]
    return min(plan["pp"], plan["micro_batches"])


def activation_bytes(model, plan):
    layers = model["num_hidden_layers"] // plan["pp"]
    per_micro_batch = (layers * activation_bytes_per_layer(model, plan)
                       + activation_bytes_outside_layers(model, plan))
    return per_micro_batch * micro_batches_in_flight(plan)
# --8<-- [end:activations]


# --8<-- [start:flops]
def training_flops_per_token(model, seq_len):
    """6 FLOPs per matmul parameter per token (2 forward, 4 backward) plus attention's two
    seq_len x seq_len matmuls: 12 x layers x seq_len x hidden (see snippets/planner/flops.py)."""
    h = model["hidden_size"]
    matmul_params = model["num_hidden_layers"] * (parameters_per_layer(model) - 2 * h)
    matmul_params = matmul_params + model["vocab_size"] * h  # the output head (tied or not)
    return 6 * matmul_params + 12 * model["num_hidden_layers"] * seq_len * h
# --8<-- [end:flops]


# --8<-- [start:communication]
def link(cluster, spans_nodes):
    """(latency in s, bandwidth in bytes/s) of the link a process group uses."""
    if spans_nodes:
        return {"alpha": cluster["inter_node_latency_us"] * 1e-6,
                "beta": cluster["inter_node_gbps"] * 1e9}
    return {"alpha": cluster["intra_node_latency_us"] * 1e-6,
            "beta": cluster["intra_node_gbps"] * 1e9}


def ring_all_reduce_time(size, ranks, lnk):
    """Ring all-reduce: 2(N-1) steps, each sending size/N bytes (reduce-scatter, then all-gather)."""
    if ranks == 1:
        return 0
    return 2 * (ranks - 1) * (lnk["alpha"] + size / ranks / lnk["beta"])


def ring_all_gather_time(size, ranks, lnk):
    """All-gather (or reduce-scatter) of a size-byte result: N-1 steps of size/N bytes."""
    if ranks == 1:
        return 0
    return (ranks - 1) * (lnk["alpha"] + size / ranks / lnk["beta"])


def send_recv_time(size, lnk):
    return lnk["alpha"] + size / lnk["beta"]
# --8<-- [end:communication]


# --8<-- [start:plan]
def validate(model, plan, cluster):
    for name in ("dp", "tp", "pp", "micro_batch_size", "micro_batches", "seq_len"):
        check_positive_int(plan, name)
    if plan["precision"] not in PRECISIONS:
        raise PlannerError(f"precision={plan['precision']}: choose fp32, bf16 or fp8")
    if not (plan["zero_stage"] in (0, 1, 2, 3)):
        raise PlannerError(f"zero_stage={plan['zero_stage']}: choose 0 (plain DP), 1, 2 or 3")
    if model["num_hidden_layers"] % plan["pp"] != 0:
        raise PlannerError(f"num_hidden_layers={model['num_hidden_layers']} does not divide "
                           f"into pp={plan['pp']} equal stages: choose pp among its divisors")
    if model["num_key_value_heads"] % plan["tp"] != 0:
        raise PlannerError(f"num_key_value_heads={model['num_key_value_heads']} is not "
                           f"divisible by tp={plan['tp']}: each rank needs whole heads")
    if model["intermediate_size"] % plan["tp"] != 0:
        raise PlannerError(f"intermediate_size={model['intermediate_size']} is not divisible "
                           f"by tp={plan['tp']}")
    if plan["tp"] > cluster["gpus_per_node"]:
        raise PlannerError(f"tp={plan['tp']} exceeds gpus_per_node={cluster['gpus_per_node']}:"
                           f" tensor parallelism needs the fast links inside one node")


def plan_training(model, plan, cluster):
    """Memory per GPU, step time, throughput and bubble for one training configuration.

    plan: dp, tp, pp (the three group sizes; dp x tp x pp GPUs in all), zero_stage (0-3),
    precision (fp32, bf16, fp8), recompute (bool), micro_batch_size, micro_batches (per step,
    per data-parallel rank: pipeline micro-batches or gradient-accumulation steps), seq_len,
    schedule ("1f1b" or "gpipe"), mfu (the fraction of peak FLOP/s the matmuls reach).
    """
    validate(model, plan, cluster)
    gpus = plan["dp"] * plan["tp"] * plan["pp"]
    state = model_state_bytes(model, plan)
    activations = activation_bytes(model, plan)
    memory = state["total"] + activations
    capacity = cluster["gpu_memory_gb"] * 1e9

    # Compute: every GPU does 1/(tp x pp) of the FLOPs of its dp rank's micro-batches;
    # recomputation adds one more forward (a third of forward + backward).
    tokens_per_micro_batch = plan["micro_batch_size"] * plan["seq_len"]
    flops = training_flops_per_token(model, plan["seq_len"]) * tokens_per_micro_batch
    if plan["recompute"]:
        flops = flops * 4 / 3
    peak = cluster["peak_tflops"][plan["precision"]] * 1e12
    compute_per_micro_batch = flops / (plan["tp"] * plan["pp"]) / (peak * plan["mfu"])

    # Tensor parallelism: 2 all-reduces of the b x s x h activations per block in forward and 2
    # in backward, inside a node, on the critical path.
    element = PRECISIONS[plan["precision"]]["activations"]
    activation_message = tokens_per_micro_batch * model["hidden_size"] * element
    layers_per_stage = model["num_hidden_layers"] // plan["pp"]
    intra = link(cluster, False)
    tp_per_micro_batch = 4 * layers_per_stage * ring_all_reduce_time(
        activation_message, plan["tp"], intra)

    # Pipeline: each micro-batch crosses each stage boundary twice (activation forward,
    # gradient backward); stages span nodes once tp x pp outgrows one node.
    pp_link = link(cluster, plan["tp"] * plan["pp"] > cluster["gpus_per_node"])
    pp_per_micro_batch = 0
    if plan["pp"] > 1:
        pp_per_micro_batch = 2 * send_recv_time(activation_message / plan["tp"], pp_link)
    slot = compute_per_micro_batch + tp_per_micro_batch + pp_per_micro_batch
    m, p = plan["micro_batches"], plan["pp"]
    pipeline_time = (m + p - 1) * slot
    bubble = (p - 1) / (m + p - 1)

    # Data parallelism over the outermost dimension. Gradients are synchronised once per step:
    # an all-reduce, or under ZeRO-1/2 a reduce-scatter plus an all-gather of the updated
    # weights, the same bytes. DDP-style overlap hides it behind the last micro-batch's backward
    # (2/3 of its compute). ZeRO-3 reduce-scatters the gradients once (half an all-reduce) but
    # all-gathers the weights before every micro-batch's forward and again in its backward (one
    # all-reduce's bytes per micro-batch: 1.5x DDP for m = 1); prefetching hides the gathers
    # behind all of the compute.
    dp_link = link(cluster, gpus > cluster["gpus_per_node"])
    gradient_bytes = state["parameters"] * PRECISIONS[plan["precision"]]["gradients"]
    all_reduce = ring_all_reduce_time(gradient_bytes, plan["dp"], dp_link)
    if plan["zero_stage"] == 3:
        dp_time = all_reduce / 2 + m * all_reduce
        hidden = m * compute_per_micro_batch
    else:
        dp_time = all_reduce
        hidden = 2 / 3 * compute_per_micro_batch
    exposed_dp = max(0, dp_time - hidden)

    step_time = pipeline_time + exposed_dp
    tokens_per_step = tokens_per_micro_batch * m * plan["dp"]
    return {
        "gpus": gpus,
        "parameters": parameter_count(model),
        "parameters_per_gpu": state["parameters"],
        "memory_bytes": {"weights": state["weights"], "gradients": state["gradients"],
                         "optimizer": state["optimizer"],
                         "zero3_gathered": state["zero3_gathered"],
                         "activations": activations, "total": memory},
        "fits": memory <= capacity,
        "memory_fraction": memory / capacity,
        "flops_per_token": training_flops_per_token(model, plan["seq_len"]),
        "time_s": {"compute": m * compute_per_micro_batch, "tensor_parallel": m * tp_per_micro_batch,
                   "pipeline_p2p": m * pp_per_micro_batch, "bubble": bubble * pipeline_time,
                   "data_parallel": dp_time, "data_parallel_exposed": exposed_dp,
                   "step": step_time},
        "bubble_fraction": bubble,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / step_time,
    }
# --8<-- [end:plan]
