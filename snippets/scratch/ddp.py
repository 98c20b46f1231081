"""Distributed data parallelism from scratch, in three steps.

Every rank holds a full replica of the model and trains on its own slice of the global batch.
If all replicas start equal and apply the same averaged gradient, they stay equal forever: that
is the whole trick. The three versions differ only in *how* they average the gradients:

1. NaiveDDP: after backward, one all-reduce per parameter (many small messages).
2. BucketedDDP: after backward, gradients packed into ~25 MB buckets, one all-reduce per bucket.
3. OverlappedDDP: buckets are all-reduced *during* backward, as soon as their gradients are
   ready, so communication hides behind the rest of the backward pass (what
   PyTorch's own DDP wrapper does).

Only torch.distributed primitives are used (broadcast, all_reduce); tests/test_ddp_scratch.py
checks each version against single-process training and against torch's DDP.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


# --8<-- [start:broadcast]
def broadcast_parameters(module: nn.Module, src: int = 0) -> None:
    """Make every replica start from rank `src`'s weights (and buffers)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src)
# --8<-- [end:broadcast]


# --8<-- [start:naive]
class NaiveDDP(nn.Module):
    """Step 1: average every gradient with its own all-reduce, after backward."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        broadcast_parameters(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        """Call between loss.backward() and optimizer.step()."""
        world = dist.get_world_size()
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)  # sum over ranks...
                p.grad /= world  # ...then mean: each rank's loss was a mean over its slice
# --8<-- [end:naive]


# --8<-- [start:buckets]
class Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.ready = 0  # gradients of this bucket produced so far in this backward pass

    def pack(self) -> None:
        torch.cat([p.grad.reshape(-1) for p in self.params], out=self.buffer)

    def unpack(self, scale: float) -> None:
        self.buffer *= scale
        for p, flat in zip(self.params, self.buffer.split([p.numel() for p in self.params])):
            p.grad.copy_(flat.view_as(p.grad))


def make_buckets(module: nn.Module, bucket_cap_mb: float) -> list[Bucket]:
    """Group parameters into buckets of about bucket_cap_mb, in *reverse* registration order:
    backward produces the last layer's gradients first, so those buckets fill first."""
    params = [p for p in module.parameters() if p.requires_grad]
    cap = bucket_cap_mb * 2**20
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() * p.element_size() > cap:
            buckets.append(Bucket(current))
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        buckets.append(Bucket(current))
    return buckets
# --8<-- [end:buckets]


# --8<-- [start:bucketed]
class BucketedDDP(nn.Module):
    """Step 2: the same averaging, in a few large messages instead of one per parameter.

    Each all-reduce pays a fixed latency (a few microseconds on NVLink, tens of microseconds
    over a network, more with gloo) on top of its bytes/bandwidth. A GPT has ~10 parameters per
    layer; packing them into buckets pays that latency a handful of times per step instead.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25):
        super().__init__()
        self.module = module
        broadcast_parameters(module)
        self.buckets = make_buckets(module, bucket_cap_mb)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        world = dist.get_world_size()
        for bucket in self.buckets:
            bucket.pack()
            dist.all_reduce(bucket.buffer)
            bucket.unpack(1 / world)
# --8<-- [end:bucketed]


# --8<-- [start:overlapped]
class OverlappedDDP(nn.Module):
    """Step 3: launch each bucket's all-reduce from inside backward, as soon as the bucket's
    last gradient is accumulated; wait for all of them when backward ends.

    The training loop needs no sync call: the wait is queued on autograd's engine to run at the
    end of loss.backward(), so the loop is the single-device loop, unchanged. When backward
    returns, every parameter's .grad holds the mean over the ranks, and the next backward
    starts afresh.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25):
        """Wrap every rank's replica of `module`: start it from rank 0's weights, group its
        parameters into self.buckets with make_buckets(module, bucket_cap_mb), and hook each
        parameter, so that backward launches a bucket's all-reduce of bucket.buffer (with
        async_op=True) as soon as the bucket's last gradient is accumulated."""
        super().__init__()
        self.module = module
        broadcast_parameters(module)
        self.buckets = make_buckets(module, bucket_cap_mb)
        self.require_sync = True
        self.pending = []  # (bucket, async work handle) launched in this backward pass
        self.callback_queued = False
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._make_hook(bucket))

    def forward(self, *args, **kwargs):
        """The wrapped module's forward, unchanged: only backward communicates."""
        return self.module(*args, **kwargs)

    def _make_hook(self, bucket: Bucket):
        def hook(param: nn.Parameter) -> None:
            if not self.require_sync:
                return  # inside no_sync(): gradients just accumulate locally
            if not self.callback_queued:
                # First gradient of this backward pass: have autograd call us when it is done.
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self.callback_queued = True
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                bucket.pack()
                self.pending.append((bucket, dist.all_reduce(bucket.buffer, async_op=True)))
        return hook

    def _finish(self) -> None:
        world = dist.get_world_size()
        for bucket, work in self.pending:
            work.wait()
            bucket.unpack(1 / world)
        unfinished = [b for b in self.buckets if 0 < b.ready < len(b.params)]
        if unfinished or len(self.pending) != len(self.buckets):
            raise RuntimeError(
                "some parameters received no gradient in this backward pass, so their bucket "
                "was never all-reduced: every parameter must take part in the loss"
            )
        for bucket in self.buckets:
            bucket.ready = 0
        self.pending, self.callback_queued = [], False

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (e.g. the first k-1 micro-batches of k); the first
        backward after the block ends all-reduces the accumulated sum once."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True
# --8<-- [end:overlapped]
