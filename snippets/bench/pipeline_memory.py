"""The live tensor memory of one pipeline step, measured: 1F1B's peak stays flat as the number
of micro-batches m grows, GPipe's grows with m.

How it is measured. `LiveTensorMemory` is a TorchDispatchMode: every operator PyTorch runs inside
the block, backward included, passes its outputs through it. A storage it has not seen is
counted (its nbytes) and given a finalizer that uncounts it when the storage is freed. So at
every moment `live` is the bytes of all tensor storages created in the block and still alive,
and `peak` its maximum, checked at every allocation (the only moments it can rise). What is
left out: storages created before the block (the weights, the input tokens: the same for every
m), memory a kernel uses inside one operator, and what is not a tensor. The numbers are sizes,
not timings: the same on every run, and on any machine with the pinned torch.

The stages are the tiny GPT's, one layer each, and every micro-batch has the same size (2
sequences of 16 tokens), so a larger m is a larger global batch: what grows with m is only how
many micro-batches a stage holds at once.

    python -m snippets.bench.pipeline_memory                 # the table
    python -m snippets.bench.pipeline_memory --svg out.svg   # and the plot on the pipeline page
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config
from snippets.scratch.pipeline import SCHEDULES, pipeline_train_step, split_into_stages
from snippets.flags import Parser

STAGES, MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ_LEN = 2, (2, 4, 8, 16), 2, 16


# --8<-- [start:live-memory]
class LiveTensorMemory(TorchDispatchMode):
    """Bytes of the tensor storages created inside the block that are still alive (`live`),
    and the most there were at once (`peak`)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes = {}  # id of a live storage -> its bytes

    @classmethod
    def _should_skip_dynamo(cls):  # nothing here is compiled: skip importing Dynamo (seconds)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output that shares an input's storage (a view, an in-place op) allocated nothing.
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.track(tensor.untyped_storage(), inputs)
        return out

    def track(self, storage, inputs):
        key = storage._cdata  # the storage itself, however many tensors view it
        if key not in self.sizes and key not in inputs:
            self.sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            # A storage's Python object lives exactly as long as the storage: the finalizer
            # runs when the last tensor using it is gone.
            weakref.finalize(storage, self.free, key)

    def free(self, key):
        self.live -= self.sizes.pop(key)
# --8<-- [end:live-memory]


# --8<-- [start:worker]
def memory_worker(rank, world_size, micro_batch_counts):
    """Per (schedule, m): the peak live tensor bytes of one training step on this stage."""
    torch.manual_seed(0)
    model = GPT(get_config("tiny", num_hidden_layers=world_size))
    stage = split_into_stages(model, world_size)[rank]
    peaks = {}
    for name, schedule in SCHEDULES.items():
        for m in micro_batch_counts:
            tokens = torch.randint(0, model.config.vocab_size, (m * MICRO_BATCH_SIZE, SEQ_LEN + 1))
            for _ in range(2):  # the first step warms up what is built once; keep the second
                stage.zero_grad(set_to_none=True)  # so that each step allocates its gradients
                with LiveTensorMemory() as memory:
                    pipeline_train_step(stage, schedule, tokens, m, rank, world_size)
            peaks[name, m] = memory.peak
    return peaks
# --8<-- [end:worker]


def measure(num_stages: int = STAGES, micro_batch_counts=MICRO_BATCHES) -> list:
    """peaks[stage][(schedule, m)]: bytes."""
    return spawn(memory_worker, num_stages, list(micro_batch_counts), timeout_s=60)


def format_table(peaks: list) -> str:
    counts = sorted({m for _, m in peaks[0]})
    lines = [f"Peak live tensor memory of one step, KiB: tiny GPT, {len(peaks)} stages, "
             f"micro-batches of {MICRO_BATCH_SIZE} x {SEQ_LEN} tokens",
             f"{'stage':<6}{'schedule':<9}" + "".join(f"{f'm={m}':>9}" for m in counts)]
    for s, stage_peaks in enumerate(peaks):
        for name, label in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
            lines.append(f"{s:<6}{label:<9}"
                         + "".join(f"{stage_peaks[name, m] / 2**10:>9.1f}" for m in counts))
    return "\n".join(lines)


def plot_svg(peaks: list, path) -> None:
    """The peaks against m; the same peaks give the same bytes (fixed hash salt, no date)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({m for _, m in peaks[0]})
    with matplotlib.rc_context({"svg.hashsalt": "pipeline-memory", "font.size": 10}):
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for name, label, style in (("gpipe", "GPipe", "-o"), ("1f1b", "1F1B", "--s")):
            for s, stage_peaks in enumerate(peaks):
                ax.plot(counts, [stage_peaks[name, m] / 2**10 for m in counts], style,
                        color=f"C{s}", label=f"{label}, stage {s}")
        ax.set_xticks(counts, [str(m) for m in counts])
        ax.set_xlabel("micro-batches per step, m (each of the same size)")
        ax.set_ylabel("peak live tensor memory, KiB")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(frameon=False)
        ax.set_title(f"One training step of a {len(peaks)}-stage pipeline, per stage")
        fig.tight_layout()
        fig.savefig(path, format="svg", metadata={"Date": None})
        plt.close(fig)


def main(argv=None):
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--svg", help="also write the plot to this file")
    args = parser.parse_args(argv)
    peaks = measure()
    print(format_table(peaks))
    if args.svg:
        plot_svg(peaks, args.svg)


if __name__ == "__main__":
    main()
