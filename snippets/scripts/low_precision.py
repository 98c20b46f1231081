"""Low-precision training, measured: bf16 autocast against fp32 on this machine, where the time
goes in each, and FP8 (simulated on the CPU, real on an H100) against fp32.

    python -m snippets.scripts.low_precision                    # bf16 vs fp32 training, small GPT
    python -m snippets.scripts.low_precision --plot runs/loss.png
    python -m snippets.scripts.low_precision profile            # time per kind of operation
    python -m snippets.scripts.low_precision fp8                # simulated FP8 vs fp32, tiny GPT
    python -m snippets.scripts.low_precision fp8-gpu            # torch._scaled_mm on CUDA

Timings use this process's CPU time on one thread and alternate the variants step by step, so
that load from other processes on a shared machine hits both alike (see
snippets/scripts/precision_and_accumulation.py, which introduces autocast).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from snippets.data.dataset import RandomWindowSampler, load_tokens
from snippets.machine import cpu_bf16_features, cpu_model, set_threads
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.scratch.precision import (E4M3, E5M2, Fp8Matmul, dequantize_fp8, fp8_scale,
                                        quantization_error, quantize_fp8, scaled_mm_linear,
                                        swap_linears_for_fp8)
from snippets.flags import Parser, int_at_least

BF16_VS_FP32 = {"fp32": (GPT, None), "bf16": (GPT, torch.bfloat16)}


# --8<-- [start:side-by-side]
def train_side_by_side(variants: dict = BF16_VS_FP32, config_name: str = "small",
                       steps: int = 30, batch_size: int = 8, lr: float = 3e-3,
                       seed: int = 0) -> dict:
    """Train one model per variant, {label: (build_model(config), autocast dtype or None)},
    from the same seed on the same batches, alternating step by step; return each variant's
    losses and tokens per second (from the median step's CPU time)."""
    config = get_config(config_name)
    runs = {}
    for label, (build_model, dtype) in variants.items():
        torch.manual_seed(seed)  # identical initial weights in every variant
        model = build_model(config)
        runs[label] = (model, torch.optim.AdamW(model.parameters(), lr=lr), dtype)
    sampler = RandomWindowSampler(load_tokens(None), batch_size,
                                  config.max_position_embeddings, seed)
    losses, seconds = defaultdict(list), defaultdict(list)
    for _ in range(steps):
        inputs, targets = shift_for_next_token(sampler.next_batch())
        for label, (model, optimizer, dtype) in runs.items():
            start = time.process_time()
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                _, loss = model(inputs, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds[label].append(time.process_time() - start)
            losses[label].append(loss.item())
    tokens = batch_size * config.max_position_embeddings
    # The first steps allocate memory and pick kernels: the median leaves them out.
    return {label: {"losses": losses[label],
                    "tokens_per_s": tokens / statistics.median(seconds[label][2:])}
            for label in runs}
# --8<-- [end:side-by-side]


# --8<-- [start:profile]
class OpTimer(TorchDispatchMode):
    """CPU time of every aten operator run while active, backward included, by name.

    Process CPU time, not a wall clock: on a shared machine a profiler's wall-clock times
    include every wait for a core, and moved by 3x between two runs here; CPU time does not.
    Each operator is timed around its whole call, so nothing is counted twice."""

    def __init__(self):
        super().__init__()
        self.seconds = defaultdict(float)
        self.phase = None  # when set, operators are counted under this name instead

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.process_time()
        out = func(*args, **(kwargs or {}))
        self.seconds[self.phase or func.overloadpacket.__name__] += time.process_time() - start
        return out


def category(op_name: str) -> str:
    if op_name in ("mm", "addmm", "bmm"):
        return "matmul"
    if "scaled_dot_product" in op_name:
        return "attention kernel"
    if op_name in ("_to_copy", "copy_"):
        return "casts and copies"
    if op_name == "optimizer":
        return "optimizer (AdamW)"
    return "everything else"


def time_by_category(config_name: str = "small", batch_size: int = 8, steps: int = 5) -> dict:
    """Milliseconds of CPU time per training step in each kind of operator, per precision;
    the precisions alternate step by step."""
    config = get_config(config_name)
    batch = RandomWindowSampler(load_tokens(None), batch_size, config.max_position_embeddings,
                                0).next_batch()
    inputs, targets = shift_for_next_token(batch)
    timers, steppers = {}, {}
    for label, (build_model, dtype) in BF16_VS_FP32.items():
        torch.manual_seed(0)
        model = build_model(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        timer = OpTimer()

        def step(model=model, optimizer=optimizer, dtype=dtype, timer=timer):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                _, loss = model(inputs, targets)
            loss.backward()
            timer.phase = "optimizer"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            timer.phase = None

        step()  # warm-up: allocations, kernel choice, AdamW's state
        timers[label], steppers[label] = timer, step
    for _ in range(steps):
        for label, step in steppers.items():
            with timers[label]:
                step()
    table = {}
    for label, timer in timers.items():
        ms = defaultdict(float)
        for op_name, seconds in timer.seconds.items():
            ms[category(op_name)] += 1e3 * seconds / steps
        ms["total"] = sum(ms.values())
        table[label] = dict(ms)
    return table
# --8<-- [end:profile]


# --8<-- [start:fp8-gpt]
def linear_inputs(model: torch.nn.Module, inputs: torch.Tensor) -> dict:
    """The input each nn.Linear of the model receives in one forward pass, by name."""
    captured, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, name=name: captured.__setitem__(name, args[0].detach())))
    with torch.no_grad():
        model(inputs)
    for hook in hooks:
        hook.remove()
    return captured


def fp8_matmul_errors(config_name: str = "tiny", batch_size: int = 8) -> list[dict]:
    """Every matmul of the GPT (its real inputs from one forward pass) in simulated FP8 and in
    fp32: the relative error of the output, and the weight's and activation's scales."""
    torch.manual_seed(0)
    model = GPT(get_config(config_name))
    batch = RandomWindowSampler(load_tokens(None), batch_size,
                                model.config.max_position_embeddings, 0).next_batch()
    inputs, _ = shift_for_next_token(batch)
    rows = []
    for name, x in linear_inputs(model, inputs).items():
        weight = model.get_submodule(name).weight.detach()
        exact = x @ weight.t()
        fp8 = Fp8Matmul.apply(x, weight)  # the same matmul, FP8 inputs
        rows.append({"layer": name, "x_amax": x.abs().max().item(),
                     "w_amax": weight.abs().max().item(),
                     "relative_error": ((fp8 - exact).norm() / exact.norm()).item()})
    return rows


def tensors_of_one_step(config_name: str = "tiny", batch_size: int = 8) -> dict:
    """A weight, an activation and two gradients of the GPT after one forward and backward:
    the four kinds of tensor an FP8 recipe quantises, each with its own range."""
    torch.manual_seed(0)
    model = GPT(get_config(config_name))
    batch = RandomWindowSampler(load_tokens(None), batch_size,
                                model.config.max_position_embeddings, 0).next_batch()
    inputs, targets = shift_for_next_token(batch)
    layer = model.layers[0].mlp.down_proj
    seen = {}
    layer.register_forward_hook(lambda m, args, out: seen.update(activation=args[0].detach()))
    layer.register_full_backward_hook(
        lambda m, grad_in, grad_out: seen.update(output_gradient=grad_out[0].detach()))
    model(inputs, targets)[1].backward()
    return {"weight": layer.weight.detach(), "activation": seen["activation"],
            "weight gradient": layer.weight.grad, "output gradient": seen["output_gradient"]}


def fp8_training_curves(config_name: str = "tiny", steps: int = 30, batch_size: int = 8) -> dict:
    """fp32 against simulated FP8 in every linear layer but the output layer (everything else
    stays fp32), from the same seed on the same batches."""
    variants = {"fp32": (GPT, None), "fp8": (lambda c: swap_linears_for_fp8(GPT(c)), None)}
    runs = train_side_by_side(variants, config_name, steps, batch_size)
    return {label: run["losses"] for label, run in runs.items()}
# --8<-- [end:fp8-gpt]


# --8<-- [start:fp8-gpu]
def fp8_matmul_report(n: int = 8192, device: str = "cuda", repeats: int = 20) -> dict:
    """One n x n x n matmul in bf16 and in FP8 (torch._scaled_mm, e4m3 inputs with per-tensor
    scales, bf16 output): time and error against fp32. On an H100, FP8 tensor cores do about
    twice the dense bf16 FLOP/s."""
    torch.manual_seed(0)
    x = torch.randn(n, n, device=device)
    w = torch.randn(n, n, device=device) * 0.02
    exact = x.double() @ w.double().t()
    xb, wb = x.bfloat16(), w.bfloat16()
    sx, sw = fp8_scale(x, E4M3), fp8_scale(w, E4M3)
    xq, wq = quantize_fp8(x, E4M3, sx), quantize_fp8(w, E4M3, sw)
    inv_sx, inv_sw = sx.reciprocal(), sw.reciprocal()
    candidates = {
        "bf16": lambda: xb @ wb.t(),
        "fp8 (inputs already e4m3)": lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=inv_sx, scale_b=inv_sw, out_dtype=torch.bfloat16),
        "fp8 incl. scaling and casts": lambda: scaled_mm_linear(x, w),
    }
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else device, "n": n}
    for name, fn in candidates.items():
        fn()  # warm-up: kernel selection, workspace
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn()
        sync()
        seconds = (time.perf_counter() - start) / repeats
        error = ((out.double() - exact).norm() / exact.norm()).item()
        report[name] = {"ms": 1e3 * seconds, "tflops": 2 * n**3 / seconds / 1e12,
                        "relative_error": error}
    # What the FP8 result would be with exact arithmetic on the quantised values:
    exact_fp8 = dequantize_fp8(xq, sx).double() @ dequantize_fp8(wq, sw).double().t()
    report["fp8 quantisation error alone"] = ((exact_fp8 - exact).norm() / exact.norm()).item()
    return report
# --8<-- [end:fp8-gpu]


def plot_curves(curves: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(2, 1, figsize=(6, 4.4), dpi=120, sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1]})
    (reference_label, reference), *others = curves.items()
    steps = range(1, len(reference) + 1)
    ax.plot(steps, reference, label=reference_label)
    for label, losses in others:
        ax.plot(steps, losses, label=label, linestyle="--")
        diff.plot(steps, [b - a for a, b in zip(reference, losses)], label=label)
    diff.axhline(0, color="grey", linewidth=0.8)
    ax.set_ylabel("training loss (nats)")
    diff.set_ylabel(f"minus {reference_label}")
    diff.set_xlabel("step")
    ax.set_title(title, fontsize=10)
    ax.legend()
    for a in (ax, diff):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def print_train(args) -> None:
    runs = train_side_by_side(BF16_VS_FP32, args.config, args.steps, args.batch_size)
    fp32, bf16 = runs["fp32"], runs["bf16"]
    print(f"{args.config} GPT, {args.steps} AdamW steps, batch {args.batch_size}, same seed and "
          f"batches:")
    for step in sorted({1, args.steps // 3, 2 * args.steps // 3, args.steps}):
        a, b = fp32["losses"][step - 1], bf16["losses"][step - 1]
        print(f"  step {step:>3}: loss fp32 {a:.4f}  bf16 {b:.4f}  difference {b - a:+.4f}")
    worst = max(abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"]))
    print(f"  largest |difference|: {worst:.4f}")
    print(f"tokens/s (median step, CPU time): fp32 {fp32['tokens_per_s']:,.0f}  bf16 "
          f"{bf16['tokens_per_s']:,.0f}  -> bf16/fp32 = "
          f"{bf16['tokens_per_s'] / fp32['tokens_per_s']:.2f}")
    if args.plot:
        plot_curves({"fp32": fp32["losses"], "bf16 autocast": bf16["losses"]}, args.plot,
                    f"{args.config} GPT on {cpu_model()}: fp32 vs bf16 autocast, same seed")


def print_profile(args) -> None:
    table = time_by_category(args.config, args.batch_size)
    kinds = ["matmul", "attention kernel", "casts and copies", "optimizer (AdamW)",
             "everything else", "total"]
    print(f"{args.config} GPT, one training step (forward, backward, AdamW), ms of CPU time "
          f"per kind of operator (mean of 5 steps):")
    print(f"{'':<18}{'fp32':>9}{'bf16':>9}{'bf16 - fp32':>13}")
    for kind in kinds:
        a, b = table["fp32"].get(kind, 0.0), table["bf16"].get(kind, 0.0)
        print(f"{kind:<18}{a:>9.1f}{b:>9.1f}{b - a:>+13.1f}")


def print_fp8(args) -> None:
    print("tiny GPT, layers.0.mlp.down_proj after one step: FP8 round trip without and with a "
          "per-tensor scale")
    print(f"{'tensor':<16}{'amax':>9}{'format':>7}{'scale':>9}{'rel. error':>12}"
          f"{'flushed to 0':>13}{'overflowed':>11}")
    for name, x in tensors_of_one_step().items():
        for fmt, dtype in (("e4m3", E4M3), ("e5m2", E5M2)):
            for scaled in (False, True):
                r = quantization_error(x, dtype, scaled)
                print(f"{name:<16}{x.abs().max().item():>9.2e}{fmt:>7}"
                      f"{'amax' if scaled else 'none':>9}{r['relative_error']:>12.4f}"
                      f"{100 * r['flushed_to_zero']:>12.1f}%{100 * r['overflowed']:>10.1f}%")
    print("tiny GPT, each linear layer's real input: simulated FP8 (e4m3, per-tensor scales) "
          "vs fp32")
    for r in fp8_matmul_errors():
        print(f"  {r['layer']:<28} x amax {r['x_amax']:6.2f}  w amax {r['w_amax']:.3f}  "
              f"relative error {r['relative_error']:.4f}")
    curves = fp8_training_curves(steps=args.steps)
    print(f"tiny GPT, {args.steps} AdamW steps, fp32 vs simulated FP8 linears (e4m3 forward, "
          f"e5m2 gradients):")
    for step in sorted({1, args.steps // 3, 2 * args.steps // 3, args.steps}):
        a, b = curves["fp32"][step - 1], curves["fp8"][step - 1]
        print(f"  step {step:>3}: loss fp32 {a:.4f}  fp8 {b:.4f}  difference {b - a:+.4f}")
    last = min(10, args.steps)
    mean = {k: statistics.mean(v[-last:]) for k, v in curves.items()}
    print(f"  mean of the last {last} steps: fp32 {mean['fp32']:.4f}  fp8 {mean['fp8']:.4f}  "
          f"difference {mean['fp8'] - mean['fp32']:+.4f}")


def print_fp8_gpu(args) -> None:
    report = fp8_matmul_report(device="cuda" if torch.cuda.is_available() else "cpu",
                               n=8192 if torch.cuda.is_available() else 256)
    print(f"{report['device']}, {report['n']}^3 matmul:")
    for name in ("bf16", "fp8 (inputs already e4m3)", "fp8 incl. scaling and casts"):
        r = report[name]
        print(f"  {name:<28} {r['ms']:8.3f} ms  {r['tflops']:7.1f} TFLOP/s  "
              f"relative error vs fp64 {r['relative_error']:.2e}")
    print(f"  FP8 quantisation error alone: {report['fp8 quantisation error alone']:.2e}")


PARTS = {"train": print_train, "profile": print_profile, "fp8": print_fp8,
         "fp8-gpu": print_fp8_gpu}


def main(argv=None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("part", nargs="?", default="train", choices=list(PARTS))
    p.add_argument("--config", default="small")
    p.add_flag("max-steps", "--steps", dest="steps", type=int_at_least(1), default=30)
    p.add_flag("batch-size", type=int_at_least(1), default=8)
    p.add_argument("--plot", help="write the loss curves to this image file")
    p.add_argument("--threads", type=int_at_least(1), default=1)
    args = p.parse_args(argv)
    set_threads(args.threads, "--threads")
    if args.part in ("train", "profile"):
        features = ", ".join(cpu_bf16_features()) or "none"
        print(f"{cpu_model()}, torch {torch.__version__}, {args.threads} thread(s), "
              f"bf16 instructions: {features}")
    PARTS[args.part](args)


if __name__ == "__main__":
    main()
