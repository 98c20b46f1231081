"""The GPU section of bench.json: `make bench-gpu`, on a machine with an NVIDIA GPU.

    PYTHONPATH=. python3 -m snippets.bench.gpu --merge --out bench.json

Run with the GPU machine's own interpreter and its CUDA build of PyTorch (the Makefile's
GPU_PYTHON; nothing is installed). It measures, in one process, and writes as results["gpu"]:

- throughput: GPT-2 small's shapes (hidden 768, 12 layers, 12 heads, vocabulary 50304; context
  and batch from --seq-len and --batch-size), bf16 autocast and fused AdamW, for the course's
  GPT (readable, `fuse`d, fused and compiled) and the nanoGPT-shaped model with the same FLOPs
  per token (eager and compiled); tokens/s and MFU against the device's bf16 dense peak;
- matmul: TFLOP/s of a square matmul in fp32, TF32, bf16 and fp8 (torch._scaled_mm);
- memory: peak and held bytes of one training step against the planner's formulas, for two
  configs, with and without activation checkpointing, in fp32 and under bf16 autocast;
- fsdp: the scratch FSDP's mixed-precision memory on one GPU (a world of one process).

The section names the device, driver, torch and CUDA it ran on: it comes from another machine
than the CPU results beside it. Times are wall-clock seconds between CUDA synchronisations
(the GPU runs asynchronously: the CPU's clock alone would time the kernel launches).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import shutil
import statistics
import subprocess
import sys
import time

import torch

from snippets.bench.record import checked_target, write_results
from snippets.flags import Parser, int_at_least
from snippets.machine import machine_info
from snippets.planner import cost_model

# bf16 dense (no sparsity) tensor-core peaks, TFLOP/s, by a piece of torch.cuda.get_device_name;
# the first match wins, so the more specific names come first. From NVIDIA's datasheets, whose
# tables give the 2:4-sparse figure with an asterisk, twice these: H100 and H200 ("NVIDIA H100
# Tensor Core GPU" datasheet: SXM 1,979*, PCIe 1,513*, NVL 1,671*; "NVIDIA H200" datasheet:
# SXM 1,979*, NVL 1,671*), GH200 (the H100 SXM's), A100 (312, 624*), L40S (362.05, 733*),
# L4 (121, 242*). The planner's CLUSTERS uses the same 989 for the H100 SXM.
PEAK_BF16_TFLOPS = (
    ("GH200", 989.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # "NVIDIA H100 80GB HBM3": the SXM part
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)
FP8_CAPABILITY = (8, 9)  # Ada (8.9) and Hopper (9.0) and later have fp8 tensor cores
GPT2_SMALL = dict(vocab_size=50304)  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT does
MEMORY_CONFIGS = (("gpt2-small", 8), ("medium", 64))  # planner/course config, batch size
PARTS = ("throughput", "matmul", "memory", "fsdp")


def peak_bf16_tflops(device_name: str) -> float | None:
    """The device's bf16 dense peak from PEAK_BF16_TFLOPS, or None for a device not listed."""
    name = device_name.lower()
    for piece, tflops in PEAK_BF16_TFLOPS:
        if piece.lower() in name:
            return tflops
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: the model's FLOPs per second over the device's peak."""
    if peak_tflops is None:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def fp8_unsupported_reason(capability: tuple[int, int]) -> str | None:
    """Why torch._scaled_mm cannot run fp8 here, or None if it can (compute capability 8.9+)."""
    if tuple(capability) >= FP8_CAPABILITY:
        return None
    return (f"compute capability {capability[0]}.{capability[1]} has no fp8 tensor cores "
            f"(they start at {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}: Ada, Hopper)")


def no_cuda_reason() -> str | None:
    """One line saying why this machine cannot run the GPU benchmarks, or None if it can."""
    if torch.version.cuda is None:
        why = f"this PyTorch (torch {torch.__version__}) is a build without CUDA"
    elif not torch.cuda.is_available():
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no NVIDIA GPU or driver"
    else:
        return None
    return (f"snippets.bench.gpu: no CUDA device: {why}. Run `make bench-gpu` on a machine with "
            "an NVIDIA GPU, with GPU_PYTHON=<its python with a CUDA build of torch>")


def driver_version() -> dict:
    """The NVIDIA driver's version from nvidia-smi, else the CUDA driver API version torch sees."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
            return {"driver": out.splitlines()[0].strip(), "driver_from": "nvidia-smi"}
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    version = torch._C._cuda_getDriverVersion()  # e.g. 12080 for CUDA 12.8
    return {"driver": f"CUDA driver API {version // 1000}.{version % 1000 // 10}",
            "driver_from": "torch (nvidia-smi not found)"}


def describe_device() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"name": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)),
            "memory_gib": round(props.total_memory / 2**30, 1),
            "count": torch.cuda.device_count(), **driver_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "peak_bf16_tflops": peak_bf16_tflops(torch.cuda.get_device_name(0))}


def cuda_wall_clock() -> float:
    """Wall time once the GPU has finished what was queued: a clock for median_seconds."""
    torch.cuda.synchronize()
    return time.perf_counter()


# --------------------------------------------------------------------------- throughput

def throughput(batch_size: int, seq_len: int, repeats: int, compile: bool, peak) -> dict:
    from snippets.bench.fused import make_step, race
    from snippets.models.gpt import get_config

    config = get_config("gpt2-small", max_position_embeddings=seq_len, **GPT2_SMALL)
    amp_step = functools.partial(make_step, autocast="cuda")  # the forward under bf16 autocast
    ran = race(config, seq_len, batch_size, repeats, compile, amp_step, device="cuda",
               clock=cuda_wall_clock, first_clock=cuda_wall_clock, warmup=2)
    inputs, flops, seconds = ran["inputs"], ran["flops"], ran["seconds"]
    first_loss = {name: round(loss, 4) for name, loss in ran["first_loss"].items()}
    first_step_s = ran["first_step_s"]
    out = {"batch_size": batch_size, "seq_len": seq_len, "tokens_per_step": inputs.numel(),
           "vocab_size": config.vocab_size, "training_flops_per_token": flops,
           "precision": "bf16 autocast, fp32 weights, fused AdamW",
           "first_step_loss": first_loss, "first_step_wall_s": first_step_s, "models": {}}
    model_flops = {}  # per second, unrounded: the ratios come from these
    for name, s in seconds.items():
        per_token = flops["nanogpt" if name.startswith("nanogpt") else "course_gpt"]
        tokens_per_s = inputs.numel() / s
        model_flops[name] = tokens_per_s * per_token
        utilisation = mfu(tokens_per_s, per_token, peak)
        out["models"][name] = {"step_ms": round(1e3 * s, 2), "tokens_per_s": round(tokens_per_s),
                               "model_tflops": round(model_flops[name] / 1e12, 1),
                               "mfu": None if utilisation is None else round(utilisation, 3)}
    if peak is None:
        out["mfu_note"] = "MFU omitted: this device is not in PEAK_BF16_TFLOPS"
    out["ratio_to_nanogpt"] = {name: round(f / model_flops["nanogpt"], 3)
                               for name, f in model_flops.items()}
    if compile:
        out["ratio_compiled_to_nanogpt_compiled"] = round(
            model_flops["fused_compiled"] / model_flops["nanogpt_compiled"], 3)
    return out


# --------------------------------------------------------------------------- matmul

@contextlib.contextmanager
def tf32_matmuls(allowed: bool):
    """cuBLAS fp32 matmuls on TF32 tensor cores, or not, inside the block only: the process's
    setting is restored on the way out."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def time_tflops(fn, n: int, repeats: int) -> float:
    """TFLOP/s of fn, an n x n x n matmul: the median over `repeats` of 20 calls each, timed
    with CUDA events (the GPU's own clock around the queued kernels)."""
    for _ in range(3):  # warm-up: the first calls pick kernels and allocate workspace
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 20)
    return 2 * n**3 / statistics.median(times) / 1e12


def matmul(n: int, repeats: int) -> dict:
    torch.manual_seed(0)
    a32, b32 = (torch.randn(n, n, device="cuda") for _ in range(2))
    out = {"size": n, "clock": "CUDA events, median of repeats x 20 calls"}
    with tf32_matmuls(False):
        out["fp32_tflops"] = round(time_tflops(lambda: a32 @ b32, n, repeats), 1)
    with tf32_matmuls(True):
        out["tf32_tflops"] = round(time_tflops(lambda: a32 @ b32, n, repeats), 1)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    out["bf16_tflops"] = round(time_tflops(lambda: a16 @ b16, n, repeats), 1)
    out["bf16_over_fp32"] = round(out["bf16_tflops"] / out["fp32_tflops"], 2)
    reason = fp8_unsupported_reason(torch.cuda.get_device_capability(0))
    if reason is not None:
        out["fp8_skipped"] = reason
        return out
    # Per-tensor scales: each operand divided by its amax / 448 (e4m3's largest value) fits
    # e4m3's range; _scaled_mm multiplies the result back by both scales. Its second operand
    # must be column-major: the transpose of a row-major matrix.
    fp8 = torch.float8_e4m3fn
    scale_a = (a32.abs().max() / torch.finfo(fp8).max).float()
    scale_b = (b32.abs().max() / torch.finfo(fp8).max).float()
    a8 = (a32 / scale_a).to(fp8)
    b8 = (b32.t().contiguous() / scale_b).to(fp8).t()
    out["fp8_tflops"] = round(time_tflops(
        lambda: torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b,
                                 out_dtype=torch.bfloat16), n, repeats), 1)
    out["fp8"] = "e4m3 operands, per-tensor fp32 scales, bf16 output (torch._scaled_mm)"
    return out


# --------------------------------------------------------------------------- memory

def planner_plan(batch_size: int, seq_len: int, precision: str, recompute: bool) -> dict:
    return dict(dp=1, tp=1, pp=1, zero_stage=0, precision=precision, recompute=recompute,
                micro_batch_size=batch_size, micro_batches=1, seq_len=seq_len, schedule="1f1b")


def one_step_memory(model, optimizer, inputs, targets, autocast: bool) -> dict:
    """Bytes allocated by one training step after a first one has made the optimizer's state:
    `state` before it (weights, Adam's moments), `held` after the forward (state + what the
    backward needs), and the step's peak (torch.cuda.max_memory_allocated)."""
    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return model(inputs, targets)[1]

    forward().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    state = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = forward()
    held = torch.cuda.memory_allocated() - state
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {"state": state, "activations": held, "peak": torch.cuda.max_memory_allocated()}


def autocast_weight_copies(model, checkpointed: bool) -> int:
    """Bytes of the bf16 copies autocast makes of the weights a matmul reads, which autograd
    keeps for the backward: every nn.Linear's (a tied head once), or with checkpointed blocks
    only those outside them (the head). The planner counts these 2 bytes a parameter as the
    bf16 recipe's weights, model state, not activations; memory_allocated sees them here."""
    weights = {id(m.weight): m.weight.numel() for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)
               and not (checkpointed and name.startswith("layers."))}
    return 2 * sum(weights.values())


def memory(configs=MEMORY_CONFIGS) -> dict:
    """Measured bytes against the planner's: model state (16 bytes a parameter: fp32 weights,
    gradients and two Adam moments; autocast keeps fp32 weights too), and activations
    (cost_model.activation_bytes: 4 bytes an element in fp32; under bf16 autocast 2, except
    what the course's GPT keeps in fp32, the residual stream and the norms' tensors, which the
    course presets' "norm" and "residual" fields count), plus under autocast the bf16 weight
    copies kept for the backward (autocast_weight_copies)."""
    from snippets.models.gpt import GPT, get_config, shift_for_next_token

    out = {}
    for name, batch_size in configs:
        model_shape = dict(cost_model.MODELS[name])
        seq_len = get_config(name).max_position_embeddings
        rows = {}
        for recompute in (False, True):
            for precision in ("fp32", "bf16"):
                config = get_config(name, gradient_checkpointing=recompute)
                torch.manual_seed(0)
                model = GPT(config).cuda().train()
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
                tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1),
                                       device="cuda")
                measured = one_step_memory(model, optimizer, *shift_for_next_token(tokens),
                                           autocast=precision == "bf16")
                plan = planner_plan(batch_size, seq_len, precision, recompute)
                copies = autocast_weight_copies(model, recompute) if precision == "bf16" else 0
                predicted = {"state": cost_model.model_state_bytes(
                                 model_shape, planner_plan(batch_size, seq_len, "fp32", False),
                                 0)["total"],
                             "activations": cost_model.activation_bytes(model_shape, plan, 0)
                             + copies,
                             "of_which_autocast_weight_copies": copies}
                rows[f"{precision}{'_checkpointed' if recompute else ''}"] = {
                    "measured_bytes": measured, "planner_bytes": predicted,
                    "activations_over_planner": round(
                        measured["activations"] / predicted["activations"], 3),
                    "peak_over_state_plus_activations": round(
                        measured["peak"] / (predicted["state"] + predicted["activations"]), 3)}
                del model, optimizer, tokens
                torch.cuda.empty_cache()
        out[name] = {"batch_size": batch_size, "seq_len": seq_len, "runs": rows}
    return out


def fsdp_rank(rank, world_size, name, batch_size):
    """One rank of the scratch FSDP (bf16 compute, fp32 gradient sums, RMSNorm in fp32, as
    snippets/scratch/fsdp_check.py sets it up): its memory over one training step."""
    from snippets.models.gpt import GPT, RMSNorm, get_config, shift_for_next_token
    from snippets.scratch.fsdp import FSDP, MixedPrecision

    torch.cuda.set_device(rank)
    config = get_config(name)
    torch.manual_seed(0)
    model = GPT(config).cuda()
    parameters = sum(p.numel() for p in model.parameters())
    largest_block = max(sum(p.numel() for p in block.parameters()) for block in model.layers)
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                            fp32_modules=(RMSNorm,))
    FSDP(model, mp=policy, replicate_below=100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.max_position_embeddings + 1),
                           device="cuda")
    measured = one_step_memory(model, optimizer, *shift_for_next_token(tokens), autocast=False)
    return {"parameters": parameters, "largest_block_parameters": largest_block,
            "measured_bytes": measured}


def fsdp(name: str = "gpt2-small", batch_size: int = 8) -> dict:
    """The lesson's accounting (docs/course/week-2/fsdp-from-scratch.md): the persistent state is
    the fp32 master shard, its fp32 gradient and Adam's two fp32 moments, 16 bytes a parameter
    over N ranks (N = 1 here); the bf16 full weights exist only for the unit that computes and
    the one prefetched (2 x 2 bytes a parameter of a block); activations are the planner's bf16
    count with the residual stream in bf16 too (the weights are bf16 here, so the blocks' adds
    are; the norms still compute in fp32, fp32_modules)."""
    from snippets.dist import spawn
    from snippets.models.gpt import get_config

    backend = "nccl" if torch.distributed.is_nccl_available() else "gloo"
    result = spawn(fsdp_rank, 1, name, batch_size, backend=backend)[0]
    seq_len = get_config(name).max_position_embeddings
    plan = planner_plan(batch_size, seq_len, "bf16", False)
    formula = {"state": 16 * result["parameters"],
               "gathered_units": 2 * 2 * result["largest_block_parameters"],
               "activations": cost_model.activation_bytes(
                   {**cost_model.MODELS[name], "residual": "activations"}, plan, 0)}
    measured = result["measured_bytes"]
    return {"config": name, "batch_size": batch_size, "seq_len": seq_len, "world_size": 1,
            "backend": backend, **result, "formula_bytes": formula,
            "state_over_formula": round(measured["state"] / formula["state"], 3),
            "peak_over_formula": round(measured["peak"] / sum(formula.values()), 3)}


# --------------------------------------------------------------------------- main

def run(parts=PARTS, batch_size: int = 16, seq_len: int = 1024, repeats: int = 10,
        compile: bool = True, matmul_size: int = 8192) -> dict:
    device = describe_device()
    print(f"[bench-gpu] {device['name']} (compute capability "
          f"{'.'.join(map(str, device['capability']))}), driver {device['driver']}, "
          f"torch {device['torch']}, CUDA {device['cuda']}", flush=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = {"date": now, "device": device, "machine": machine_info()}
    measures = {"throughput": lambda: throughput(batch_size, seq_len, repeats, compile,
                                                 device["peak_bf16_tflops"]),
                "matmul": lambda: matmul(matmul_size, repeats),
                "memory": memory, "fsdp": fsdp}
    for part in parts:
        start = time.perf_counter()
        print(f"[bench-gpu] {part} ...", flush=True)
        out[part] = measures[part]()
        print(f"[bench-gpu] {part} done in {time.perf_counter() - start:.1f} s", flush=True)
    return out


def parse_args(argv=None):
    parser = Parser(prog="python -m snippets.bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench.json", help="where to write the results")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other results already in --out; replace only the gpu one")
    parser.add_flag("batch-size", type=int_at_least(1), default=16,
                    help="sequences per step in the throughput runs (GPT-2 small: 16)")
    parser.add_flag("seq-len", type=int_at_least(8), default=1024,
                    help="tokens per sequence in the throughput runs (GPT-2 small: 1024)")
    parser.add_flag("repeats", type=int_at_least(1), default=10,
                    help="timed rounds per variant; the median is kept")
    parser.add_flag("matmul-size", type=int_at_least(16), default=8192,
                    help="n of the n x n x n matmuls (a multiple of 16, for fp8)")
    parser.add_flag("no-compile", action="store_true",
                    help="leave out the torch.compile variants (each compiles for a minute)")
    parser.add_flag("parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="which measurements to run")
    args = parser.parse_args(argv)
    if args.matmul_size % 16:
        parser.error(f"argument --matmul-size: must be a multiple of 16, got {args.matmul_size}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    reason = no_cuda_reason()
    if reason is not None:
        raise SystemExit(reason)
    previous = checked_target(args.out, ["gpu"], args.merge, partial=True,
                              run="python -m snippets.bench.gpu")
    results = {"gpu": run(args.parts, args.batch_size, args.seq_len, args.repeats,
                          not args.no_compile, args.matmul_size)}
    write_results(args.out, results, previous)
    print(json.dumps(results, indent=2))
    print(f"[bench-gpu] wrote the gpu section of {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
