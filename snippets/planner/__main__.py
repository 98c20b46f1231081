"""The scale planner from the command line: the same model as the calculator page.

    python -m snippets.planner --model llama-70b --dp 16 --tp 8 --pp 4 --zero-stage 1
    python -m snippets.planner --model llama-70b --seq-len 4096 --dp 128 --tp 8 --sp
    python -m snippets.planner --model deepseek-v3 --dp 128 --ep 64 --recompute
"""

import argparse
import sys

from snippets.planner.cost_model import (CLUSTERS, FLOP_CONVENTIONS, MODELS, PlannerError,
                                         plan_training)
from snippets.training.flags import Parser, checked, int_at_least


def human(n: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def parse_args(argv=None):
    p = Parser(prog="python -m snippets.planner", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="llama-7b")
    p.add_argument("--cluster", choices=sorted(CLUSTERS), default=next(iter(CLUSTERS)))
    for name, default in (("dp", 8), ("tp", 1), ("pp", 1), ("cp", 1), ("ep", 1),
                          ("virtual-stages", 1),
                          ("micro-batch-size", 1), ("micro-batches", 8), ("seq-len", 2048)):
        p.add_argument(f"--{name}", type=int_at_least(1), default=default)
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=1)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp8"), default="bf16")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--recompute", nargs="?", const="full", default="none",
                   choices=("none", "selective", "full"), help="bare --recompute means full")
    p.add_argument("--no-cp-overlap", dest="cp_overlap", action="store_false",
                   help="ring attention's K/V exchange not hidden behind attention's compute")
    p.add_argument("--ep-overlap", action="store_true",
                   help="the experts' all-to-alls hidden behind compute (DeepSeek's DualPipe)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--mfu", type=checked(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
                   default=0.4, help="fraction of peak FLOP/s the matmuls reach while they run")
    p.add_argument("--flops", choices=FLOP_CONVENTIONS, default=FLOP_CONVENTIONS[0],
                   help="what MFU counts: matmuls and attention, matmuls only, or 6 x parameters")
    return p.parse_args(argv)


def plan_of(args) -> dict:
    """The plan the parsed flags describe (the cost model's keys)."""
    return {key: getattr(args, key) for key in (
        "dp", "tp", "pp", "cp", "ep", "ep_overlap", "virtual_stages", "zero_stage", "precision",
        "sp", "recompute", "cp_overlap", "micro_batch_size", "micro_batches", "seq_len",
        "schedule", "mfu", "flops")}


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        r = plan_training(MODELS[args.model], plan_of(args), CLUSTERS[args.cluster])
    except PlannerError as err:
        sys.exit(f"error: {err}")
    extras = [f"cp={args.cp}" if args.cp > 1 else "", f"ep={args.ep}" if args.ep > 1 else "",
              "sp" if args.sp else "",
              f"v={args.virtual_stages}" if args.virtual_stages > 1 else "",
              f"recompute={args.recompute}" if args.recompute != "none" else ""]
    print(f"{args.model} on {r['gpus']} GPUs ({args.cluster}): dp={args.dp} tp={args.tp} "
          f"pp={args.pp} ZeRO-{args.zero_stage} {args.precision}"
          + "".join(f" {e}" for e in extras if e))
    print(f"  parameters {human(r['parameters'], '')}, {human(r['parameters_per_gpu'], '')} per GPU")
    for part, size in r["memory_bytes"].items():
        print(f"  {part:<15} {human(size, 'B'):>10}")
    verdict = "fits" if r["fits"] else "does NOT fit"
    print(f"  {verdict} in {CLUSTERS[args.cluster]['gpu_memory_gb']} GB "
          f"({100 * r['memory_fraction']:.0f}%)")
    for part, seconds in r["time_s"].items():
        print(f"  {part:<22} {seconds * 1e3:9.1f} ms")
    print(f"  bubble {100 * r['bubble_fraction']:.1f}%, {r['tokens_per_s']:,.0f} tokens/s, "
          f"MFU {100 * r['model_flops_utilization']:.1f}% ({args.flops})")


if __name__ == "__main__":
    main()
