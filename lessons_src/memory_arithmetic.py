# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Why models outgrow one device
#
# **What you will learn:** how many bytes one parameter costs during training, where that number
# comes from, and at what model size a single GPU runs out of memory before the first step. Every
# number below is computed or measured when this page is built.
#
# Training with Adam keeps four tensors the size of the model: the weights, their gradients, and
# Adam's two running moments. In fp32 that is
#
# $$\text{bytes per parameter} = \underbrace{4}_{\text{weights}} + \underbrace{4}_{\text{gradients}}
#   + \underbrace{4 + 4}_{\text{Adam } m,\ v} = 16.$$
#
# Mixed precision does not make this smaller: it keeps bf16 weights and gradients (2 + 2 bytes) but
# also an fp32 master copy (4) beside the two fp32 moments (4 + 4), again 16 bytes. Activations come
# on top, and grow with batch size and sequence length.
#
# Let us check the 16 on a real optimizer instead of trusting the formula.

# %%
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
n_params = sum(p.numel() for p in model.parameters())

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss = model(torch.randn(8, 512)).pow(2).mean()
loss.backward()
optimizer.step()  # Adam allocates its moments lazily, on the first step


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


weights = tensor_bytes(model.parameters())
grads = tensor_bytes(p.grad for p in model.parameters())
moments = tensor_bytes(
    t for state in optimizer.state.values() for t in state.values() if t.dim() > 0
)
print(f"parameters:        {n_params:,}")
print(f"weights:           {weights / n_params:.1f} bytes/param")
print(f"gradients:         {grads / n_params:.1f} bytes/param")
print(f"Adam moments:      {moments / n_params:.1f} bytes/param")
print(f"total model state: {(weights + grads + moments) / n_params:.1f} bytes/param")

# %% [markdown]
# The measurement agrees with the formula: 16 bytes per parameter, before a single activation is
# stored. (Adam also keeps a scalar `step` per tensor, which is why the sum skips 0-dimensional
# tensors: a few bytes per tensor, not per parameter.)
#
# ## When does one GPU stop being enough?
#
# Multiply by the parameter count. A GPT-style transformer with $L$ layers and hidden size $h$ has
# about $12 L h^2$ parameters in its blocks (attention: $4h^2$, a $4h$-wide MLP: $8h^2$) plus
# $V h$ for the token embedding of a vocabulary of size $V$.

# %%
MODELS = {  # name: (layers, hidden size, vocabulary)
    "GPT-2 small": (12, 768, 50257),
    "GPT-2 XL": (48, 1600, 50257),
    "7B": (32, 4096, 32000),
    "13B": (40, 5120, 32000),
    "70B": (80, 8192, 32000),
}


def approx_params(layers, hidden, vocab):
    return 12 * layers * hidden**2 + vocab * hidden


print(f"{'model':<12} {'params':>8} {'model state (16 B/param)':>26}")
for name, shape in MODELS.items():
    p = approx_params(*shape)
    print(f"{name:<12} {p / 1e9:>7.2f}B {16 * p / 2**30:>22.1f} GiB")

# %% [markdown]
# The formula ignores biases, norms and the exact MLP width, so it is off by a few percent; the
# 70B row (a model whose MLP is wider than $4h$) is an underestimate. That is close enough to see the
# cliff: a 7B model needs about 100 GiB of model state, more than the 80 GB of one H100, before
# activations. This is the first reason to train on many devices, and the reason ZeRO and FSDP (Week
# 2) shard these 16 bytes instead of copying them to every GPU.

# %%
import matplotlib.pyplot as plt

names = list(MODELS)
gib = [16 * approx_params(*MODELS[n]) / 2**30 for n in names]
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.bar(names, gib, color="#3f51b5")
for capacity, label in [(24, "24 GB card"), (80, "80 GB H100")]:
    ax.axhline(capacity * 1e9 / 2**30, color="#ff5722", linestyle="--", linewidth=1)
    ax.text(len(names) - 0.5, capacity * 1e9 / 2**30, label, ha="right", va="bottom", fontsize=8)
ax.set_yscale("log")
ax.set_ylabel("weights + grads + Adam (GiB)")
ax.set_title("Model state for fp32 or mixed-precision Adam training")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Key takeaways
#
# - Adam training costs 16 bytes per parameter in model state, measured above, in fp32 and in
#   mixed precision alike.
# - Past a few billion parameters the model state alone exceeds one GPU: the model has to be split,
#   not just the data.
# - Activations add to this and depend on batch and sequence length; Session B and the
#   activation-checkpointing cheat sheet measure them.
