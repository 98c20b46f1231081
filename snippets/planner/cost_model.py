"""One cost model of training a GPT on a cluster: memory per GPU, FLOPs, step time, bubble.

The calculator page runs this same model in the browser: `snippets/planner/to_js.py` translates
this file into JavaScript when the site is built. So the file keeps to a small subset of Python
that has a direct JavaScript meaning: functions of dicts and numbers, arithmetic, `if`, `min`,
`max`, `math.floor`, f-strings and `raise PlannerError(...)`. The translator refuses anything else.
Optional plan and model keys are read with `option(...)`, so older plans keep working.

Units: bytes, FLOPs, seconds. "Rank" and "GPU" mean the same thing here.
"""

import math


class PlannerError(ValueError):
    pass


# --8<-- [start:presets]
# Model shapes. The course's own configs (snippets/models/gpt.py) and Llama-style models, whose
# published parameter counts the tests check: 6.74B, 13.0B, 69.0B, 405.9B. The course's configs
# also say how its GPT runs under bf16 autocast (see activation_bytes_per_layer): its readable
# RMSNorm computes in fp32 ("norm": "fp32") and, its weights being fp32, so does its residual
# stream ("residual": "fp32"); the published models keep both at the activations' precision.
MODELS = {
    "tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 172,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "tie_word_embeddings": True, "norm": "fp32", "residual": "fp32"},
    "small": {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 344,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
              "tie_word_embeddings": True, "norm": "fp32", "residual": "fp32"},
    "medium": {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 688,
               "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 8,
               "tie_word_embeddings": True, "norm": "fp32", "residual": "fp32"},
    "gpt2-small": {"vocab_size": 50257, "hidden_size": 768, "intermediate_size": 2048,
                   "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
                   "tie_word_embeddings": True, "norm": "fp32", "residual": "fp32"},
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
    # DeepSeek-V3 (arXiv:2412.19437, section 4.2; inference/configs/config_671B.json of
    # deepseek-ai/DeepSeek-V3): 671B parameters, 37B active per token. Every layer after the
    # first 3 is MoE: 1 shared and 256 routed experts of width 2048, 8 routed per token.
    # Attention is MLA: low-rank q (1536) and k/v (512 + 64 RoPE) projections, 128 heads with
    # q/k of 128 + 64 and v of 128; the multi-token-prediction module is left out.
    "deepseek-v3": {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "tie_word_embeddings": False,
                    "attention_parameters": (7168 * 1536 + 1536 * 128 * (128 + 64)
                                             + 7168 * (512 + 64) + 512 * 128 * (128 + 128)
                                             + 128 * 128 * 7168),
                    "attention_width": 128 * (128 + 64 + 128),
                    "num_experts": 256, "experts_per_token": 8, "shared_experts": 1,
                    "moe_intermediate_size": 2048, "first_dense_layers": 3},
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

# What a GPU loses before the model's tensors: the CUDA context, NCCL's buffers (per
# communicator, and a 3-D layout has several) and the caching allocator's fragmentation. An
# assumed round figure, not a measurement; the calculator page says how it is made up.
RESERVED_GB = 3
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


def bytes_per_parameter(plan):
    """The plan's precision's bytes per parameter. With fp32_main_grads the gradients are kept,
    accumulated and reduced in fp32, 4 bytes, as Megatron-LM's main grads are
    (--accumulate-allreduce-grads-in-fp32): 2 + 4 + 12 = 18 bytes in bf16 instead of 16."""
    bytes_per = PRECISIONS[plan["precision"]]
    gradients = bytes_per["gradients"]
    if option(plan, "fp32_main_grads", False):
        gradients = 4
    return {"weights": bytes_per["weights"], "gradients": gradients,
            "optimizer": bytes_per["optimizer"]}
# --8<-- [end:precision]


def check_positive_int(name, value):
    if not (value >= 1 and math.floor(value) == value):
        raise PlannerError(f"{name}={value} must be a whole number of at least 1")


# --8<-- [start:parameters]
def option(settings, name, fallback):
    """settings[name], or fallback where a model or plan leaves it out."""
    if name in settings:
        return settings[name]
    return fallback


def is_gpt3(model):
    """Two block designs. "llama" (the default, the course's GPT): RMSNorm, RoPE, SwiGLU MLP, no
    biases, no dropout, flash attention. "gpt3" (GPT-3 / Megatron-LM, the block Korthikanti et
    al. 2022 count): LayerNorm, learned positions, GELU MLP, biases, dropout, and attention that
    stores its score matrices."""
    return option(model, "architecture", "llama") == "gpt3"


def attention_parameters(model):
    """q and o are h x h; k and v are h x kv (fewer with GQA). A model may state its own count
    (DeepSeek-V3's MLA)."""
    h = model["hidden_size"]
    kv = model["num_key_value_heads"] * (h // model["num_attention_heads"])
    return option(model, "attention_parameters", 2 * h * h + 2 * h * kv)


def mlp_parameters(model, width):
    if is_gpt3(model):
        return 2 * model["hidden_size"] * width  # GELU MLP: up, down
    return 3 * model["hidden_size"] * width  # SwiGLU: gate, up, down


def matmul_parameters_per_layer(model):
    """A dense block's matmul parameters."""
    return attention_parameters(model) + mlp_parameters(model, model["intermediate_size"])


def parameters_per_layer(model):
    h, f = model["hidden_size"], model["intermediate_size"]
    if is_gpt3(model):
        kv = model["num_key_value_heads"] * (h // model["num_attention_heads"])
        biases = h + 2 * kv + h + f + h  # q, k, v, o, up, down
        return matmul_parameters_per_layer(model) + biases + 4 * h  # + 2 LayerNorms (gain, bias)
    return matmul_parameters_per_layer(model) + 2 * h  # plus the two RMSNorm gains


# Mixture of experts (optional model keys): after first_dense_layers dense blocks, every block's
# MLP is num_experts routed experts of width moe_intermediate_size, experts_per_token (top-k) of
# them per token, plus shared_experts that every token uses, and a router (h x num_experts).
def moe_layers(model):
    if option(model, "num_experts", 0) == 0:
        return 0
    return model["num_hidden_layers"] - option(model, "first_dense_layers", 0)


def expert_parameters(model):
    """One expert's parameters."""
    return mlp_parameters(model, model["moe_intermediate_size"])


def moe_shared_parameters_per_layer(model):
    """What every rank of an MoE block holds whatever ep is: attention, the shared experts, the
    router and the two norm gains; the routed experts are split ep ways."""
    return (attention_parameters(model) + option(model, "shared_experts", 0)
            * expert_parameters(model) + model["hidden_size"] * model["num_experts"]
            + 2 * model["hidden_size"])


def input_embedding_parameters(model):
    table = model["vocab_size"] * model["hidden_size"]
    if is_gpt3(model):
        table = table + model["max_position_embeddings"] * model["hidden_size"]  # learned positions
    return table


def embedding_parameters(model):
    if model["tie_word_embeddings"]:
        return input_embedding_parameters(model)
    return input_embedding_parameters(model) + model["vocab_size"] * model["hidden_size"]


def final_norm_parameters(model):
    if is_gpt3(model):
        return 2 * model["hidden_size"]  # LayerNorm: gain and bias
    return model["hidden_size"]


def parameter_count(model):
    moe = moe_layers(model)
    routed = 0
    if moe > 0:
        routed = moe * (moe_shared_parameters_per_layer(model)
                        + model["num_experts"] * expert_parameters(model))
    return ((model["num_hidden_layers"] - moe) * parameters_per_layer(model) + routed
            + embedding_parameters(model) + final_norm_parameters(model))
# --8<-- [end:parameters]


# --8<-- [start:stages]
# Pipeline stages. Stage 0 holds the input embedding, stage pp - 1 the final norm, the output
# head and the loss; the stages between hold only blocks. Layers split evenly when pp divides
# them; otherwise, by default, as the Llama 3 paper splits its 126 layers over 16 stages
# (arXiv:2407.21783, section 3.3.2: "we reduce one Transformer layer each from the first and
# the last stages"): first and last hold one layer fewer than the others. A plan may set
# first_stage_layers and last_stage_layers itself (0: the default); the middle stages share
# the rest equally.
def stage_layers(model, plan):
    """Layers on the first, each middle and the last stage (with pp = 1, the one stage)."""
    n, p = model["num_hidden_layers"], plan["pp"]
    if p == 1:
        return {"first": n, "middle": n, "last": n}
    first = option(plan, "first_stage_layers", 0)
    last = option(plan, "last_stage_layers", 0)
    # n // p: the even share, or, when n + 2 divides by p (validate refuses other splits), one
    # layer short of the middle stages' (n + 2)/p
    if first == 0:
        first = n // p
    if last == 0:
        last = n // p
    middle = 0
    if p > 2:
        middle = (n - first - last) // (p - 2)
    return {"first": first, "middle": middle, "last": last}


def layers_on_stage(model, plan, stage):
    layers = stage_layers(model, plan)
    if stage == 0:
        return layers["first"]
    if stage == plan["pp"] - 1:
        return layers["last"]
    return layers["middle"]


def moe_layers_on_stage(model, plan, stage):
    """The MoE blocks among a stage's layers: those past the model's first_dense_layers."""
    if moe_layers(model) == 0:
        return 0
    layers, start = stage_layers(model, plan), 0
    if stage > 0:
        start = layers["first"] + (stage - 1) * layers["middle"]
    end = start + layers_on_stage(model, plan, stage)
    return max(0, end - max(start, option(model, "first_dense_layers", 0)))


def output_head_parameters(model, plan):
    """The last stage's vocabulary projection. Untied, its own matrix; tied, the input
    embedding's, which a one-stage model shares and a pipeline copies onto its last stage
    (Megatron-LM keeps the copies equal by all-reducing their gradients)."""
    if model["tie_word_embeddings"] and plan["pp"] == 1:
        return 0
    return model["vocab_size"] * model["hidden_size"]


def stage_dense_parameters(model, plan, stage):
    """Parameters of a stage that every expert-parallel rank holds, before tensor parallelism."""
    layers, moe = layers_on_stage(model, plan, stage), moe_layers_on_stage(model, plan, stage)
    params = (layers - moe) * parameters_per_layer(model)
    if moe > 0:
        params = params + moe * moe_shared_parameters_per_layer(model)
    if stage == 0:
        params = params + input_embedding_parameters(model)
    if stage == plan["pp"] - 1:
        params = params + final_norm_parameters(model) + output_head_parameters(model, plan)
    return params
# --8<-- [end:stages]


# --8<-- [start:model-state]
def sharded_state_bytes(params, precision, zero_stage, dp):
    """Weights, gradients and optimizer state of `params` parameters on one of dp ranks: ZeRO
    shards the optimizer state (stage >= 1), the gradients (stage >= 2) and the weights (3)."""
    return shard_state(params, PRECISIONS[precision], zero_stage, dp)


def shard_state(params, bytes_per, zero_stage, dp):
    """sharded_state_bytes with bytes_per (a PRECISIONS row, or bytes_per_parameter's)."""
    weights = params * bytes_per["weights"] / (dp if zero_stage >= 3 else 1)
    gradients = params * bytes_per["gradients"] / (dp if zero_stage >= 2 else 1)
    optimizer = params * bytes_per["optimizer"] / (dp if zero_stage >= 1 else 1)
    return {"weights": weights, "gradients": gradients, "optimizer": optimizer,
            "total": weights + gradients + optimizer}


def model_state_bytes(model, plan, stage):
    """Model state held by one rank of pipeline stage `stage`. Tensor parallelism splits every
    matrix tp ways (the embedding and head vocabulary-parallel, as Megatron-LM does); expert
    parallelism gives each rank num_experts / ep of every MoE block's experts."""
    moe, ep = moe_layers_on_stage(model, plan, stage), option(plan, "ep", 1)
    dense = stage_dense_parameters(model, plan, stage) / plan["tp"]
    experts = 0
    if moe > 0:
        experts = moe * model["num_experts"] / ep * expert_parameters(model) / plan["tp"]
    # Context-parallel ranks hold the same weights, so ZeRO shards over dp x cp ranks; an
    # expert is held by the dp x cp / ep ranks of its expert-data-parallel group.
    shards = plan["dp"] * option(plan, "cp", 1)
    bytes_per = bytes_per_parameter(plan)
    state = shard_state(dense, bytes_per, plan["zero_stage"], shards)
    expert_state = shard_state(experts, bytes_per, plan["zero_stage"], shards / ep)
    # ZeRO-3 gathers one block's full weights to compute with it (and prefetches the next).
    gathered = 0
    if plan["zero_stage"] >= 3 and shards > 1:
        block = parameters_per_layer(model)
        if moe > 0:
            block = max(block, moe_shared_parameters_per_layer(model)
                        + model["num_experts"] / ep * expert_parameters(model))
        gathered = 2 * block / plan["tp"] * PRECISIONS[plan["precision"]]["weights"]
    return {"parameters": dense + experts, "dense_parameters": dense,
            "expert_parameters": experts,
            "weights": state["weights"] + expert_state["weights"],
            "gradients": state["gradients"] + expert_state["gradients"],
            "optimizer": state["optimizer"] + expert_state["optimizer"],
            "zero3_gathered": gathered,
            "total": state["total"] + expert_state["total"] + gathered}
# --8<-- [end:model-state]


# --8<-- [start:activations]
def recompute_mode(plan):
    """"none", "selective" (keep the matmuls' outputs, recompute what is cheap: for the "gpt3"
    block attention's softmax and dropout, for the "llama" block the elementwise ops; see
    activation_bytes_per_layer) or "full" (keep only each block's input); True and False mean
    "full" and "none", and a plan without the key (stage_messages' callers) none."""
    mode = option(plan, "recompute", False)
    if mode == True:  # noqa: E712 (a string is neither True nor False)
        return "full"
    if mode == False:  # noqa: E712
        return "none"
    return mode


def sequence_parallel_shards(plan):
    """Sequence parallelism splits the tensors between the tensor-parallel regions (norms,
    dropout, residual) along the sequence, tp ways; without it every TP rank holds them whole."""
    if option(plan, "sp", False):
        return plan["tp"]
    return 1


def residual_bytes(model, plan):
    """Bytes per element of the residual stream, the tensor between blocks. A model trained
    with fp32 weights under autocast (the course's GPT) keeps it in fp32: the embedding runs in
    its weight's dtype (it is on neither the CPU nor the CUDA autocast list), and each residual
    add of a bf16 block output promotes to fp32. Megatron-LM calls the same choice
    fp32_residual_connection. Otherwise it is kept at the activations' precision."""
    if option(model, "residual", "activations") == "fp32":
        return 4
    return PRECISIONS[plan["precision"]]["activations"]


def norm_bytes_per_token(model, plan, readers):
    """What one RMSNorm of a "llama" block keeps for backward per token, `readers` being the
    matmuls that read its output (3 for q, k, v; 2 for gate, up; 1 for the head): its input,
    the normalised vector before the gain, the fp32 1/rms, and its output as the matmuls keep
    it. By default the input is kept in the residual stream's dtype and the normalised vector
    at the activations' e bytes. "norm": "fp32" is the course's readable RMSNorm, which
    computes in fp32 by an explicit .float() (so on any device): its input in fp32 (the fp32
    residual itself, or its fp32 copy) and the normalised vector in fp32. The output has the
    residual stream's dtype; if that is not the matmuls' e bytes, autocast casts it once for
    each matmul (it caches casts of weights only), and each keeps its own copy."""
    h = model["hidden_size"]
    element = PRECISIONS[plan["precision"]]["activations"]
    residual = residual_bytes(model, plan)
    kept = h * residual + h * element
    if option(model, "norm", "activations") == "fp32":
        kept = 4 * h + 4 * h
    copies = 1
    if residual != element:
        copies = readers
    return kept + copies * h * element + 4


def activation_bytes_per_layer(model, plan):
    """Bytes one block saves for backward for one micro-batch, on one rank.

    Context parallelism gives each rank seq_len / cp of the tokens. Per token, with e bytes per
    element:
    - "llama" (the course's GPT, counted tensor by tensor; tests/test_planner.py checks it
      against a measurement in fp32 and under bf16 autocast): outside the TP regions the two
      RMSNorms' tensors (norm_bytes_per_token: 3h x e and an fp32 1/rms each where everything
      is kept at e bytes); inside them, in attention, q and the attention output (h each) and
      k after RoPE and v (kv each: num_key_value_heads x head_dim, less than h with
      grouped-query attention), 4 x intermediate in the SwiGLU MLP (gate, up, SiLU(gate),
      their product) and per head an fp32 softmax statistic (flash attention keeps no scores).
      The course's GPT under bf16 autocast (its presets: "norm" and "residual" "fp32") keeps,
      per norm, its fp32 input (the residual stream) and fp32 normalised vector (4h bytes
      each), the fp32 1/rms, and a bf16 copy of its output for each matmul reading it: 26h + 8
      bytes outside against 12h + 8 for an all-bf16 block; the inside tensors are bf16. Which
      tensors are fp32 follows from the code (the explicit .float(), fp32 weights, type
      promotion), not from a device's autocast lists: the bytes were measured under CPU
      autocast, and CUDA's lists (aten/src/ATen/autocast_mode.cpp) add fp32 ops (pow, rsqrt,
      log_softmax) that this GPT calls only on tensors already fp32; matmuls and attention are
      bf16 on both, the embedding, SiLU, products and adds on neither. The published models
      keep the default: norm tensors and residual stream at e bytes, 16-bit activations as
      Korthikanti et al. count them.
    - "gpt3": Korthikanti et al. 2022, section 4.1: outside the TP regions the two LayerNorm
      inputs, the QKV and MLP inputs (4h x e) and two 1-byte dropout masks (2h); inside, q, k,
      v and the attention output ((2h + 2kv) x e, 4h without GQA) and the GELU's input and
      output (2 x intermediate x e); and per head seq_len scores three times: softmax output
      (e), dropout mask (1 byte), dropout output (e). With e = 2, kv = h and intermediate =
      4h: sbh(34 + 5as/h).
    Tensor parallelism splits the inside tensors tp ways, sequence parallelism the outside ones.
    Full recomputation keeps only the block's input, in the residual stream's dtype. Selective
    recomputation:
    - "gpt3": drops the scores (Korthikanti et al. 2022, section 5: recompute attention's
      softmax, dropout and score matmuls; Megatron-Core's recompute_modules=["core_attn"]);
    - "llama": flash attention keeps no scores, so that would drop nothing (Megatron-Core warns
      as much: "For fused attention, you have no need to set 'core_attn' to recompute",
      megatron/core/transformer/transformer_config.py). Selective here keeps the outputs of the
      matmuls and of attention and recomputes the elementwise ops from them: the two RMSNorms,
      RoPE, SiLU and the gate-up product. This is TorchTitan's op-level save list (aten.mm, the
      scaled_dot_product_attention ops, reduce_scatter_tensor;
      torchtitan/distributed/activation_checkpoint.py) without its rule of recomputing every
      second matmul, and what Megatron-Core's output-discarding "layernorm" (and, for experts,
      "moe_act") recompute modules do. Kept per token: the block's input, the reduced outputs
      of the attention and MLP projections (o and down: they rebuild the residual stream the
      second norm reads; with TP the policy keeps them after the all-reduce or reduce-scatter,
      as TorchTitan keeps reduce_scatter_tensor's output, so the recompute sends nothing),
      3h outside (the input in the residual stream's dtype); q, k, v, the attention output,
      gate and up, (2h + 2kv + 2 x intermediate) inside, and the fp32 softmax statistic.
      snippets/planner/memory.py's SELECTIVE_SAVE is the policy, and tests/test_planner.py
      measures it on the course's block.
    """
    h, f, heads = model["hidden_size"], model["intermediate_size"], model["num_attention_heads"]
    kv = model["num_key_value_heads"] * (h // heads)
    tokens = plan["micro_batch_size"] * plan["seq_len"] / option(plan, "cp", 1)
    element = PRECISIONS[plan["precision"]]["activations"]
    outside_shards = sequence_parallel_shards(plan)
    mode = recompute_mode(plan)
    if mode == "full":
        return tokens * h * residual_bytes(model, plan) / outside_shards
    if is_gpt3(model):
        outside = 4 * h * element + 2 * h
        inside = (2 * h + 2 * kv + 2 * f) * element
        if mode != "selective":
            inside = inside + heads * plan["seq_len"] * (2 * element + 1)
    elif mode == "selective":
        outside = h * residual_bytes(model, plan) + 2 * h * element
        inside = (2 * h + 2 * kv + 2 * f) * element + 4 * heads
    else:
        outside = norm_bytes_per_token(model, plan, 3) + norm_bytes_per_token(model, plan, 2)
        inside = (2 * h + 2 * kv + 4 * f) * element + 4 * heads
    return tokens * (outside / outside_shards + inside / plan["tp"])


def moe_activation_bytes_per_layer(model, plan):
    """What an MoE block saves beyond a dense one, per micro-batch: its MLP tensors are those
    of experts_per_token + shared_experts experts of width moe_intermediate_size instead of one
    MLP of width intermediate_size, plus each routed copy of the token going into an expert and
    its output coming back (2 x experts_per_token x h), kept for the combine's backward. Under
    selective recomputation a "llama" expert keeps gate and up only (SiLU and the product are
    recomputed), and the routed copies stay (TorchTitan's save list keeps all_to_all_single's
    output, so that the recompute sends nothing). Counted, not measured: the course has no
    MoE block under this policy."""
    if recompute_mode(plan) == "full":
        return 0
    tokens = plan["micro_batch_size"] * plan["seq_len"] / option(plan, "cp", 1)
    element = PRECISIONS[plan["precision"]]["activations"]
    per_mlp = 4
    if is_gpt3(model) or recompute_mode(plan) == "selective":
        per_mlp = 2
    k, h = model["experts_per_token"], model["hidden_size"]
    width = (k + option(model, "shared_experts", 0)) * model["moe_intermediate_size"]
    extra = per_mlp * (width - model["intermediate_size"]) + 2 * k * h
    return tokens * extra * element / plan["tp"]


def first_stage_extra_activation_bytes(model, plan):
    """Per micro-batch, what the first stage keeps beyond its blocks: the int64 input ids (the
    embedding's output is the first block's saved input, counted there)."""
    return plan["micro_batch_size"] * plan["seq_len"] / option(plan, "cp", 1) * 8


def last_stage_extra_activation_bytes(model, plan):
    """Per micro-batch, what the last stage keeps beyond its blocks: the final norm (its input,
    the normalised vector and its output, the head's input: 3h per token, and for a "llama"
    block's RMSNorm the fp32 1/rms, as norm_bytes_per_token counts them), the fp32 log-softmax
    over the vocabulary (split tp ways by a vocabulary-parallel head) kept for the loss's
    backward, and the int64 targets. The head's logits themselves are not kept: the course's
    GPT casts them to fp32 explicitly before the loss, whose log-softmax keeps its output."""
    tokens = plan["micro_batch_size"] * plan["seq_len"] / option(plan, "cp", 1)
    norm = 3 * model["hidden_size"] * PRECISIONS[plan["precision"]]["activations"]
    if not is_gpt3(model):
        norm = norm_bytes_per_token(model, plan, 1)
    return tokens * (norm + 4 * model["vocab_size"] / plan["tp"] + 8)


def micro_batches_in_flight(plan, stage):
    """How many micro-batches' activations (of its layers) pipeline stage `stage` holds at once.
    GPipe runs every forward before any backward: all m, on every stage. 1F1B starts a stage's
    backwards after its warm-up forwards: stage i holds p - i (p on the first, 1 on the last).
    Interleaved 1F1B with v model chunks per rank (Megatron-LM's schedule) warms up with
    2(p - i - 1) + (v - 1)p chunk forwards and runs one more: p + (p - 2i - 1)/v stages' worth,
    p(1 + (p - 1)/(pv)) on the first (Korthikanti et al. 2022, section 4.2.3). Never more than
    all m."""
    p, m = plan["pp"], plan["micro_batches"]
    if p == 1:
        return 1
    if plan["schedule"] == "gpipe":
        return m
    v = option(plan, "virtual_stages", 1)
    if v > 1:
        return min(p + (p - 2 * stage - 1) / v, m)
    return min(p - stage, m)


def logits_in_flight(plan):
    """Micro-batches of logits the last stage holds: one under 1F1B, interleaved or not (each
    forward through the last chunk is followed by its backward), all m under GPipe."""
    if plan["pp"] > 1 and plan["schedule"] == "gpipe":
        return plan["micro_batches"]
    return 1


def activation_bytes(model, plan, stage):
    """Activations one rank of pipeline stage `stage` holds at their peak."""
    layers = layers_on_stage(model, plan, stage) * activation_bytes_per_layer(model, plan)
    moe = moe_layers_on_stage(model, plan, stage)
    if moe > 0:
        layers = layers + moe * moe_activation_bytes_per_layer(model, plan)
    held = layers * micro_batches_in_flight(plan, stage)
    if stage == 0:
        held = held + first_stage_extra_activation_bytes(model, plan) * micro_batches_in_flight(
            plan, stage)
    if stage == plan["pp"] - 1:
        held = held + last_stage_extra_activation_bytes(model, plan) * logits_in_flight(plan)
    return held
# --8<-- [end:activations]


# --8<-- [start:flops]
FLOP_CONVENTIONS = ("matmuls+attention", "matmuls+causal-attention", "matmuls", "6N")


def matmul_parameters(model):
    """Parameters that take part in a matmul per token: every block's projections and the
    output head (tied or not). The embedding lookup is a gather, not a matmul. An MoE block
    counts only its active parameters: attention, the router, the shared experts and the
    experts_per_token routed experts a token goes to."""
    moe = moe_layers(model)
    active = 0
    if moe > 0:
        active = moe * (attention_parameters(model) + model["hidden_size"] * model["num_experts"]
                        + (option(model, "shared_experts", 0) + model["experts_per_token"])
                        * expert_parameters(model))
    return ((model["num_hidden_layers"] - moe) * matmul_parameters_per_layer(model) + active
            + model["vocab_size"] * model["hidden_size"])


def attention_flops_per_token(model, seq_len, causal):
    """Attention's two seq_len x seq_len matmuls, q.k and probs.v, per token, forward and
    backward: 6 x layers x seq_len x (their widths summed over heads: 2 x hidden, or the
    model's attention_width), 12 x layers x seq_len x hidden for the full score matrix.
    causal: half of it. Under a causal mask query t meets only t + 1 keys, seq_len(seq_len+1)/2
    pairs in all, taken as seq_len^2/2 (a flash-attention kernel also computes the tiles on the
    diagonal whole, a few per cent more at these lengths)."""
    width = option(model, "attention_width", 2 * model["hidden_size"])
    flops = 6 * model["num_hidden_layers"] * seq_len * width
    if causal:
        return flops / 2
    return flops


def executes_causal_attention(model):
    """Whether the block's attention kernel skips the masked half of the score matrix. "llama"
    (flash attention, the course's scaled_dot_product_attention with is_causal=True) skips the
    tiles above the diagonal. "gpt3" (Megatron-LM 2021's attention, the one that stores its
    scores) computes the whole seq_len x seq_len product (a baddbmm), then masks it in the
    softmax, so it does the full count's work."""
    return not is_gpt3(model)


def training_flops_per_token(model, seq_len):
    """Model FLOPs per token: 6 per matmul parameter (2 forward, 4 backward) plus attention's
    score matmuls over the full (non-causal) matrix, as Narayanan et al. 2021 (eq. 3), PaLM
    (Chowdhery et al. 2022, appendix B: 6N + 12LHQT) and TorchTitan
    (torchtitan/models/utils.py: "we follow the convention and do not account for sparsity in
    causal attention") count them: 6N + 12 x layers x seq_len x hidden (see
    snippets/planner/flops.py). The numerator of MFU by default; not what a causal kernel
    runs (executed_flops_per_token)."""
    return 6 * matmul_parameters(model) + attention_flops_per_token(model, seq_len, False)


def model_flops_per_token(model, plan):
    """The numerator of MFU, by the plan's convention, so that a paper's MFU is compared with
    the count it states:
    - "matmuls+attention" (the default): training_flops_per_token, the full score matrix.
      Narayanan et al. 2021 (eq. 3), Korthikanti et al. 2022 and PaLM (appendix B) count it
      so, and Llama 3 reports "BF16 Model FLOPs Utilization (MFU; Chowdhery et al. (2023))",
      PaLM's definition (arXiv:2407.21783, section 3.3.2);
    - "matmuls+causal-attention": the score matmuls halved by the causal mask, as Megatron-LM
      counts them today (megatron/training/training.py, num_floating_point_operations: "causal
      mask (only half of the mask is non-zero)");
    - "matmuls": attention's score matmuls left out;
    - "6N": 6 x every parameter, embeddings included, no attention (Kaplan et al. 2020).
    Never recomputation. Step time does not depend on it: see executed_flops_per_token."""
    convention = option(plan, "flops", "matmuls+attention")
    if convention == "6N":
        return 6 * parameter_count(model)
    if convention == "matmuls":
        return 6 * matmul_parameters(model)
    if convention == "matmuls+causal-attention":
        return 6 * matmul_parameters(model) + attention_flops_per_token(model, plan["seq_len"],
                                                                          True)
    return training_flops_per_token(model, plan["seq_len"])


def executed_flops_per_token(model, plan):
    """What the GPUs really compute, whatever MFU counts: the matmuls, attention's score
    matmuls as the block's kernel runs them (half the matrix for a causal flash kernel, all
    of it for the "gpt3" block: executes_causal_attention), and recomputation. Full
    recomputation runs every forward again (+1/3). Selective recomputation: the "gpt3" block
    runs attention's score matmuls forward again (4 x seq_len x hidden per layer, the full
    matrix as that block computes it); the "llama" block reruns only elementwise ops (norms,
    RoPE, SiLU, products: see activation_bytes_per_layer), a few FLOPs per element against
    thousands per token in the matmuls, counted as zero. Step time uses this count."""
    flops = 6 * matmul_parameters(model) + attention_flops_per_token(
        model, plan["seq_len"], executes_causal_attention(model))
    mode = recompute_mode(plan)
    if mode == "full":
        return flops * 4 / 3
    if mode == "selective" and is_gpt3(model):
        return flops + 4 * model["num_hidden_layers"] * plan["seq_len"] * model["hidden_size"]
    return flops


def block_flops_per_token(model, plan, moe):
    """FLOPs one block executes per token in forward and backward, recomputation aside, as
    executed_flops_per_token counts them: a dense block, or (moe True) an MoE block with only
    its active experts."""
    params = matmul_parameters_per_layer(model)
    if moe:
        params = (attention_parameters(model) + model["hidden_size"] * model["num_experts"]
                  + (option(model, "shared_experts", 0) + model["experts_per_token"])
                  * expert_parameters(model))
    attention = attention_flops_per_token(model, plan["seq_len"],
                                          executes_causal_attention(model))
    return 6 * params + attention / model["num_hidden_layers"]


def stage_flops_per_token(model, plan, stage):
    """What one pipeline stage computes per token, recomputation included: its blocks, and on
    the last stage the output head. Summed over the stages: executed_flops_per_token."""
    moe = moe_layers_on_stage(model, plan, stage)
    flops = (layers_on_stage(model, plan, stage) - moe) * block_flops_per_token(model, plan, False)
    if moe > 0:
        flops = flops + moe * block_flops_per_token(model, plan, True)
    if stage == plan["pp"] - 1:
        flops = flops + 6 * model["vocab_size"] * model["hidden_size"]
    mode = recompute_mode(plan)
    if mode == "full":
        return flops * 4 / 3
    if mode == "selective" and is_gpt3(model):
        return (flops + 4 * layers_on_stage(model, plan, stage) * plan["seq_len"]
                * model["hidden_size"])
    return flops
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
def validate_model(model):
    for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "vocab_size"):
        check_positive_int(name, model[name])
    for name in ("norm", "residual"):
        if option(model, name, "activations") not in ("activations", "fp32"):
            raise PlannerError(f"{name}={option(model, name, '')} must be \"activations\" (kept "
                               f"at the activations' precision) or \"fp32\"")
    if model["hidden_size"] % model["num_attention_heads"] != 0:
        raise PlannerError(f"hidden_size={model['hidden_size']} is not divisible by "
                           f"num_attention_heads={model['num_attention_heads']}: choose heads "
                           f"of equal width")
    if model["num_attention_heads"] % model["num_key_value_heads"] != 0:
        raise PlannerError(f"num_attention_heads={model['num_attention_heads']} is not divisible"
                           f" by num_key_value_heads={model['num_key_value_heads']}: each key/"
                           f"value head serves a whole group of query heads")


def validate_stages(model, plan):
    n, p, v = model["num_hidden_layers"], plan["pp"], option(plan, "virtual_stages", 1)
    for name in ("first_stage_layers", "last_stage_layers"):
        value = option(plan, name, 0)
        if not (value >= 0 and math.floor(value) == value):
            raise PlannerError(f"{name}={value} must be a whole number (0: the default split)")
    chosen = option(plan, "first_stage_layers", 0) + option(plan, "last_stage_layers", 0) > 0
    if p > 1 and not chosen and n % p != 0 and (n + 2) % p != 0:
        raise PlannerError(f"num_hidden_layers={n} does not divide into pp={p} equal stages, "
                           f"nor with the first and last stage one layer short: choose pp "
                           f"among the divisors of {n} or {n + 2}, or set first_stage_layers "
                           f"and last_stage_layers")
    layers = stage_layers(model, plan)
    if layers["first"] < 1 or layers["last"] < 1:
        raise PlannerError(f"pp={p} leaves the first or last stage no layers: choose pp at most "
                           f"num_hidden_layers={n}")
    rest = n - layers["first"] - layers["last"]
    if p == 2 and rest != 0:
        raise PlannerError(f"first_stage_layers={layers['first']} and last_stage_layers="
                           f"{layers['last']} must add up to num_hidden_layers={n} with pp=2")
    if p > 2 and (layers["middle"] < 1 or (p - 2) * layers["middle"] != rest):
        raise PlannerError(f"first_stage_layers={layers['first']} and last_stage_layers="
                           f"{layers['last']} leave {rest} layers, which do not divide into "
                           f"pp - 2 = {p - 2} middle stages of at least one layer")
    if v > 1 and (plan["pp"] == 1 or plan["schedule"] != "1f1b"):
        raise PlannerError(f"virtual_stages={v} needs pp > 1 and the 1f1b schedule")
    widest = layers_on_stage(model, plan, min(1, p - 1))
    if widest % v != 0 or layers["first"] < v or layers["last"] < v:
        raise PlannerError(f"num_hidden_layers={n} does not divide into pp x virtual_stages="
                           f"{p * v} equal chunks")
    if v > 1 and plan["micro_batches"] < plan["pp"]:
        raise PlannerError(f"virtual_stages={v} needs micro_batches >= pp={plan['pp']}")


def validate(model, plan, cluster):
    validate_model(model)
    for name in ("dp", "tp", "pp", "micro_batch_size", "micro_batches", "seq_len"):
        check_positive_int(name, plan[name])
    cp, v = option(plan, "cp", 1), option(plan, "virtual_stages", 1)
    check_positive_int("cp", cp)
    check_positive_int("virtual_stages", v)
    if plan["precision"] not in PRECISIONS:
        raise PlannerError(f"precision={plan['precision']}: choose fp32, bf16 or fp8")
    if not (plan["zero_stage"] in (0, 1, 2, 3)):
        raise PlannerError(f"zero_stage={plan['zero_stage']}: choose 0 (plain DP), 1, 2 or 3")
    if not (recompute_mode(plan) in ("none", "selective", "full")):
        raise PlannerError(f"recompute={plan['recompute']}: choose none, selective or full")
    if not (option(plan, "flops", "matmuls+attention") in FLOP_CONVENTIONS):
        raise PlannerError(f"flops={plan['flops']}: choose matmuls+attention, matmuls or 6N")
    validate_stages(model, plan)
    if plan["seq_len"] % cp != 0:
        raise PlannerError(f"seq_len={plan['seq_len']} is not divisible by cp={cp}")
    if plan["tp"] > cluster["gpus_per_node"]:
        raise PlannerError(f"tp={plan['tp']} exceeds gpus_per_node={cluster['gpus_per_node']}:"
                           f" tensor parallelism needs the fast links inside one node")
    if model["num_key_value_heads"] % plan["tp"] != 0:
        raise PlannerError(f"num_key_value_heads={model['num_key_value_heads']} is not "
                           f"divisible by tp={plan['tp']}: each rank needs whole heads")
    if model["intermediate_size"] % plan["tp"] != 0:
        raise PlannerError(f"intermediate_size={model['intermediate_size']} is not divisible "
                           f"by tp={plan['tp']}")
    ep = option(plan, "ep", 1)
    check_positive_int("ep", ep)
    if ep > 1 and moe_layers(model) == 0:
        raise PlannerError(f"ep={ep} needs a mixture-of-experts model: this one has no experts")
    if ep > 1 and model["num_experts"] % ep != 0:
        raise PlannerError(f"num_experts={model['num_experts']} is not divisible by ep={ep}")
    if (plan["dp"] * cp) % ep != 0:
        raise PlannerError(f"ep={ep} does not divide dp x cp={plan['dp'] * cp}: the expert-"
                           f"parallel ranks are data-parallel ranks of the dense layers")


def stage_messages(model, plan, stage):
    """The messages plan_training prices for one rank of pipeline stage `stage`, in payload
    bytes (what a collective is handed): per micro-batch, tp_count TP messages of tp_message
    bytes and pp_count PP messages of pp_message bytes; per step (under ZeRO-0 and 1; 2 and 3
    send them more often), the gradients dp_dense and dp_experts; the parameters the rank
    holds; and each group's payload per step: tp, pp and dp.
    TP: 2 all-reduces of the rank's b x s/cp x h activations per block forward and 2 backward
    (with SP, a reduce-scatter plus an all-gather each: the same bytes), and with full
    recomputation the forward's 2 again in backward, when the block's forward reruns; selective
    recomputation reruns only attention's core ("gpt3"), inside the TP region, or elementwise
    ops from saved, already reduced outputs ("llama"), which sends nothing.
    PP: a micro-batch crosses each of the rank's v chunk boundaries twice (activation forward,
    gradient backward), each TP rank moving its 1/tp share (Megatron-LM scatters the
    activation over the TP group and gathers it again on the other side). tests/test_three_d.py
    checks them against the bytes the from-scratch 3-D run counts."""
    element = PRECISIONS[plan["precision"]]["activations"]
    activation = (plan["micro_batch_size"] * plan["seq_len"] / option(plan, "cp", 1)
                  * model["hidden_size"] * element)
    pp_message = activation / plan["tp"]
    tp_count, pp_count = 0, 0
    if plan["tp"] > 1:
        per_layer = 4
        if recompute_mode(plan) == "full":
            per_layer = 6
        tp_count = per_layer * layers_on_stage(model, plan, stage)
    if plan["pp"] > 1:
        pp_count = 2 * option(plan, "virtual_stages", 1)
    state = model_state_bytes(model, plan, stage)
    gradient = bytes_per_parameter(plan)["gradients"]
    dense = state["dense_parameters"] * gradient
    experts = state["expert_parameters"] * gradient
    m = plan["micro_batches"]
    return {"tp_message": activation, "tp_count": tp_count,
            "pp_message": pp_message, "pp_count": pp_count,
            "dp_dense": dense, "dp_experts": experts, "parameters": state["parameters"],
            "tp": m * tp_count * activation, "pp": m * pp_count * pp_message,
            "dp": dense + experts}


def messages_per_rank(model, plan):
    """stage_messages of the first stage."""
    return stage_messages(model, plan, 0)


def stage_memory(model, plan, stage):
    """Bytes one rank of pipeline stage `stage` holds: model state and activations."""
    state = model_state_bytes(model, plan, stage)
    activations = activation_bytes(model, plan, stage)
    return {"stage": stage, "layers": layers_on_stage(model, plan, stage),
            "parameters": state["parameters"], "weights": state["weights"],
            "gradients": state["gradients"], "optimizer": state["optimizer"],
            "zero3_gathered": state["zero3_gathered"], "activations": activations,
            "total": state["total"] + activations}


def stage_time(model, plan, cluster, stage):
    """Seconds one rank of pipeline stage `stage` spends per micro-batch, part by part (slot:
    all of them), and its data-parallel synchronisation per step, all and exposed."""
    cp, ep = option(plan, "cp", 1), option(plan, "ep", 1)
    gpus = plan["dp"] * plan["tp"] * plan["pp"] * cp
    layers = layers_on_stage(model, plan, stage)

    # Compute: the stage's FLOPs (recomputation included) for its dp rank's micro-batch, split
    # tp x cp ways.
    tokens_per_micro_batch = plan["micro_batch_size"] * plan["seq_len"]
    flops = stage_flops_per_token(model, plan, stage) * tokens_per_micro_batch
    peak = cluster["peak_tflops"][plan["precision"]] * 1e12
    compute_per_micro_batch = flops / (plan["tp"] * cp) / (peak * plan["mfu"])

    # Tensor parallelism: 2 all-reduces of a rank's b x s/cp x h activations per block in
    # forward and 2 in backward (2 more under full recomputation: the forward's, run again),
    # inside a node, on the critical path. Sequence parallelism turns each all-reduce into a
    # reduce-scatter plus an all-gather: the same bytes and time.
    element = PRECISIONS[plan["precision"]]["activations"]
    messages = stage_messages(model, plan, stage)
    intra = link(cluster, False)
    if option(plan, "sp", False):
        tp_message_time = 2 * ring_all_gather_time(messages["tp_message"], plan["tp"], intra)
    else:
        tp_message_time = ring_all_reduce_time(messages["tp_message"], plan["tp"], intra)
    tp_per_micro_batch = messages["tp_count"] * tp_message_time

    # Context parallelism (ring attention): per layer, each rank passes its K and V chunk
    # (s/cp tokens x the kv width / tp) around the ring, cp - 1 steps forward, and K, V plus
    # their gradients backward (3 x the forward bytes). Overlapped, it hides behind the
    # attention matmuls a rank executes (per layer, forward and backward, s/cp tokens of
    # attention_flops_per_token / tp: 12 x s/cp x s x h / tp, half that for a causal kernel).
    cp_per_micro_batch = 0
    if cp > 1:
        kv = model["num_key_value_heads"] * (model["hidden_size"] // model["num_attention_heads"])
        chunk = 2 * tokens_per_micro_batch / cp * kv / plan["tp"] * element
        cp_link = link(cluster, plan["tp"] * cp > cluster["gpus_per_node"])
        cp_per_layer = 3 * (cp - 1) * send_recv_time(chunk, cp_link)
        if option(plan, "cp_overlap", True):
            attention = (attention_flops_per_token(model, plan["seq_len"],
                                                   executes_causal_attention(model))
                         / model["num_hidden_layers"] * tokens_per_micro_batch / cp
                         / plan["tp"] / (peak * plan["mfu"]))
            cp_per_layer = max(0, cp_per_layer - attention)
        cp_per_micro_batch = layers * cp_per_layer

    # Expert parallelism: per MoE block, each rank sends its tokens' experts_per_token routed
    # copies (b x s/cp x k x h elements) to the ranks holding those experts and gets the outputs
    # back: dispatch and combine, in forward and again in backward, 4 all-to-alls in which
    # (ep - 1)/ep of the bytes leave the rank, in ep - 1 messages. The group spans nodes once
    # tp x cp x ep outgrows one. Overlapped, it hides behind the micro-batch's compute.
    ep_per_micro_batch = 0
    if ep > 1:
        a2a = (tokens_per_micro_batch / cp * model["experts_per_token"] * model["hidden_size"]
               * element * (ep - 1) / ep)
        ep_link = link(cluster, plan["tp"] * cp * ep > cluster["gpus_per_node"])
        a2a_time = (ep - 1) * ep_link["alpha"] + a2a / ep_link["beta"]
        ep_per_micro_batch = moe_layers_on_stage(model, plan, stage) * 4 * a2a_time
        if option(plan, "ep_overlap", False):
            ep_per_micro_batch = max(0, ep_per_micro_batch - compute_per_micro_batch)

    # Pipeline: each micro-batch crosses each of a rank's v chunk boundaries twice (activation
    # forward, gradient backward); stages span nodes once tp x cp x ep x pp outgrows one node.
    pp_link = link(cluster, plan["tp"] * cp * ep * plan["pp"] > cluster["gpus_per_node"])
    pp_per_micro_batch = 0
    if plan["pp"] > 1:
        pp_per_micro_batch = messages["pp_count"] * send_recv_time(messages["pp_message"],
                                                                   pp_link)

    # Data parallelism over the outermost dimension, among the dp x cp ranks that hold the same
    # weights. ZeRO-0/1 synchronise the gradients once per step: an all-reduce, or a
    # reduce-scatter plus an all-gather of the updated weights, the same bytes; DDP-style
    # overlap hides it behind the last micro-batch's backward (2/3 of its compute). ZeRO-2 keeps
    # only a shard of the gradients, so it reduce-scatters after every micro-batch (each behind
    # its backward). ZeRO-3 also all-gathers the weights before every micro-batch's forward and
    # again in its backward (1.5 all-reduces per micro-batch); prefetching hides them behind all
    # of the compute.
    m = plan["micro_batches"]
    dp_group = plan["dp"] * cp
    dp_link = link(cluster, gpus > cluster["gpus_per_node"])
    # With experts, the dense gradients sync over dp x cp ranks and each expert's over the
    # dp x cp / ep ranks that hold it, one after the other.
    dense_bytes, expert_bytes = messages["dp_dense"], messages["dp_experts"]
    gather = ring_all_gather_time(dense_bytes, dp_group, dp_link)  # = one reduce-scatter
    if expert_bytes > 0:
        gather = gather + ring_all_gather_time(expert_bytes, dp_group / ep, dp_link)
    if plan["zero_stage"] == 3:
        dp_time = m * 3 * gather
        hidden = m * compute_per_micro_batch
    elif plan["zero_stage"] == 2:
        dp_time = m * gather + gather
        hidden = m * 2 / 3 * compute_per_micro_batch
    else:
        dp_time = 2 * gather  # an all-reduce: a reduce-scatter, then an all-gather
        hidden = 2 / 3 * compute_per_micro_batch
    return {"stage": stage, "compute": compute_per_micro_batch,
            "tensor_parallel": tp_per_micro_batch, "context_parallel": cp_per_micro_batch,
            "expert_parallel": ep_per_micro_batch, "pipeline_p2p": pp_per_micro_batch,
            "slot": (compute_per_micro_batch + tp_per_micro_batch + cp_per_micro_batch
                     + ep_per_micro_batch + pp_per_micro_batch),
            "data_parallel": dp_time, "data_parallel_exposed": max(0, dp_time - hidden)}


def plan_training(model, plan, cluster):
    """Memory per GPU, step time, throughput, bubble and MFU for one training configuration.

    plan: dp, tp, pp (group sizes), zero_stage (0-3), precision (fp32, bf16, fp8), recompute
    ("none", "selective", "full"; or a bool), micro_batch_size, micro_batches (per step, per
    data-parallel rank: pipeline micro-batches or gradient-accumulation steps), seq_len,
    schedule ("1f1b" or "gpipe"), mfu (the fraction of peak FLOP/s the matmuls reach while they
    run: kernel efficiency, not the end-to-end MFU this returns). Optional, with their defaults:
    sp (False: sequence parallelism), cp (1: context-parallel size), cp_overlap (True: ring
    attention's K/V exchange hidden behind attention's compute), virtual_stages (1: model
    chunks per rank for interleaved 1F1B), flops ("matmuls+attention": what MFU counts, see
    model_flops_per_token; step time counts what the kernels execute, causal attention halved),
    ep (1: expert-parallel size, carved out of dp x cp), ep_overlap (False: the all-to-alls
    hidden behind another micro-batch's compute, as DeepSeek's DualPipe schedules them),
    first_stage_layers and last_stage_layers (0: the default split, see stage_layers),
    fp32_main_grads (False; True keeps the gradients in fp32, see bytes_per_parameter).
    Rank order, innermost first: tp, cp, ep (inside dp), pp, dp; dp x tp x pp x cp GPUs in all.

    Memory is reported per stage (first, the busiest middle one, last; with pp = 1 all three
    are the one stage), and memory_bytes is the busiest stage's: the one that decides whether
    the layout fits, with RESERVED_GB on top (memory_fraction counts it too). Time is the
    slowest stage's: every stage waits for it once per micro-batch.
    """
    validate(model, plan, cluster)
    cp, v = option(plan, "cp", 1), option(plan, "virtual_stages", 1)
    m, p = plan["micro_batches"], plan["pp"]
    gpus = plan["dp"] * plan["tp"] * p * cp
    capacity = cluster["gpu_memory_gb"] * 1e9
    reserved = RESERVED_GB * 1e9
    per_stage = {"first": stage_memory(model, plan, 0),
                 "middle": stage_memory(model, plan, min(1, p - 1)),
                 "last": stage_memory(model, plan, p - 1)}
    busiest = per_stage["first"]
    for role in ("middle", "last"):
        if per_stage[role]["total"] > busiest["total"]:
            busiest = per_stage[role]
    slowest = stage_time(model, plan, cluster, 0)
    sync, priced = slowest, 0
    for role in ("middle", "last"):
        if per_stage[role]["stage"] > priced:  # not the stage before it again (pp < 3)
            priced = per_stage[role]["stage"]
            times = stage_time(model, plan, cluster, priced)
            if times["slot"] > slowest["slot"]:
                slowest = times
            if times["data_parallel_exposed"] > sync["data_parallel_exposed"]:
                sync = times

    # The bubble: (p - 1)/v slots of idling against m of work, (p - 1)/(v m) of the ideal time
    # (Narayanan et al. 2021, section 2.2.2); the slot is the slowest stage's.
    pipeline_time = (m + (p - 1) / v) * slowest["slot"]
    bubble = (p - 1) / v / (m + (p - 1) / v)
    step_time = pipeline_time + sync["data_parallel_exposed"]
    tokens_per_step = plan["micro_batch_size"] * plan["seq_len"] * m * plan["dp"]
    tokens_per_s = tokens_per_step / step_time
    peak = cluster["peak_tflops"][plan["precision"]] * 1e12
    return {
        "gpus": gpus,
        "parameters": parameter_count(model),
        "parameters_per_gpu": busiest["parameters"],
        "memory_bytes": {"weights": busiest["weights"], "gradients": busiest["gradients"],
                         "optimizer": busiest["optimizer"],
                         "zero3_gathered": busiest["zero3_gathered"],
                         "activations": busiest["activations"], "total": busiest["total"]},
        "memory_per_stage": per_stage,
        "busiest_stage": busiest["stage"],
        # It fits when the tensors and the reserve together fit in the GPU's memory.
        "reserved_bytes": reserved,
        "fits": busiest["total"] + reserved <= capacity,
        "memory_fraction": (busiest["total"] + reserved) / capacity,
        "flops_per_token": model_flops_per_token(model, plan),
        "time_s": {"compute": m * slowest["compute"],
                   "tensor_parallel": m * slowest["tensor_parallel"],
                   "context_parallel": m * slowest["context_parallel"],
                   "expert_parallel": m * slowest["expert_parallel"],
                   "pipeline_p2p": m * slowest["pipeline_p2p"],
                   "bubble": bubble * pipeline_time,
                   "data_parallel": sync["data_parallel"],
                   "data_parallel_exposed": sync["data_parallel_exposed"],
                   "step": step_time},
        "slowest_stage": slowest["stage"],
        "bubble_fraction": bubble,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        # MFU: model FLOPs (by the plan's convention, recomputation not counted) per second,
        # over the peak of all the GPUs.
        "model_flops_utilization": (model_flops_per_token(model, plan) * tokens_per_s
                                    / (gpus * peak)),
    }
# --8<-- [end:plan]
