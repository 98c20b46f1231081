"""Memory of training, per component: the model state by formula, activations by measurement."""

import torch

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
