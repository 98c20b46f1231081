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
# # Measured: a pipeline timeline
#
# **What you will learn:** what the GPipe and 1F1B schedules look like when they really run;
# where the bubble sits on the timeline and how big it is, measured, beside the formula
# $(p-1)/(m+p-1)$; and how many micro-batches' activations each stage holds at once under each
# schedule.
#
# The page was executed when the site was built: every plot and number below comes from that
# run, two CPU processes on one machine talking through PyTorch's `gloo` backend, so the exact
# values change from build to build. The code is the from-scratch pipeline of
# [Pipeline parallelism from scratch](../course/week-3/pipeline-from-scratch.md):
# `snippets/scratch/pipeline.py`.
#
# ## Run a small pipeline
#
# The small GPT of the course (4 transformer layers, hidden size 128) is cut into 2 stages of 2
# layers: stage 0 also holds the token embedding, stage 1 the final norm, the output head and
# the loss. Each process runs one stage with one thread, so the two stages have a core each.
# A global batch of 8 sequences of 64 tokens is cut into $m = 4$ micro-batches of 2 sequences.
# `train_pipeline` trains three steps with each schedule and returns, for every step, each
# stage's trace: the start and end of every forward (F) and backward (B) it ran, read from
# `time.perf_counter()`, a monotonic clock that all processes on one machine share.

# %%
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from snippets.dist import spawn
from snippets.scratch.pipeline_check import train_pipeline
from snippets.scratch.reference import single_process
from snippets.scratch.pipeline_trace import measured_bubble, theoretical_bubble

STAGES, MICRO_BATCHES, STEPS, BATCH, SEQ = 2, 4, 3, 8, 64
ranks = spawn(train_pipeline, STAGES, ["gpipe", "1f1b"], MICRO_BATCHES, STEPS, BATCH, SEQ,
              "small", 4, timeout_s=120)
_, reference_losses = single_process(STEPS, BATCH, SEQ, "small", 4)
print("one process, losses ", " ".join(f"{x:.4f}" for x in reference_losses))
for name in ["gpipe", "1f1b"]:
    print(f"{name:>5} pipeline losses", " ".join(f"{x:.4f}" for x in ranks[-1][name]["losses"]))

# %% [markdown]
# Both schedules train exactly the model that one process trains on the whole batch (the
# losses agree to the printed digits; `tests/test_pipeline.py` checks the weights). They
# differ only in *when* each stage does what. The last step's traces, drawn on one time axis:

# %%
COLORS = {"F": "#4c72b0", "B": "#dd8452"}


def draw(ax, traces, title):
    """One row per stage; a box per forward or backward, labelled with its micro-batch."""
    origin = min(e[2] for t in traces for e in t.events)
    for t in traces:
        for kind, micro_batch, start, end in t.events:
            x, width = (start - origin) * 1e3, (end - start) * 1e3
            ax.barh(t.stage_index, width, left=x, color=COLORS[kind], edgecolor="white")
            ax.text(x + width / 2, t.stage_index, f"{kind}{micro_batch}", ha="center",
                    va="center", color="white", fontsize=8)
    ax.set_yticks(range(len(traces)), [f"stage {t.stage_index}" for t in traces])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)


fig, axes = plt.subplots(2, 1, figsize=(10, 4), sharex=True)
for ax, name in zip(axes, ["gpipe", "1f1b"]):
    traces = [r[name]["traces"][-1] for r in ranks]
    bubble = sum(measured_bubble(traces)) / STAGES
    draw(ax, traces, f"{name.upper()}: p = {STAGES}, m = {MICRO_BATCHES}, "
                     f"measured bubble {bubble:.2f}")
axes[-1].set_xlabel("milliseconds since the first forward started")
fig.legend(handles=[Patch(color=c, label=k) for k, c in
                    [("forward", COLORS["F"]), ("backward", COLORS["B"])]],
           loc="upper right", fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# What to look for:
#
# - **The bubble is the white space.** Stage 1 has nothing to do until stage 0 has finished
#   F0, and stage 0 has nothing to do at the end while stage 1 works through the last
#   backward (and, in GPipe, while stage 1 runs the first backward). With 2 stages each stage
#   waits for about one forward and one backward per step, whatever $m$ is; the rest of the
#   step is work.
# - **The backward boxes are longer than the forward boxes**, about twice as long when the
#   machine is quiet (a busy one stretches some boxes at random): backward
#   computes gradients with respect to both the activations and the weights.
# - **GPipe runs F0 to F3, then B0 to B3** on each stage. **1F1B** on stage 1 runs each
#   micro-batch's backward right after its forward; stage 0 runs one forward ahead
#   ($p - s - 1 = 1$ warm-up forward), then alternates.
# - The stages are not exactly equal: stage 1 also computes the output head and the
#   cross-entropy over 256 byte values, stage 0 only an embedding lookup. The slower stage
#   sets the pace, and the faster one waits a little between its boxes: idle time the
#   formula, which assumes equal stages, does not count.
#
# ## The bubble, measured
#
# Per stage, bubble = idle time / step time, where the step runs from the first forward to
# start on any stage to the last backward to end. The formula assumes every forward takes
# the same time $t_f$ and every backward $t_b$ on every stage, and nothing else takes time:
# the step then lasts $(m + p - 1)(t_f + t_b)$, of which each stage is busy $m(t_f + t_b)$.

# %%
print(f"theory (p-1)/(m+p-1) = {theoretical_bubble(STAGES, MICRO_BATCHES):.3f}")
print(f"{'schedule':<9}{'step':>5}" + "".join(f"{'stage ' + str(s):>10}" for s in range(STAGES))
      + f"{'mean':>8}")
for name in ["gpipe", "1f1b"]:
    for step in range(STEPS):
        bubbles = measured_bubble([r[name]["traces"][step] for r in ranks])
        print(f"{name:<9}{step + 1:>5}" + "".join(f"{b:>10.3f}" for b in bubbles)
              + f"{sum(bubbles) / STAGES:>8.3f}")

# %% [markdown]
# Compare the mean column with the theory line. The formula is a lower bound for real
# stages: anything it leaves out adds idle time. Here that is unequal stages (above), the time
# a received message takes to wake the waiting process, and, on a shared build machine, other
# processes taking the cores, which stretches some boxes and delays some hand-offs; on a
# heavily loaded machine the measured bubble can be twice the formula's. The first step of
# each schedule also pays one-off costs (the first backward pass in a process allocates
# memory and imports code). The benchmark
# `python -m snippets.bench.pipeline_bubble` measures it for $p \in \{2, 4\}$ and
# $m \in \{2, 4, 8\}$ with stages of exactly equal cost; its results are on the
# [from-scratch page](../course/week-3/pipeline-from-scratch.md#the-bubble-measured).
#
# The formula says how to shrink the bubble: more micro-batches per step. With $p = 2$, going
# from $m = 4$ to $m = 8$ takes it from 0.2 to 0.11, and to 0.03 at $m = 32$. Each
# micro-batch then gets smaller, and a GPU runs small matrix products less efficiently, so in
# practice $m$ is a few times $p$.
#
# ## Memory: activations held at once
#
# A stage must keep each micro-batch's saved activations from its forward until its
# backward. Every trace also recorded the most micro-batches a stage held at once (their
# bytes, and the whole step's, are measured on the
# [from-scratch page](../course/week-3/pipeline-from-scratch.md#memory-measured)):

# %%
for name in ["gpipe", "1f1b"]:
    for r in ranks:
        t = r[name]["traces"][-1]
        print(f"{name:>5} stage {t.stage_index}: at most {t.peak_live} micro-batches")

# %% [markdown]
# GPipe holds all $m$ micro-batches on every stage: the backwards only start once every
# forward is done. 1F1B holds at most $p - s$ on stage $s$: at most $p$, however large $m$
# is. That is why 1F1B is the default: the same bubble, and activation memory that no longer
# grows with the number of micro-batches, so $m$ can be raised to shrink the bubble.
#
# ## Try it
#
# - Change `MICRO_BATCHES` to 8 and run the page again (`make serve` re-executes lessons):
#   the boxes get shorter, the white space shrinks relative to the step, and GPipe's peak
#   grows to 8 while 1F1B's stays at 2.
# - Change `STAGES` to 4 (the small GPT has 4 layers, one per stage). On a two-core laptop
#   four processes share two cores, so boxes stretch while other stages compute: the timeline
#   then shows the CPU's sharing as much as the schedule. The benchmark's stages of fixed
#   duration are the way around that.
