"""Training throughput of the course's GPT, readable and fused, against nanoGPT's architecture.

At the small and medium configs, six models train side by side in one process: the readable
GPT, the same GPT after `fuse` (snippets/models/fused.py), the fused GPT under torch.compile, a
nanoGPT-shaped model with the same shapes and FLOPs per token (snippets/models/nanogpt.py:
matched_to), eager and compiled, and an ablation. Each step is forward + backward + fused
AdamW on one fixed batch; the steps are interleaved round by round and timed by this process's
CPU time (median_seconds), on one thread, and the whole race is run three times (measure).
With equal FLOPs per token, the ratio of model-FLOP throughputs is the inverse ratio of step
times; both FLOP counts are computed and stored, so the claim is checked, not assumed.

The ablation, `fused_layernorm_no_rope`, is not the course's model: it is the fused
GPT with two of GPT-2's choices where the blocks differ in elementwise work, LayerNorm (one
native kernel each way) for RMSNorm and no RoPE (`gpt2_norm_and_positions`). Its ratio to
nanoGPT says how much of the fused path's gap is the Llama block's own work rather than how
the block is implemented.

    python -m snippets.bench --only fused --merge --out bench.json
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from snippets.machine import machine_info
from snippets.models.fused import FusedAttention, FusedRMSNorm, compile_model, fuse
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.models.nanogpt import NanoGPT, matched_to
from snippets.models.nanogpt import training_flops_per_token as nanogpt_flops_per_token
from snippets.planner.flops import training_flops_per_token
from snippets.scripts.precision_and_accumulation import median_seconds

SHAPES = (("small", 8), ("medium", 8))  # config, batch size; sequences are the full context


class AttentionWithoutRoPE(nn.Module):
    """A FusedAttention's projections and attention with the rotation left out: q and k go
    into attention as the projection computes them, as in GPT-2."""

    def __init__(self, attn: FusedAttention):
        super().__init__()
        self.qkv_proj, self.o_proj, self.head_dim = attn.qkv_proj, attn.o_proj, attn.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).view(B, T, 3, -1, self.head_dim).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def gpt2_norm_and_positions(model):
    """The ablation, in place, on a fused GPT: each FusedRMSNorm becomes a bias-free LayerNorm
    with the same weight and eps, each FusedAttention an AttentionWithoutRoPE. The matmuls,
    SwiGLU and the loss are the fused path's, so the FLOPs per token are unchanged; the
    outputs are another model's."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, FusedRMSNorm):
                norm = nn.LayerNorm(child.weight.shape[0], eps=child.eps, bias=False,
                                    device=child.weight.device)
                norm.weight = child.weight
                setattr(module, name, norm)
            elif isinstance(child, FusedAttention):
                setattr(module, name, AttentionWithoutRoPE(child))
    return model


def make_step(model, inputs, targets, autocast: str | None = None):
    """One training step on a fixed batch: forward (under bf16 autocast on the `autocast`
    device type, when given), backward, fused AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast(autocast or "cpu", dtype=torch.bfloat16, enabled=bool(autocast)):
            _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def race(config, seq_len: int, batch_size: int, repeats: int, compile: bool, make_step,
         device: str = "cpu", clock=time.process_time, first_clock=time.perf_counter,
         warmup: int = 1) -> dict:
    """The six models (four without compile) built from one seed, each trained by
    make_step(model, inputs, targets) on one fixed batch, the rounds interleaved
    (median_seconds, with `clock`; the first step, which compiles, by `first_clock`, since the
    C++ compiler runs in other processes). Returns the batch, the FLOPs per token of each
    family, the first step's loss and wall-clock seconds (compiling, for the compiled ones) and
    the median seconds of a step, by model."""
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device=device)
    inputs, targets = shift_for_next_token(tokens)
    nano_config = matched_to(config)
    flops = {"course_gpt": training_flops_per_token(config, seq_len),
             "nanogpt": nanogpt_flops_per_token(nano_config, seq_len)}
    builders = {"readable": lambda: GPT(config), "fused": lambda: fuse(GPT(config)),
                "nanogpt": lambda: NanoGPT(nano_config),
                "fused_layernorm_no_rope": lambda: gpt2_norm_and_positions(fuse(GPT(config)))}
    if compile:
        # nanoGPT's own train.py compiles by default; compiled against compiled is the
        # like-for-like comparison, eager nanoGPT the model as its model.py runs it.
        builders["fused_compiled"] = lambda: compile_model(fuse(GPT(config)))
        builders["nanogpt_compiled"] = lambda: compile_model(NanoGPT(nano_config))
    steps, first_step_s, first_loss = {}, {}, {}
    for name, build in builders.items():
        torch.manual_seed(0)
        steps[name] = make_step(build().to(device), inputs, targets)
        start = first_clock()  # compiled: the first step traces and compiles both passes
        first_loss[name] = steps[name]().item()  # same init: equal but for nanoGPT
        first_step_s[name] = round(first_clock() - start, 2)
    seconds = median_seconds(steps, repeats=repeats, warmup=warmup, clock=clock)
    return {"inputs": inputs, "nano_config": nano_config, "flops": flops,
            "first_loss": first_loss, "first_step_s": first_step_s, "seconds": seconds}


def measure(config_name: str, batch_size: int, repeats: int, compile: bool,
            races: int = 3) -> dict:
    """The race at one config, run `races` times, each with the models built afresh.
    Interleaving shares out what changes from round to round, not what lasts a whole race; on a
    shared 2-core machine a ratio moved by several per cent from one race to the next, more than
    the medians of its rounds did. So step times and ratios are medians over the races, and
    ratio_to_nanogpt_range keeps the lowest and the highest: the spread to expect from a rerun."""
    config = get_config(config_name)
    seq_len = config.max_position_embeddings
    runs = [race(config, seq_len, batch_size, repeats, compile, make_step) for _ in range(races)]
    inputs, nano_config, flops = runs[0]["inputs"], runs[0]["nano_config"], runs[0]["flops"]

    def model_flops(name: str, seconds: float) -> float:  # per second
        return flops["nanogpt" if name.startswith("nanogpt") else "course_gpt"] * \
            inputs.numel() / seconds

    def ratio(seconds: dict, name: str, to: str = "nanogpt") -> float:  # within one race
        return model_flops(name, seconds[name]) / model_flops(to, seconds[to])

    names = list(runs[0]["seconds"])
    seconds = {name: statistics.median(r["seconds"][name] for r in runs) for name in names}
    ratios = {name: [ratio(r["seconds"], name) for r in runs] for name in names}
    out = {"batch_size": batch_size, "seq_len": seq_len, "tokens_per_step": inputs.numel(),
           "training_flops_per_token": flops, "nanogpt_mlp_hidden": nano_config.mlp_hidden,
           "first_step_loss": {name: round(loss, 6)
                               for name, loss in runs[0]["first_loss"].items()},
           "first_step_wall_s": runs[0]["first_step_s"], "races": races,
           "step_ms": {name: round(1e3 * s, 2) for name, s in seconds.items()},
           "model_gflops": {name: round(model_flops(name, s) / 1e9, 3)
                            for name, s in seconds.items()},
           "ratio_to_nanogpt": {name: round(statistics.median(r), 3)
                                for name, r in ratios.items()},
           "ratio_to_nanogpt_range": {name: [round(min(r), 3), round(max(r), 3)]
                                      for name, r in ratios.items()}}
    if compile:
        out["ratio_compiled_to_nanogpt_compiled"] = round(statistics.median(
            ratio(r["seconds"], "fused_compiled", to="nanogpt_compiled") for r in runs), 3)
    return out


def run(shapes=SHAPES, repeats: int = 9, compile: bool = True, races: int = 3) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: process CPU time is then the step's own time
    try:
        out = {"machine": machine_info(), "threads": 1, "repeats": repeats, "races": races,
               "clock": "process CPU time, median, variants interleaved; medians over races"}
        for config_name, batch_size in shapes:
            out[config_name] = measure(config_name, batch_size, repeats, compile, races)
        return out
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
