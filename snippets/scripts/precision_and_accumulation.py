"""Mixed precision, loss scaling, gradient accumulation and fused kernels, measured here.

    python snippets/scripts/precision_and_accumulation.py            # parts 1-4, < 60 s on 2 cores
    python snippets/scripts/precision_and_accumulation.py autocast   # one part: autocast, scaling,
                                                                     # accumulation, optimizer, compile

Every timing compares variants inside one run, interleaved round by round (fp32, bf16, fp32,
bf16, ...), and reports the median of this process's CPU time: on a shared machine a burst of
someone else's work then slows both variants alike instead of one of them, and time spent
waiting for a core is not counted. One thread by default (--threads), for the same reason.

`compile` is not in the default run: torch.compile's first call spent 40 s compiling on the
course's 2-core test machine (7 s once its cache in /tmp held the result), longer than
everything else together.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from snippets.data.dataset import RandomWindowSampler, load_tokens
from snippets.machine import cpu_bf16_features, cpu_model, set_threads
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.planner.memory import measure_activation_bytes
from snippets.scratch.precision import DynamicLossScaler
from snippets.flags import Parser, int_at_least


# --8<-- [start:timing]
def median_seconds(candidates: dict, repeats: int = 5, warmup: int = 1,
                   clock=time.process_time, budget_s: float | None = None) -> dict:
    """Time each zero-argument callable; rounds interleave the candidates so that load from
    other processes hits all of them alike. Returns the median seconds of each.

    The default clock is this process's CPU time: on a shared machine, time spent waiting for
    a core is nobody's kernel. With one thread and an idle machine it equals wall-clock time.
    With `budget_s`, the rounds stop as soon as they have taken longer than that in all
    (warm-up included), after at least one measured round: a CPU without bf16 instructions
    emulates bf16 10-100x slower than fp32, a gap one round shows as well as fifteen, in
    seconds instead of minutes. If the warm-up alone took longer than the budget, its times
    are the measurement: what a first call adds (allocating, choosing kernels) is
    milliseconds, negligible against calls that take seconds."""
    times = {name: [] for name in candidates}
    spent = 0.0
    for round_index in range(warmup + repeats):
        for name, fn in candidates.items():
            start = clock()
            fn()
            elapsed = clock() - start
            spent += elapsed
            times[name].append(elapsed)
        if round_index == warmup - 1 and not (budget_s is not None and spent > budget_s):
            times = {name: [] for name in candidates}  # the first calls allocate, pick kernels
        elif budget_s is not None and spent > budget_s:
            break
    return {name: statistics.median(t) for name, t in times.items()}
# --8<-- [end:timing]


def model_and_batch(config_name: str, batch_size: int, seed: int = 0):
    """A freshly initialised GPT and one batch of real text for it, both from `seed`."""
    config = get_config(config_name)
    torch.manual_seed(seed)
    model = GPT(config)
    tokens = load_tokens(None)
    sampler = RandomWindowSampler(tokens, batch_size, config.max_position_embeddings, seed)
    return model, sampler


# --8<-- [start:autocast]
def forward_backward(model, inputs, targets, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One forward and backward pass; with `dtype`, under autocast on the CPU.

    Autocast leaves the weights in fp32 and casts per operation: matmuls (linear layers,
    attention) run in `dtype`, while operations that need range or precision run in fp32
    (autocast's fp32 list, such as cross-entropy; this model's RMSNorm and loss also cast to
    fp32 themselves). Backward runs each operation in the dtype its forward used, and every
    weight's gradient arrives in fp32, like the weight."""
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        _, loss = model(inputs, targets)
    loss.backward()  # outside the autocast block, as the PyTorch AMP recipe says
    return loss
# --8<-- [end:autocast]


def autocast_speed(sizes=(("tiny", 16), ("small", 8), ("medium", 2)), repeats: int = 5,
                   budget_s: float = 2.0) -> list:
    """fp32 vs bf16-autocast step time (forward + backward) for a few model sizes."""
    rows = []
    for name, batch_size in sizes:
        model, sampler = model_and_batch(name, batch_size)
        inputs, targets = shift_for_next_token(sampler.next_batch())
        seconds = median_seconds({
            "fp32": lambda: forward_backward(model, inputs, targets),
            "bf16": lambda: forward_backward(model, inputs, targets, torch.bfloat16),
        }, repeats=repeats, budget_s=budget_s)
        rows.append({"config": name, "params": model.num_parameters(),
                     "tokens": inputs.numel(), "fp32_ms": 1e3 * seconds["fp32"],
                     "bf16_ms": 1e3 * seconds["bf16"],
                     "speedup": seconds["fp32"] / seconds["bf16"]})
    return rows


# --8<-- [start:attention-kernel]
def attention_times(batch: int, heads: int, seq_len: int, head_dim: int,
                    repeats: int = 7) -> dict:
    """Causal attention alone, forward + backward, at one model's shapes, on fp32 and on bf16
    inputs: the same fused kernel (scaled_dot_product_attention) the model calls."""
    candidates = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        q, k, v = (torch.randn(batch, heads, seq_len, head_dim, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        candidates[label] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True).sum().backward()
    return median_seconds(candidates, repeats=repeats)
# --8<-- [end:attention-kernel]


# --8<-- [start:matmul-casts]
def matmul_and_cast_times(tokens: int, hidden: int, out: int, repeats: int = 15,
                          budget_s: float = 2.0) -> dict:
    """One linear layer's matmul, (tokens x hidden) @ (hidden x out): in fp32, in bf16 with
    inputs already bf16, and in bf16 including the two casts autocast makes on every call
    (the fp32 activation and the fp32 weight are converted to bf16 each time)."""
    x, w = torch.randn(tokens, hidden), torch.randn(hidden, out)
    xb, wb = x.bfloat16(), w.bfloat16()
    return median_seconds({
        "fp32": lambda: x @ w,
        "bf16": lambda: xb @ wb,
        "bf16 + casts": lambda: x.bfloat16() @ w.bfloat16(),
    }, repeats=repeats, budget_s=budget_s)
# --8<-- [end:matmul-casts]


def loss_curves(config_name: str = "tiny", steps: int = 20, batch_size: int = 16,
                lr: float = 3e-3) -> dict:
    """Train the same model from the same seed on the same batches in fp32 and in bf16."""
    curves = {}
    for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        model, sampler = model_and_batch(config_name, batch_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        losses = []
        for _ in range(steps):
            inputs, targets = shift_for_next_token(sampler.next_batch())
            losses.append(forward_backward(model, inputs, targets, dtype).item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        curves[label] = losses
    return curves


# --8<-- [start:gradient-error]
def gradients_under(model, inputs, targets, dtype=None, loss_scale: float = 1.0) -> list:
    """Every weight's gradient from one backward pass, with the loss multiplied by
    `loss_scale` before backward and the gradients divided by it after (in fp32)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        _, loss = model(inputs, targets)
    (loss * loss_scale).backward()
    return [p.grad / loss_scale for p in model.parameters()]


def compare_gradients(grads: list, reference: list) -> dict:
    """How far `grads` are from fp32's: relative error over all weights, and how many values
    fp32 has as non-zero that came out as exactly zero (underflow) or not finite (overflow)."""
    flat, ref = torch.cat([g.flatten() for g in grads]), torch.cat([r.flatten() for r in reference])
    finite = torch.isfinite(flat)
    return {
        "relative_error": ((flat - ref).norm() / ref.norm()).item() if finite.all() else math.inf,
        "flushed_to_zero": ((flat == 0) & (ref != 0)).sum().item(),
        "not_finite": (~finite).sum().item(),
        "values": flat.numel(),
    }
# --8<-- [end:gradient-error]


def gradient_errors(scales=(1.0, 2.0**16, 2.0**24)) -> list:
    """bf16 and fp16 gradients of the tiny GPT against fp32, at a few loss scales."""
    model, sampler = model_and_batch("tiny", 16)
    inputs, targets = shift_for_next_token(sampler.next_batch())
    reference = gradients_under(model, inputs, targets)
    rows = [{"dtype": "bf16", "scale": 1.0,
             **compare_gradients(gradients_under(model, inputs, targets, torch.bfloat16), reference)}]
    for scale in scales:
        grads = gradients_under(model, inputs, targets, torch.float16, scale)
        rows.append({"dtype": "fp16", "scale": scale, **compare_gradients(grads, reference)})
    return rows


# --8<-- [start:fp16-training]
def train_fp16_with_scaler(steps: int = 12, init_scale: float = 2.0**24,
                           growth_interval: int = 4) -> list:
    """The tiny GPT trained under fp16 autocast with the course's DynamicLossScaler
    (snippets/scratch/precision.py; torch.amp.GradScaler does the same, step for step).
    The initial scale is deliberately too large, to show the scaler backing off."""
    model, sampler = model_and_batch("tiny", 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = DynamicLossScaler(init_scale=init_scale, growth_interval=growth_interval)
    log = []
    for step in range(1, steps + 1):
        inputs, targets = shift_for_next_token(sampler.next_batch())
        with torch.autocast("cpu", dtype=torch.float16):
            _, loss = model(inputs, targets)
        scale = scaler.scale
        scaler.scale_loss(loss).backward()  # gradients are `scale` times too large...
        stepped = scaler.step(optimizer)  # ...unscaled here; a step with inf/nan is skipped
        optimizer.zero_grad(set_to_none=True)
        log.append({"step": step, "loss": loss.item(), "scale": scale, "stepped": stepped})
    return log
# --8<-- [end:fp16-training]


# --8<-- [start:accumulation]
def accumulated_gradients(model, batch: torch.Tensor, micro_batches: int) -> list:
    """Gradients of the mean loss over `batch`, from `micro_batches` equal slices of it, one
    forward and backward each: only one slice's activations are alive at a time."""
    if len(batch) % micro_batches:
        # A mean of means equals the mean over the whole batch only if the slices are equal.
        raise ValueError(f"batch of {len(batch)} does not split into {micro_batches} equal slices")
    model.zero_grad(set_to_none=True)
    for micro_batch in batch.chunk(micro_batches):
        inputs, targets = shift_for_next_token(micro_batch)
        _, loss = model(inputs, targets)
        # backward() adds into .grad; dividing by the count makes the sum a mean.
        (loss / micro_batches).backward()
    return [p.grad.clone() for p in model.parameters()]
# --8<-- [end:accumulation]


# Not bit-for-bit: the same products are summed in a different order (four partial sums,
# then their sum), and fp32 addition is not associative. Each rounding is one part in 2^24
# (6e-8) of the value; 1e-6 of the largest gradient leaves room for a dozen of them.
ACCUMULATION_TOLERANCE = 1e-6


# --8<-- [start:effective-batch]
def effective_batch(micro_batch: int, accumulation_steps: int, world_size: int,
                    seq_len: int) -> dict:
    """What one optimizer step trains on: every rank runs `accumulation_steps` micro-batches
    of `micro_batch` sequences before the gradients are averaged over `world_size` ranks."""
    sequences = micro_batch * accumulation_steps * world_size
    return {"sequences": sequences, "tokens": sequences * seq_len}
# --8<-- [end:effective-batch]


def accumulation_report(config_name: str = "tiny", batch_size: int = 16,
                        micro_batches: int = 4) -> dict:
    """One batch as one backward vs as `micro_batches` accumulated ones: gradients, memory."""
    model, sampler = model_and_batch(config_name, batch_size)
    batch = sampler.next_batch()
    whole = accumulated_gradients(model, batch, 1)
    pieces = accumulated_gradients(model, batch, micro_batches)
    difference = max((a - b).abs().max().item() for a, b in zip(whole, pieces))
    largest = max(g.abs().max().item() for g in whole)
    memory = {}
    for n in (1, micro_batches):
        inputs, targets = shift_for_next_token(batch[: batch_size // n])
        memory[n] = measure_activation_bytes(model, inputs, targets)
    return {"max_abs_difference": difference, "largest_gradient": largest,
            "activation_bytes": memory}


def effective_batch_table(config_name: str = "small",
                          layouts=((32, 1, 1), (8, 4, 1), (8, 1, 4), (2, 4, 4))) -> list:
    """Layouts of one effective batch: micro-batch x accumulation x world size, with each
    rank's activation memory measured at its micro-batch."""
    config = get_config(config_name)
    torch.manual_seed(0)
    model = GPT(config)
    seq_len = config.max_position_embeddings
    tokens = torch.randint(0, config.vocab_size, (max(m for m, _, _ in layouts), seq_len + 1))
    rows = []
    for micro, accum, world in layouts:
        inputs, targets = shift_for_next_token(tokens[:micro])
        rows.append({"micro_batch": micro, "accumulation": accum, "world_size": world,
                     **effective_batch(micro, accum, world, seq_len),
                     "activation_bytes": measure_activation_bytes(model, inputs, targets)})
    return rows


# --8<-- [start:optimizers]
def optimizer_step_times(config_name: str = "small", repeats: int = 15) -> dict:
    """AdamW's step on a GPT's parameters, three ways:
    for-loop  one parameter at a time, ~10 elementwise operations each, every one a full
              pass over that tensor's memory;
    foreach   the same operations, each applied to the list of all tensors in one call
              (on CUDA: a few large kernel launches instead of one per tensor per operation;
              on the CPU there are no launches to save);
    fused     one pass per tensor that reads each weight, gradient and both moments once,
              does all of Adam's arithmetic in vector registers, and writes them back once."""
    config = get_config(config_name)
    torch.manual_seed(0)
    params = list(GPT(config).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    variants = {"for-loop": {"foreach": False}, "foreach": {"foreach": True},
                "fused": {"fused": True}}
    optimizers = {name: torch.optim.AdamW(params, lr=1e-3, **kwargs)
                  for name, kwargs in variants.items()}
    return median_seconds({name: opt.step for name, opt in optimizers.items()},
                          repeats=repeats, warmup=2)
# --8<-- [end:optimizers]


def optimizers_agree(config_name: str = "small", steps: int = 3) -> float:
    """Largest weight difference between the for-loop and fused AdamW after a few steps."""
    results = []
    for kwargs in ({"foreach": False}, {"fused": True}):
        torch.manual_seed(0)
        model = GPT(get_config(config_name))
        generator = torch.Generator().manual_seed(1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator) * 1e-3
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*results))


# --8<-- [start:compile]
def rms_norm_written_out(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5):
    """RMSNorm as six separate operations. Eager PyTorch runs six kernels, each reading its
    inputs from memory and writing its result back; torch.compile fuses them into one loop
    that reads x once and writes the output once."""
    squared = x * x                                   # 1: a full-size temporary
    mean = squared.mean(-1, keepdim=True)             # 2: a reduction, reads it all again
    inverse = torch.rsqrt(mean + eps)                 # 3, 4: small, one value per row
    return x * inverse * weight                       # 5, 6: two more full-size passes
# --8<-- [end:compile]


def compile_report(rows: int = 8192, hidden: int = 256, repeats: int = 20) -> dict:
    x, weight = torch.randn(rows, hidden), torch.randn(hidden)
    start = time.perf_counter()
    compiled = torch.compile(rms_norm_written_out)
    compiled(x, weight)  # the first call traces the function and compiles C++ for it
    compile_s = time.perf_counter() - start
    seconds = median_seconds({"eager": lambda: rms_norm_written_out(x, weight),
                              "compiled": lambda: compiled(x, weight)},
                             repeats=repeats, warmup=2)
    difference = (compiled(x, weight) - rms_norm_written_out(x, weight)).abs().max().item()
    return {"compile_s": compile_s, "seconds": seconds, "max_abs_difference": difference}


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


def print_autocast() -> None:
    print("== 1. bf16 autocast vs fp32: forward + backward of one batch (median of 5 rounds; "
          "fewer where they take over 2 s) ==")
    print(f"{'config':<8} {'params':>10} {'tokens':>7} {'fp32 ms':>8} {'bf16 ms':>8} "
          f"{'bf16 speed-up':>14}")
    for r in autocast_speed():
        print(f"{r['config']:<8} {r['params']:>10,} {r['tokens']:>7} {r['fp32_ms']:>8.1f} "
              f"{r['bf16_ms']:>8.1f} {r['speedup']:>13.2f}x")
    print("\nattention alone (scaled_dot_product_attention, forward + backward), milliseconds:")
    print(f"{'config':<8} {'batch x heads x seq x head_dim':>31} {'fp32':>8} {'bf16':>8} "
          f"{'bf16 speed-up':>14}")
    for name, batch_size in (("tiny", 16), ("small", 8), ("medium", 2)):
        config = get_config(name)
        shape = (batch_size, config.num_attention_heads, config.max_position_embeddings,
                 config.head_dim)
        t = attention_times(*shape)
        print(f"{name:<8} {' x '.join(map(str, shape)):>31} {1e3 * t['fp32']:>8.2f} "
              f"{1e3 * t['bf16']:>8.2f} {t['fp32'] / t['bf16']:>13.2f}x")
    print("\none matmul (tokens x hidden) @ (hidden x out), milliseconds:")
    print(f"{'shape':<22} {'fp32':>8} {'bf16':>8} {'bf16+casts':>11} {'bf16 speed-up':>14} "
          f"{'with casts':>11}")
    for tokens, hidden, out in ((1024, 64, 172), (1024, 256, 688), (1024, 1024, 1024)):
        t = matmul_and_cast_times(tokens, hidden, out)
        print(f"{f'{tokens}x{hidden} @ {hidden}x{out}':<22} {1e3 * t['fp32']:>8.3f} "
              f"{1e3 * t['bf16']:>8.3f} {1e3 * t['bf16 + casts']:>11.3f} "
              f"{t['fp32'] / t['bf16']:>13.2f}x {t['fp32'] / t['bf16 + casts']:>10.2f}x")
    curves = loss_curves()
    fp32, bf16 = curves["fp32"], curves["bf16"]
    print("\ntiny GPT, 20 AdamW steps from the same seed on the same batches:")
    for step in (1, 5, 10, 20):
        print(f"  step {step:>2}: loss fp32 {fp32[step - 1]:.4f}  bf16 {bf16[step - 1]:.4f}  "
              f"difference {bf16[step - 1] - fp32[step - 1]:+.4f}")
    print(f"  largest |difference| over the 20 steps: "
          f"{max(abs(a - b) for a, b in zip(fp32, bf16)):.4f}")


def print_scaling() -> None:
    print("== 2. Loss scaling: tiny GPT gradients under autocast, compared with fp32 ==")
    print(f"{'dtype':<6} {'loss scale':>10} {'relative error':>15} {'flushed to 0':>13} "
          f"{'inf/nan':>8}")
    for r in gradient_errors():
        scale = f"2^{int(math.log2(r['scale']))}"
        print(f"{r['dtype']:<6} {scale:>10} {r['relative_error']:>15.1e} "
              f"{r['flushed_to_zero']:>13,} {r['not_finite']:>8,}")
    print("\nfp16 training with DynamicLossScaler, initial scale 2^24, growth every 4 clean steps:")
    for r in train_fp16_with_scaler():
        print(f"  step {r['step']:>2}: loss {r['loss']:.4f}  scale 2^{int(math.log2(r['scale']))}  "
              f"{'stepped' if r['stepped'] else 'SKIPPED (inf/nan gradient), scale halved'}")


def print_accumulation() -> None:
    print("== 3. Gradient accumulation ==")
    r = accumulation_report()
    memory = r["activation_bytes"]
    print("tiny GPT, batch of 16 sequences: 1 backward of 16 vs 4 accumulated backwards of 4")
    equal = r["max_abs_difference"] <= ACCUMULATION_TOLERANCE * r["largest_gradient"]
    print(f"  gradients equal to within {ACCUMULATION_TOLERANCE:g} x the largest gradient: {equal}")
    print(f"  activations alive at once: {mib(memory[1])} for 16 sequences, "
          f"{mib(memory[4])} for 4 ({memory[1] / memory[4]:.2f}x less)")
    print("\nsmall GPT (128 tokens per sequence): layouts of one effective batch of 32 sequences")
    print(f"{'micro':>5} {'accum':>5} {'world':>5} {'sequences':>9} {'tokens':>7} "
          f"{'activations per rank':>21} {'passes in a row':>16} {'all-reduces':>12}")
    for row in effective_batch_table():
        # With no_sync on all but the last micro-batch: one gradient all-reduce per step.
        all_reduces = 0 if row["world_size"] == 1 else 1
        print(f"{row['micro_batch']:>5} {row['accumulation']:>5} {row['world_size']:>5} "
              f"{row['sequences']:>9} {row['tokens']:>7,} {mib(row['activation_bytes']):>21} "
              f"{row['accumulation']:>16} {all_reduces:>12}")


def print_optimizers() -> None:
    print("== 4. AdamW step: for-loop vs foreach vs fused (median of 15) ==")
    for name in ("small", "medium"):
        tensors = list(GPT(get_config(name)).parameters())
        t = optimizer_step_times(name)
        cells = "  ".join(f"{k} {1e3 * v:.2f} ms" for k, v in t.items())
        print(f"{name:<7} ({sum(p.numel() for p in tensors):,} parameters in {len(tensors)} "
              f"tensors): {cells}  -> fused {t['for-loop'] / t['fused']:.1f}x faster")
    print(f"largest weight difference, for-loop vs fused AdamW after 3 steps: "
          f"{optimizers_agree():.1e}")


def print_compile() -> None:
    print("== 5. RMSNorm as 6 eager operations vs torch.compile (8192 x 256, median of 20) ==")
    r = compile_report()
    t = r["seconds"]
    print(f"first call (trace + compile): {r['compile_s']:.1f} s")
    print("  ".join(f"{k} {1e3 * v:.2f} ms" for k, v in t.items()))
    print(f"compiled is {t['eager'] / t['compiled']:.1f}x faster than eager; "
          f"largest difference {r['max_abs_difference']:.1e}")


PARTS = {"autocast": print_autocast, "scaling": print_scaling,
         "accumulation": print_accumulation, "optimizer": print_optimizers,
         "compile": print_compile}
TIMED_PARTS = {"autocast", "optimizer", "compile"}


def main(argv=None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("parts", nargs="*", metavar="part",
                   help=f"any of {', '.join(PARTS)} (default: all but compile)")
    p.add_argument("--threads", type=int_at_least(1), default=1)
    args = p.parse_args(argv)
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        p.error(f"unknown part {unknown[0]!r}: choose from {', '.join(PARTS)}")
    parts = args.parts or [part for part in PARTS if part != "compile"]
    set_threads(args.threads, "--threads")
    if TIMED_PARTS & set(parts):  # a time means nothing without the machine it was taken on
        features = ", ".join(cpu_bf16_features()) or "none"
        print(f"{cpu_model()}, torch {torch.__version__}, {args.threads} thread(s), "
              f"bf16 instructions: {features}\n")
    for i, part in enumerate(parts):
        if i:
            print()
        PARTS[part]()


if __name__ == "__main__":
    main()
