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
# # Demo: train, checkpoint, resume
#
# **What you will learn:** how to train the course's tiny transformer on one device and read its
# loss; why the loss starts at $\ln 256 \approx 5.55$; what a checkpoint must hold so that a run
# killed halfway resumes to *exactly* the losses of a run that was never stopped; and what the
# loss on held-out text tells you that the training loss cannot.
#
# Everything here runs on a laptop. The page was executed when the site was built: every number
# and plot below comes from that run, on a CPU.
#
# The trainer is `snippets/scripts/train_tiny_transformer.py`, the same script Lab 1 runs from
# the command line. Here it is called in-process: `parse_args` takes
# the command-line flags as a list, and `train` returns the metric records it also writes to
# `metrics.jsonl`.

# %%
import atexit
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from snippets.machine import pick_device

print(f"pick_device('auto') chooses: {pick_device('auto')}")
print(f"CUDA available: {torch.cuda.is_available()}, "
      f"MPS available: {torch.backends.mps.is_available()}")

# Each run writes a folder (metrics, checkpoints, a loss plot): keep them in a scratch directory,
# deleted when this Python process exits.
workdir = tempfile.mkdtemp(prefix="session-a-demo-")
atexit.register(shutil.rmtree, workdir, ignore_errors=True)
os.chdir(workdir)

# %% [markdown]
# `pick_device("auto")` takes CUDA if there is an NVIDIA GPU, then Apple's **MPS** (the GPU of an
# M-series Mac), then the CPU. On a Mac the trainer therefore uses the GPU without a flag;
# `--device mps` insists on it and fails with a reason if it is missing, instead of quietly
# training on the CPU. The runs below pass `--device cpu` on purpose: the bit-for-bit resume
# check at the end holds on the CPU, while GPU kernels may add in a different order from run to
# run (more on that below). To train on your own GPU or Mac, drop that flag:
#
# ```
# python snippets/scripts/train_tiny_transformer.py --epochs 1            # CUDA, MPS or CPU
# python snippets/scripts/train_tiny_transformer.py --epochs 1 --device mps
# ```
#
# ## The model, before training
#
# The model is a small Llama-style GPT (RMSNorm, rotary positions, SwiGLU) read from
# `snippets/models/config.json`: two layers, a hidden size of 64, four heads. Its vocabulary is
# the 256 possible bytes, so it needs no tokenizer. Before any training, what loss does it get on
# real text?

# %%
from snippets.data.dataset import load_tokens, sequential_batches, train_val_split
from snippets.models.gpt import GPT, GPTConfig, shift_for_next_token
from snippets.scripts.train_tiny_transformer import DEFAULT_CONFIG, parse_args, train

config = GPTConfig.from_json(DEFAULT_CONFIG)
print({k: v for k, v in config.to_dict().items() if k in (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "max_position_embeddings")})

torch.manual_seed(0)
untrained = GPT(config)
train_tokens, val_tokens = train_val_split(load_tokens(None), val_fraction=0.1)
batch = next(sequential_batches(val_tokens, batch_size=16, context_length=64))
inputs, targets = shift_for_next_token(batch)
with torch.no_grad():
    logits, loss = untrained(inputs, targets)
probs = logits.softmax(-1)
print(f"{untrained.num_parameters():,} parameters")
print(f"logits: mean {logits.mean():.4f}, std {logits.std():.4f}")
print(f"probability of the likeliest byte: {probs.max(-1).values.mean():.5f} "
      f"(1/256 = {1 / 256:.5f})")
print(f"loss {loss:.4f}, ln(256) = {math.log(256):.4f}")

# %% [markdown]
# The weights start as small random numbers (standard deviation 0.02), so every logit is close
# to zero, the softmax spreads its probability almost evenly over the 256 bytes, and the
# cross-entropy of a uniform guess over 256 outcomes is $-\ln(1/256) = \ln 256 \approx 5.545$
# nats. That is the number to expect at step 1. A first loss far above it means the
# initialisation is too large (confidently wrong logits); far below it means the model is seeing
# its own targets.
#
# ## Train, and watch the loss
#
# 160 steps of 16 sequences of 64 bytes each, evaluating on held-out text and saving a checkpoint
# every 40 steps. One thread: for a model this small a second thread barely helps, and one thread
# keeps the arithmetic identical from run to run.

# %%
COMMON = ["--epochs", "1", "--steps-per-epoch", "160", "--batch-size", "16",
          "--seq-len", "64", "--eval-every", "40", "--eval-batches", "10",
          "--ckpt-every", "40", "--keep-last", "5", "--log-every", "40", "--sample-tokens", "60",
          "--device", "cpu", "--threads", "1"]
unbroken = train(parse_args(COMMON + ["--out", "unbroken"]))

# %%
import matplotlib.pyplot as plt

records = [json.loads(line) for line in Path("unbroken/metrics.jsonl").read_text().splitlines()]
steps = [r["step"] for r in records if r["kind"] == "train"]
losses = [r["loss"] for r in records if r["kind"] == "train"]
evals = [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"]

counts = torch.bincount(train_tokens.long(), minlength=256).float()
p = counts[counts > 0] / counts.sum()
unigram_entropy = -(p * p.log()).sum().item()

fig, ax = plt.subplots(figsize=(7.5, 4))
ax.plot(steps, losses, lw=1, label="train loss (one batch per step)")
ax.plot(*zip(*evals), "o-", label="validation loss (held-out text)")
ax.axhline(math.log(256), ls="--", c="gray", lw=1)
ax.text(160, math.log(256), "ln 256: uniform over bytes", ha="right", va="bottom", fontsize=8)
ax.axhline(unigram_entropy, ls=":", c="gray", lw=1)
ax.text(160, unigram_entropy, "byte frequencies only", ha="right", va="bottom", fontsize=8)
ax.set(xlabel="step", ylabel="cross-entropy (nats per byte)", title="Tiny GPT, 160 steps on CPU")
ax.legend()
fig.tight_layout()
plt.show()
print(f"{int((counts > 0).sum())} distinct bytes occur in the training text; "
      f"the entropy of their frequencies is {unigram_entropy:.2f} nats")

# %% [markdown]
# What to observe:
#
# - **Step 1 is at $\ln 256$**, as predicted. Within a few dozen steps the loss falls to near
#   the dotted line: the model has learned which bytes occur and how often (the line under the
#   plot prints how few distinct bytes this text uses, and the entropy of their frequencies,
#   which is the dotted line). That takes no context at all.
# - **The second, slower descent is the model using context**: spaces after words, `=` after
#   `name`, the verb agreeing with its subject, digits after `record`. Each of those is a
#   regularity the attention layers have to find, which is why the curve bends rather than
#   dropping in one go.
# - **The train curve wiggles; the validation curve does not.** Each train point is the loss on
#   a single random batch of 1,024 bytes; each validation point averages the same fixed 10
#   batches of held-out text, so two validation points differ only because the model changed.
#
# ## The checkpoints on disk

# %%
for ckpt in sorted(Path("unbroken/checkpoints").iterdir()):
    print(f"{ckpt.name:<24} {ckpt.stat().st_size:>10,} bytes")

# %% [markdown]
# A checkpoint every 40 steps, and one at the end; `latest` holds the newest one's name. Each
# `.pt` file has a `.pt.json` beside it holding its size and SHA-256, written after the file:
# the loader checks both, so a file cut short by a crash is reported instead of half-loaded
# (see `snippets/training/checkpoint.py`). What is inside?

# %%
from snippets.training.checkpoint import load_checkpoint

state = load_checkpoint("unbroken/checkpoints/ckpt-00000080.pt")


def tensor_bytes(obj, seen: set) -> int:
    """Bytes of the tensors in obj, each storage counted once: the tied output layer
    (lm_head.weight) is the embedding matrix under a second name, and is saved once."""
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage().data_ptr()
        if storage in seen:
            return 0
        seen.add(storage)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


for key, value in state.items():
    inside = ", ".join(map(str, value)) if isinstance(value, dict) else repr(value)
    print(f"{key:<10} {tensor_bytes(value, set()):>9,} B in tensors | {inside[:52]}")

moments = state["optimizer"]["state"][0]
print(f"\nAdamW state of the first parameter: {list(moments)}, step = {moments['step'].item():.0f}")
print(f"scheduler: {state['scheduler']['last_epoch']} steps taken; "
      f"sampler: {state['sampler']['batches_drawn']} batches drawn")

# %% [markdown]
# The weights are about a third of the file (115,520 parameters of 4 bytes). To continue a run
# *exactly*, a checkpoint needs every input of the next step:
#
# | key | what it restores | if it were missing |
# | --- | --- | --- |
# | `model` | the weights | nothing to resume |
# | `optimizer` | AdamW's two moments per weight and its step count | Adam restarts from zero moments: a jump in the loss, and its bias correction starts over |
# | `scheduler` | where the learning rate is on its warmup-then-cosine curve | the warmup runs again |
# | `sampler` | the state of the generator that picks the training windows | the run sees different batches from the unbroken one |
# | `rng` | Python's, NumPy's and PyTorch's global generators | anything random in the model (dropout) differs |
# | `step`, `config`, `hparams` | where we are, and what model and settings made the file | `--resume` could load into the wrong model |
#
# The optimizer state is twice the size of the weights: AdamW keeps two numbers per parameter.
# Those are the weights' 4 bytes and Adam's 8 of the 16 bytes per parameter in the
# [memory lesson](../memory_arithmetic/); the gradients' 4 are not saved, because the next step
# computes them afresh.
#
# ## Stop a run, then resume it
#
# Now the same run again, stopped after step 100: `--max-steps` stops the loop as a time limit
# would, saving a checkpoint at that step first (but no final evaluation).

# %%
first = train(parse_args(COMMON + ["--out", "broken", "--max-steps", "100"]))
print(sorted(p.name for p in Path("broken/checkpoints").glob("*.pt")))

# %% [markdown]
# The newest checkpoint is from step 100, so nothing is lost. `--resume` loads the newest
# checkpoint that verifies, restores every piece listed above and continues from step 101. (A
# crash saves nothing: had the run been killed after step 100, `--resume` would start from the
# step-80 checkpoint, roll `metrics.jsonl` back to step 80 and redo steps 81 to 100.)

# %%
resumed = train(parse_args(COMMON + ["--out", "broken", "--resume"]))

# %%
def train_losses(records, first_step, last_step):
    return {r["step"]: r["loss"] for r in records
            if r["kind"] == "train" and first_step <= r["step"] <= last_step}


after = train_losses(resumed, 101, 160)
reference = train_losses(unbroken, 101, 160)
print("step  unbroken run        resumed run")
for step in (101, 102, 120, 159, 160):
    print(f"{step:>4}  {reference[step]!r:<18}  {after[step]!r}")
print(f"\nsteps 101-160 equal, bit for bit: {after == reference}")
print(f"largest difference: {max(abs(after[s] - reference[s]) for s in after)}")
val_after = [(r["step"], r["val_loss"]) for r in resumed if r["kind"] == "eval"]
val_reference = [(r["step"], r["val_loss"]) for r in unbroken
                 if r["kind"] == "eval" and r["step"] > 100]
print(f"validation losses equal: {val_after == val_reference}")

# %% [markdown]
# The losses are not merely close: they are the same floating-point numbers (`repr` prints every
# digit), and `==` on the two dictionaries is `True`. That works because a training step is a
# deterministic function of its inputs: the weights, the optimizer moments, the learning rate,
# and the batch. The checkpoint restored all four, and on a CPU with a fixed thread count the
# same operations on the same inputs run the same instructions in the same order.
#
# Three things would break the equality, and they are worth knowing before debugging a
# "resumed run that diverges":
#
# - **A different thread count**, or a different CPU: sums are split differently across threads,
#   and floating-point addition is not associative, so the last bits change and the runs drift.
# - **GPUs**: some CUDA kernels accumulate with atomic additions whose order varies from run to
#   run. Resumed and unbroken runs then agree to rounding error, not bit for bit, unless you ask
#   for deterministic kernels (`torch.use_deterministic_algorithms(True)`).
# - **A forgotten piece of state**: restore the weights but not the optimizer, or not the
#   sampler, and the curve visibly departs from the unbroken one at the resume step. Comparing a
#   resumed run with an unbroken one, as here, is the test that catches it; the course's test
#   suite runs exactly this comparison.
#
# ## Validate on held-out text
#
# The last 10% of the text was never trained on. Its loss, the greedy sample the trainer printed
# at the end of each run, and one more comparison tell us what the model learned. First, is a
# checkpoint file really the model? Load the final one into a fresh `GPT` and evaluate it the way
# the trainer does:

# %%
from snippets.scripts.train_tiny_transformer import evaluate, sample_text
from snippets.data.tokenizer import ByteTokenizer

final = load_checkpoint("broken/checkpoints/ckpt-00000160.pt")
model = GPT(GPTConfig(**final["config"]))
model.load_state_dict(final["model"])
model.eval()

val_loss = evaluate(model, val_tokens, 16, 64, "cpu", max_batches=10)
train_loss = evaluate(model, train_tokens, 16, 64, "cpu", max_batches=10)
print(f"loaded from the checkpoint: validation loss {val_loss:.4f} "
      f"(the trainer logged {resumed[-1]['val_loss']:.4f})")
print(f"same measurement on 10 batches of training text: {train_loss:.4f}")
print(f"per byte, the model now assigns the true next byte a probability of about "
      f"{math.exp(-val_loss):.2f} (geometric mean), against 1/256 = {1 / 256:.4f} at the start")

tokenizer = ByteTokenizer()
for prompt in ["record 9061: name=gus city=oslo age=27 | check ", "61 - 19 = ", "the cats "]:
    continuation = sample_text(model, tokenizer, tokenizer.encode(prompt), 30, "cpu")
    print(f"{prompt!r}\n    -> {continuation!r}")

# %% [markdown]
# What the held-out loss adds:
#
# - **It measures generalisation, not fitting.** The training loss is measured on the batch the
#   model is about to learn from. The validation loss is measured on text the model has never
#   seen: different record ids, different sums, sentences in new combinations. Here the two are
#   about equal, because 160 steps of 1,024 bytes have not yet been through the 270,000
#   training bytes once: there was nothing to memorise yet. When the training loss keeps falling
#   while the validation loss flattens or rises, the model has started memorising its training
#   text, and more steps of the same data stop helping.
# - **It is comparable across time and across runs.** Every evaluation walks the same held-out
#   windows in order, with no randomness, so a change in it is a change in the model, and Lab 1
#   can compare model configs by it.
# - **The samples show what the number hides.** A greedy continuation takes the likeliest byte
#   at each step, so it is deterministic. After 160 steps the model has some of the *format*: a
#   record's `check` is followed by digits and ` -> `, and a sum by a short number and a line
#   break. It has none of the *content*: the id after `check` is not copied from the start of
#   the line, the difference is wrong, and an ordinary sentence falls into a loop of its
#   commonest words, the classic failure of greedy decoding from a weak model. The validation
#   loss printed above is still far from the text's structure. Lab 1 trains the same model for
#   two full epochs of the training text, after which it writes well-formed records and
#   sentences (still without copying the id), and finds a deeper model that starts to copy.
#
# ## Key takeaways
#
# - The training loop is a handful of lines: batch, forward and loss, backward, gradient
#   clipping, optimizer step, scheduler step. Everything a distributed run adds later wraps
#   these same lines.
# - An untrained byte-level model scores $\ln 256 \approx 5.55$; the first plateau, near the
#   entropy of the byte frequencies, comes before the model uses any context.
# - A checkpoint that resumes exactly holds the weights, the optimizer moments, the scheduler
#   position, the data sampler's position and the RNG states. On a CPU with a fixed thread count
#   the resumed losses then equal the unbroken run's bit for bit, which makes a resume bug
#   visible immediately.
# - Judge a model on held-out data, evaluated the same way every time; the training loss is
#   noisy and cannot show memorisation.
#
# ## Further reading
#
# - [Lab 1. Change the model](../../workshop/session-a/lab-1/): change the width, depth and heads
#   of this model, read the shape errors that follow, and look inside its checkpoints.
# - PyTorch, *Saving and loading a general checkpoint for inference and/or resuming training*
#   (the recipe whose pieces this trainer saves), and *Reproducibility* (what is and is not
#   deterministic, per device).
# - Andrej Karpathy, *nanoGPT* `train.py`: the same loop, checkpoint and resume logic in one file.
