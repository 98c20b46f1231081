"""Memory of training, per component: the model state by formula, activations by measurement."""

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

# --8<-- [start:bytes-per-param]
# Bytes each parameter costs with AdamW, by precision recipe.
BYTES_PER_PARAM = {
    # fp32 weights, fp32 gradients, Adam's first and second moments in fp32
    "fp32": {"weights": 4, "gradients": 4, "optimizer": 8},
    # bf16 weights and gradients for the matmuls, plus an fp32 master copy of the weights
    # (updates smaller than bf16's resolution would otherwise be lost) and fp32 moments
    "mixed": {"weights": 2, "gradients": 2, "optimizer": 4 + 8},
}


def model_state_bytes(num_params: int, precision: str = "fp32") -> dict:
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision={precision!r}: choose one of {sorted(BYTES_PER_PARAM)}")
    per_param = BYTES_PER_PARAM[precision]
    out = {part: n * num_params for part, n in per_param.items()}
    out["total"] = sum(out.values())
    return out
# --8<-- [end:bytes-per-param]


# --8<-- [start:activation-bytes]
def measure_activation_bytes(model, input_ids, targets) -> int:
    """Bytes autograd keeps alive between forward and backward: every tensor the forward saves
    for the backward pass, counted once per storage (views of one tensor share it)."""
    # Weights are saved too (often as transposed views), but they are model state, not
    # activations: recognise them by their storage.
    model_state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in model_state:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _, loss = model(input_ids, targets)
    del loss
    return sum(storages.values())
# --8<-- [end:activation-bytes]


# --8<-- [start:selective-policy]
# Selective activation checkpointing for a Llama-style block, as the planner counts it
# (cost_model.activation_bytes_per_layer, recompute="selective"): keep the output of every
# matmul and of attention, recompute the rest (norms, RoPE, SiLU, products) in backward.
# TorchTitan's op-level policy saves the same ops (torchtitan/distributed/activation_checkpoint.py)
# but also recomputes every second matmul; this one recomputes no matmul.
SELECTIVE_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def selective_policy(ctx, func, *args, **kwargs):
    """A policy for torch.utils.checkpoint.create_selective_checkpoint_contexts."""
    if func in SELECTIVE_SAVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE
# --8<-- [end:selective-policy]


def measure_held_activation_bytes(model, input_ids, targets) -> int:
    """Bytes held between forward and backward, whoever holds them: what autograd saves (as
    measure_activation_bytes counts it) and what a selective checkpoint keeps in its own cache,
    which no saved-tensor hook sees. Every storage an op creates in the forward is watched
    through a weak reference; those still alive when the forward returns (the loss kept) are
    held for the backward. Storages are counted once, model state excluded: the parameters and
    buffers, and what an op makes from them alone. Under autocast that is the bf16 copy of each
    weight a matmul keeps (the mixed-precision recipe's 2-byte weights, model state in the
    planner) and the cast RoPE tables; they do not grow with the batch."""
    model_state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    created, saved, derived = [], {}, {}

    def storages(tree):
        return [t.untyped_storage() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]

    def is_state(pointer):  # a derived storage only while alive: its address may be reused
        return pointer in model_state or (pointer in derived and not derived[pointer].expired())

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = storages((args, kwargs))
            from_state = inputs and all(is_state(s.data_ptr()) for s in inputs)
            for storage in storages(out):
                if from_state:
                    derived[storage.data_ptr()] = StorageWeakRef(storage)
                else:
                    created.append((StorageWeakRef(storage), storage.data_ptr(),
                                    storage.nbytes()))
            return out

    def pack(tensor):  # tensors made before the forward and saved by it: the token ids
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    # Autocast keeps its copies of the weights for as long as its region lasts; an earlier
    # forward in the caller's region would leave them made outside this watch, unrecognised.
    torch.clear_autocast_cache()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), Watch():
        loss = model(input_ids, targets)[1]
    held = dict(saved)
    for ref, pointer, nbytes in created:
        if not ref.expired():
            held[pointer] = nbytes
    del loss
    return sum(n for pointer, n in held.items() if not is_state(pointer))
