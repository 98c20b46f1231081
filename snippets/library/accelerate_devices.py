"""Where Accelerate puts the model and the batches, and the switches that change it.

    python snippets/library/accelerate_devices.py                        # the best device here
    python snippets/library/accelerate_devices.py --cpu                  # the CPU, even with a GPU
    python snippets/library/accelerate_devices.py --no-device-placement  # you move things yourself

Accelerator() picks, in order: MPS (Apple silicon), then other accelerators (MLU, NPU, HPU, ...)
before CUDA, then XPU and the rest, then the CPU; under a multi-GPU launch each process takes
the GPU numbered by its local rank (cuda:LOCAL_RANK).
"""

import argparse
from snippets.flags import Parser

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader


# --8<-- [start:placement]
def show_placement(accelerator: Accelerator) -> None:
    """Prepare a small model and loader, and print where their tensors end up."""
    print(f"available: cuda={torch.cuda.is_available()}, mps={torch.backends.mps.is_available()}")
    print(f"accelerator.device = {accelerator.device} ({accelerator.distributed_type.value}, "
          f"{accelerator.num_processes} process, device_placement={accelerator.device_placement})")
    model = torch.nn.Linear(4, 2)  # created on the CPU, as every model is
    loader = DataLoader(torch.randn(8, 4), batch_size=4)
    model, loader = accelerator.prepare(model, loader)
    batch = next(iter(loader))
    print(f"after prepare: model on {next(model.parameters()).device}, batch on {batch.device}")
# --8<-- [end:placement]


def main(argv=None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="Accelerator(cpu=True)")
    p.add_argument("--no-device-placement", action="store_true",
                   help="Accelerator(device_placement=False): prepare moves nothing")
    args = p.parse_args(argv)
    show_placement(Accelerator(cpu=args.cpu, device_placement=not args.no_device_placement))


if __name__ == "__main__":
    from snippets.dist import run_main

    run_main(main)
