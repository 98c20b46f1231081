"""The scale planner from the command line: the same model as the calculator page.

    python -m snippets.planner --model llama-70b --dp 16 --tp 8 --pp 4 --zero-stage 1
    python -m snippets.planner --model llama-70b --seq-len 4096 --dp 128 --tp 8 --sp
    python -m snippets.planner --model deepseek-v3 --dp 128 --ep 64 --recompute
    python -m snippets.planner --model llama-405b --dp 128 --tp 8 --pp 16 --seq-len 8192

A model of your own: start from a preset and change its shape, e.g. GPT-3 175B (Brown et al.
2020, Table 2.1) as Megatron-LM builds it:

    python -m snippets.planner --architecture gpt3 --layers 96 --hidden 12288 --ffn 49152 \\
        --heads 96 --kv-heads 96 --vocab 51200 --tp 8 --pp 8 --dp 4 --sp
"""

import argparse
import re
import sys

from snippets.planner.cost_model import (CLUSTERS, FLOP_CONVENTIONS, MODELS, PlannerError,
                                         plan_training)
from snippets.flags import Parser, checked, int_at_least

# The model-shape flags, and the model keys they set.
SHAPE_FLAGS = {"layers": "num_hidden_layers", "hidden": "hidden_size",
               "ffn": "intermediate_size", "heads": "num_attention_heads",
               "kv-heads": "num_key_value_heads", "vocab": "vocab_size"}


def human(n: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def parse_args(argv=None):
    p = Parser(prog="python -m snippets.planner", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="llama-7b",
                   help="a preset; the shape flags below change it")
    for flag, key in SHAPE_FLAGS.items():
        p.add_argument(f"--{flag}", type=int_at_least(1), help=f"the model's {key}")
    p.add_argument("--architecture", choices=("llama", "gpt3"),
                   help="llama: RMSNorm, RoPE, SwiGLU; gpt3: Megatron-LM's GPT (LayerNorm, "
                        "GELU, learned positions up to --seq-len, tied embeddings)")
    p.add_argument("--cluster", choices=sorted(CLUSTERS), default=next(iter(CLUSTERS)))
    for name, default in (("dp", 8), ("tp", 1), ("pp", 1), ("cp", 1), ("ep", 1),
                          ("virtual-stages", 1),
                          ("micro-batch-size", 1), ("micro-batches", 8), ("seq-len", 2048)):
        p.add_argument(f"--{name}", type=int_at_least(1), default=default)
    for end in ("first", "last"):
        p.add_argument(f"--{end}-stage-layers", type=int_at_least(1), default=0,
                       help=f"layers on the {end} pipeline stage (default: an even split, or "
                            f"Llama 3's, one layer fewer on the first and last)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=1)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp8"), default="bf16")
    p.add_argument("--fp32-main-grads", action="store_true",
                   help="gradients kept and reduced in fp32 (Megatron-LM's main grads): 4 bytes "
                        "per parameter instead of the precision's")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--recompute", nargs="?", const="full", default="none",
                   choices=("none", "selective", "full"),
                   help="bare --recompute means full; selective keeps the matmuls' and attention's "
                        "outputs and recomputes the cheap ops (llama: norms, RoPE, SiLU; gpt3: "
                        "attention's softmax and dropout)")
    p.add_argument("--no-cp-overlap", dest="cp_overlap", action="store_false",
                   help="ring attention's K/V exchange not hidden behind attention's compute")
    p.add_argument("--ep-overlap", action="store_true",
                   help="the experts' all-to-alls hidden behind compute (DeepSeek's DualPipe)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--mfu", type=checked(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
                   default=0.4, help="fraction of peak FLOP/s the matmuls reach while they run")
    p.add_argument("--flops", choices=FLOP_CONVENTIONS, default=FLOP_CONVENTIONS[0],
                   help="what MFU counts: matmuls and attention's full score matrix (PaLM, "
                        "Megatron-LM's papers, Llama 3), with its causal half (Megatron-LM's code), "
                        "matmuls only, or 6 x parameters; step time always counts what the "
                        "kernels run (causal for llama)")
    return p.parse_args(argv)


def model_of(args) -> dict:
    """The preset --model names, with the shape flags' changes."""
    model = dict(MODELS[args.model])
    for flag, key in SHAPE_FLAGS.items():
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            model[key] = value
    if args.architecture == "gpt3":
        model.update(architecture="gpt3", tie_word_embeddings=True,
                     max_position_embeddings=args.seq_len)
    elif args.architecture == "llama":
        model.pop("architecture", None)
    return model


def plan_of(args) -> dict:
    """The plan the parsed flags describe (the cost model's keys)."""
    return {key: getattr(args, key) for key in (
        "dp", "tp", "pp", "cp", "ep", "ep_overlap", "virtual_stages", "zero_stage", "precision",
        "sp", "recompute", "cp_overlap", "micro_batch_size", "micro_batches", "seq_len",
        "schedule", "mfu", "flops", "first_stage_layers", "last_stage_layers",
        "fp32_main_grads")}


def flags_named_in(message: str) -> list[str]:
    """The command-line flags of the model and plan keys a cost-model message names."""
    keys = {key: f"--{flag}" for flag, key in SHAPE_FLAGS.items()}
    keys |= {key: f"--{key.replace('_', '-')}" for key in plan_of(parse_args([]))}
    return [flag for key, flag in keys.items() if re.search(rf"\b{key}\b", message)]


def stage_columns(r: dict) -> list[tuple[str, dict]]:
    """The distinct stages to show, (role, memory): first, the busiest middle one, last; one
    column with pp = 1, two with pp = 2."""
    columns = {}
    for role, memory in r["memory_per_stage"].items():
        columns.setdefault(memory["stage"], (role, memory))
    return list(columns.values())


def print_memory(r: dict, capacity_gb: float) -> None:
    """Memory per GPU, part by part; with a pipeline, one column per stage."""
    columns = stage_columns(r)
    if len(columns) == 1:
        for part, size in r["memory_bytes"].items():
            print(f"  {part:<15} {human(size, 'B'):>10}")
    else:
        print(f"  {'stage':<15}" + "".join(f"{role} ({m['stage']})".rjust(13) for role, m in columns))
        print(f"  {'layers':<15}" + "".join(f"{m['layers']:>13}" for _, m in columns))
        for part in r["memory_bytes"]:
            print(f"  {part:<15}" + "".join(f"{human(m[part], 'B'):>13}" for _, m in columns))
    verdict = "fits" if r["fits"] else "does NOT fit"
    where = ""
    if len(columns) > 1:
        where = f", busiest stage {r['busiest_stage']}"
    print(f"  {verdict} in {capacity_gb} GB with {r['reserved_bytes'] / 1e9:g} GB reserved "
          f"({100 * r['memory_fraction']:.0f}%{where})")


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        r = plan_training(model_of(args), plan_of(args), CLUSTERS[args.cluster])
    except PlannerError as err:
        flags = flags_named_in(str(err))
        sys.exit(f"error: {err}" + (f" (flags: {', '.join(flags)})" if flags else ""))
    extras = [f"cp={args.cp}" if args.cp > 1 else "", f"ep={args.ep}" if args.ep > 1 else "",
              "sp" if args.sp else "", "fp32 main grads" if args.fp32_main_grads else "",
              f"v={args.virtual_stages}" if args.virtual_stages > 1 else "",
              f"recompute={args.recompute}" if args.recompute != "none" else ""]
    changes = [f"{flag}={getattr(args, flag.replace('-', '_'))}" for flag in SHAPE_FLAGS
               if getattr(args, flag.replace("-", "_")) is not None]
    if args.architecture:
        changes.append(f"architecture={args.architecture}")
    name = args.model
    if changes:
        name = f"{args.model} with {', '.join(changes)}"
    print(f"{name} on {r['gpus']} GPUs ({args.cluster}): dp={args.dp} tp={args.tp} "
          f"pp={args.pp} ZeRO-{args.zero_stage} {args.precision}"
          + "".join(f" {e}" for e in extras if e))
    print(f"  parameters {human(r['parameters'], '')}, {human(r['parameters_per_gpu'], '')} per GPU")
    print_memory(r, CLUSTERS[args.cluster]["gpu_memory_gb"])
    for part, seconds in r["time_s"].items():
        print(f"  {part:<22} {seconds * 1e3:9.1f} ms")
    print(f"  bubble {100 * r['bubble_fraction']:.1f}%, {r['tokens_per_s']:,.0f} tokens/s, "
          f"MFU {100 * r['model_flops_utilization']:.1f}% ({args.flops})")


if __name__ == "__main__":
    main()
