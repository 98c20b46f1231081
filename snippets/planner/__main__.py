"""The scale planner from the command line: the same model as the calculator page.

    python -m snippets.planner --model llama-70b --dp 16 --tp 8 --pp 4 --zero-stage 1
"""

import argparse
import sys

from snippets.planner.cost_model import CLUSTERS, MODELS, PlannerError, plan_training


def human(n: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m snippets.planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="llama-7b")
    p.add_argument("--cluster", choices=sorted(CLUSTERS), default=next(iter(CLUSTERS)))
    for name, default in (("dp", 8), ("tp", 1), ("pp", 1), ("micro-batch-size", 1),
                          ("micro-batches", 8), ("seq-len", 2048)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=1)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp8"), default="bf16")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--mfu", type=float, default=0.4)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    plan = {key: getattr(args, key) for key in (
        "dp", "tp", "pp", "zero_stage", "precision", "recompute", "micro_batch_size",
        "micro_batches", "seq_len", "schedule", "mfu")}
    try:
        r = plan_training(MODELS[args.model], plan, CLUSTERS[args.cluster])
    except PlannerError as err:
        sys.exit(f"error: {err}")
    print(f"{args.model} on {r['gpus']} GPUs ({args.cluster}): dp={args.dp} tp={args.tp} "
          f"pp={args.pp} ZeRO-{args.zero_stage} {args.precision}"
          f"{' recompute' if args.recompute else ''}")
    print(f"  parameters {human(r['parameters'], '')}, {human(r['parameters_per_gpu'], '')} per GPU")
    for part, size in r["memory_bytes"].items():
        print(f"  {part:<15} {human(size, 'B'):>10}")
    verdict = "fits" if r["fits"] else "does NOT fit"
    print(f"  {verdict} in {CLUSTERS[args.cluster]['gpu_memory_gb']} GB "
          f"({100 * r['memory_fraction']:.0f}%)")
    for part, seconds in r["time_s"].items():
        print(f"  {part:<22} {seconds * 1e3:9.1f} ms")
    print(f"  bubble {100 * r['bubble_fraction']:.1f}%, {r['tokens_per_s']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
