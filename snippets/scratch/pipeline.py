"""Pipeline parallelism from scratch: GPipe and 1F1B, driven by send and recv.

The model is cut into p stages, one per rank: the first stage holds the token embedding, the last
the final norm, the output head and the loss, and the transformer layers are shared out evenly.
A global batch is cut into m micro-batches. Activations flow forward from rank to rank, gradients
flow back, and a *schedule* decides in which order each rank runs its forwards (F) and
backwards (B):

- GPipe: all m forwards, then all m backwards. Simple; every stage holds m micro-batches'
  activations at the peak.
- 1F1B: a few warm-up forwards, then one forward, one backward, in turn; then the remaining
  backwards. The same bubble, but a stage never holds more than p micro-batches' activations.

Each rank records when every forward and backward started and ended (pipeline_trace.py), so a
timeline can be drawn and the bubble (the idle share of the step) measured. The loss of each
micro-batch is divided by m, so the gradients summed over the micro-batches equal one big
batch's.

Only torch.distributed primitives (isend, recv). Training with it, against one process
(reference.py), is pipeline_check.py; tests/test_pipeline.py checks both schedules that way, and
bench/pipeline_bubble.py and bench/pipeline_memory.py measure them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from snippets.models.gpt import GPT, ConfigError, shift_for_next_token
from snippets.scratch.pipeline_trace import StageTrace


# --8<-- [start:split]
class GPTStage(nn.Module):
    """A contiguous slice of the GPT. The layers keep their index in the whole model as their
    name (layers.2, layers.3, ...), so a stage's state_dict keys are the model's own."""

    def __init__(self, model: GPT, layer_indices: range, first: bool, last: bool):
        super().__init__()
        self.hidden_size = model.config.hidden_size
        self.tied_embeddings = model.config.tie_word_embeddings
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_indices})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, hidden) elsewhere; returns
        hidden states, or logits (B, T, vocab) on the last stage."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def split_into_stages(model: GPT, num_stages: int) -> list[GPTStage]:
    """Cut the model into num_stages stages with equal numbers of layers. The stages share the
    model's parameters (no copy): each rank keeps its own stage and drops the rest."""
    layers = model.config.num_hidden_layers
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"num_stages={num_stages!r} must be a positive integer")
    if layers < num_stages:
        raise ConfigError(
            f"num_hidden_layers={layers} is smaller than num_stages={num_stages}: every stage "
            f"needs at least one layer. Use at most {layers} stages, or a config with "
            f"num_hidden_layers >= {num_stages}.")
    if layers % num_stages:
        fits = [p for p in range(1, layers + 1) if layers % p == 0]
        raise ConfigError(
            f"num_hidden_layers={layers} does not divide by num_stages={num_stages}: the stages "
            f"would get unequal work and the slowest would set the pace. Use num_stages in "
            f"{fits}, or set num_hidden_layers to a multiple of {num_stages}.")
    per_stage = layers // num_stages
    return [GPTStage(model, range(s * per_stage, (s + 1) * per_stage),
                     first=s == 0, last=s == num_stages - 1) for s in range(num_stages)]
# --8<-- [end:split]


# --8<-- [start:schedules]
def gpipe_schedule(num_micro_batches: int, stage_index: int, num_stages: int) -> list:
    """All forwards, then all backwards: [F0, F1, ..., B0, B1, ...] on every stage."""
    return ([("F", i) for i in range(num_micro_batches)]
            + [("B", i) for i in range(num_micro_batches)])


def one_f_one_b_schedule(num_micro_batches: int, stage_index: int, num_stages: int) -> list:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards.

    Returns stage s = `stage_index`'s actions, in order: the tuples ("F", i) and ("B", i), once
    each for every micro-batch i < m = `num_micro_batches`. Of p = `num_stages` stages, stage s
    runs p - s - 1 warm-up forwards (all m when m is smaller), then pairs of the next forward
    and the oldest backward not yet run, forward first, then the backwards still owed, oldest
    first.

    With p - s - 1 warm-up forwards, stage s runs p - s in all before its first backward: just
    enough that, when the pipeline is full, the gradient of micro-batch 0 comes back exactly when
    the stage would otherwise wait. From then on every backward frees one micro-batch's
    activations before the next forward stores another, so stage s holds at most p - s.
    """
    m = num_micro_batches
    warmup = min(num_stages - stage_index - 1, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state
        actions += [("F", warmup + i), ("B", i)]
    actions += [("B", i) for i in range(m - warmup, m)]  # cool-down
    return actions


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}
# --8<-- [end:schedules]


# --8<-- [start:run-schedule]
def run_schedule(stage: nn.Module, actions: list, stage_index: int, num_stages: int,
                 micro_inputs: list, micro_targets: list, loss_fn, activation_shape: tuple,
                 dtype: torch.dtype = torch.float32, group=None):
    """Run one step's forwards and backwards on this stage, in the order `actions` gives.

    Activations go to rank stage_index + 1 and gradients to rank stage_index - 1 with isend,
    which returns at once: a rank blocks only on the recv of something it needs, or on a send
    its neighbour needs before the one it posts next, so no order of sends can deadlock. The
    tag is the micro-batch index. Ranks are counted within `group` (the world by default).
    Returns (the mean loss over the micro-batches on the last stage, else None; the trace).
    """
    first, last = stage_index == 0, stage_index == num_stages - 1
    m = sum(kind == "F" for kind, _ in actions)
    trace = StageTrace(stage_index)
    held = {}  # micro-batch -> (stage input, stage output): waiting for its backward
    in_flight = {}  # neighbour rank -> (work, tensor) of the last isend to it
    loss_sum = 0.0

    def send(tensor, dst, i):
        # Gloo tells that a send is done only through wait(). So wait for the previous send to
        # dst before posting this one (dst receives in order: it needs that one first anyway)
        # and free its tensor now, not at the end of the step: one send per neighbour lives.
        if dst in in_flight:
            in_flight.pop(dst)[0].wait()
        in_flight[dst] = (dist.isend(tensor, group=group, group_dst=dst, tag=i), tensor)

    for kind, i in actions:
        if kind == "F":
            if first:
                x = micro_inputs[i]
            else:
                x = torch.empty(activation_shape, dtype=dtype, device=micro_inputs[0].device)
                dist.recv(x, group=group, group_src=stage_index - 1, tag=i)
                x.requires_grad_()  # so that backward produces the gradient to send back
            with trace.op("F", i):
                y = stage(x)
                if last:  # divided by m: the summed gradients are those of the whole batch
                    y = loss_fn(y, micro_targets[i]) / m
            if last:
                loss_sum += y.item()
            else:
                send(y.detach(), stage_index + 1, i)
            held[i] = (x, y)
            trace.peak_live = max(trace.peak_live, len(held))
        else:
            x, y = held.pop(i)  # dropping them frees this micro-batch's activations
            grad = None  # on the last stage y is the loss: backward starts from it
            if not last:
                grad = torch.empty_like(y)
                dist.recv(grad, group=group, group_src=stage_index + 1, tag=i)
            with trace.op("B", i):
                torch.autograd.backward(y, grad)  # adds into .grad: accumulates over micro-batches
            if not first:
                send(x.grad, stage_index - 1, i)
    for work, _ in in_flight.values():
        work.wait()
    return (loss_sum if last else None), trace
# --8<-- [end:run-schedule]


# --8<-- [start:train-step]
def sync_tied_embedding_grads(stage: GPTStage, stage_index: int, num_stages: int,
                              group=None) -> None:
    """With tied embeddings, one matrix is both the first stage's embedding and the last stage's
    output head. Each of the two ranks holds a copy and computed part of its gradient; exchange
    the parts and add them, so both copies take the same update and stay equal."""
    if num_stages == 1 or not stage.tied_embeddings or 0 < stage_index < num_stages - 1:
        return
    weight = stage.embed_tokens.weight if stage_index == 0 else stage.lm_head.weight
    peer = num_stages - 1 if stage_index == 0 else 0
    grad = weight.grad  # FSDP2 (library/three_d.py) shards it: exchange this rank's rows
    grad = grad.to_local() if hasattr(grad, "to_local") else grad
    other = torch.empty_like(grad)
    work = dist.isend(grad, group=group, group_dst=peer)
    dist.recv(other, group=group, group_src=peer)
    work.wait()
    grad += other  # a + b == b + a exactly, so both copies get the same bits


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's own loss (GPT.forward): mean next-token cross-entropy, in fp32."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=-100)


def pipeline_train_step(stage: GPTStage, schedule, tokens: torch.Tensor, num_micro_batches: int,
                        stage_index: int, num_stages: int, group=None):
    """Forward and backward of one global batch of tokens (B, T+1) through the pipeline; the
    caller then steps its optimizer. Every rank gets the batch: the first stage uses the
    inputs, the last the targets. Stage s is rank s of `group` (default: the world).
    Returns (mean loss on the last stage or None, trace)."""
    batch = tokens.shape[0]
    if batch % num_micro_batches:
        raise ValueError(f"batch size {batch} does not divide into num_micro_batches="
                         f"{num_micro_batches}; use a batch size that is a multiple of it")
    inputs, targets = shift_for_next_token(tokens)
    actions = schedule(num_micro_batches, stage_index, num_stages)
    activation_shape = (batch // num_micro_batches, inputs.shape[1], stage.hidden_size)
    loss, trace = run_schedule(stage, actions, stage_index, num_stages,
                               list(inputs.chunk(num_micro_batches)),
                               list(targets.chunk(num_micro_batches)),
                               cross_entropy, activation_shape, group=group)
    sync_tied_embedding_grads(stage, stage_index, num_stages, group)
    return loss, trace
# --8<-- [end:train-step]

