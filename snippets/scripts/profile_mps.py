"""The GPU side of a few training steps on Apple's MPS, as OS signposts for Xcode's Instruments.

    python snippets/scripts/profile_mps.py --config tiny --steps 3

torch.profiler has no MPS activity in the pinned PyTorch (ProfilerActivity: CPU, CUDA, XPU, MTIA,
HPU, PrivateUse1), so on a Mac it records each operator's CPU side only: the time to encode its
Metal kernel, not the GPU's work (profile_step.py --device mps). torch.mps.profiler makes the MPS
backend emit OS signposts instead: one for every operator it runs on the GPU, every copy between
the CPU and the GPU, and every operator that falls back to the CPU. In "interval" mode each one
spans the work's run time on the GPU; Instruments (its Logging template, under os_signpost)
records them and draws them on a timeline. The steps are the ones profile_step.py labels and
times, on the same model, optimizer and data.
"""

from __future__ import annotations

import argparse
import sys

import torch

from snippets.machine import DeviceError
from snippets.models.gpt import ConfigError
from snippets.flags import Parser, int_at_least
from snippets.scripts.profile_step import build, train_step


# --8<-- [start:signposts]
def profile_on_mps(model, optimizer, sampler, device: torch.device, steps: int,
                   wait_until_completed: bool = False) -> None:
    """Run one step unrecorded, then `steps` steps with an OS signpost per operator."""
    train_step(model, optimizer, sampler, device)  # creates AdamW's state; not recorded
    # wait_until_completed=True waits for each operator's GPU work before the next one is
    # encoded: one operator per interval, easier to read, but not the speed of a real step.
    with torch.mps.profiler.profile(mode="interval", wait_until_completed=wait_until_completed):
        for _ in range(steps):
            train_step(model, optimizer, sampler, device)
# --8<-- [end:signposts]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help="model config: tiny|small|medium|...")
    p.add_argument("--steps", type=int_at_least(1), default=3, help="steps to record")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="sequences per step")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--wait-until-completed", action="store_true",
                   help="finish each operator on the GPU before encoding the next")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device, _, model, optimizer, sampler = build(argparse.Namespace(
            device="mps", config=args.config, seed=args.seed, batch_size=args.batch_size,
            adamw="default", data_delay_ms=0.0))
    except (DeviceError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    profile_on_mps(model, optimizer, sampler, device, args.steps, args.wait_until_completed)
    print(f"recorded {args.steps} steps of the {args.config} GPT as os_signpost intervals: "
          "Instruments shows them if it was recording")
    return 0


if __name__ == "__main__":
    sys.exit(main())
