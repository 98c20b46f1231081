"""Look inside a run's checkpoints: how the weights grew, and where the attention looks.

    python snippets/tools/inspect_checkpoints.py runs/lab1/base

For every checkpoint in RUN/checkpoints/ it prints the step, the validation loss logged at
that step (from RUN/metrics.jsonl, when there is one), the norm of each layer's attention and
MLP weights, and how far all the weights moved since the previous checkpoint; then the
attention of the newest checkpoint, and four yes/no statements about what the tables show. It
saves two pictures in RUN (or --out):

* weight_norms.png: those norms and that movement against the training step;
* attention.png: the attention probabilities of every head of every layer in the newest
  checkpoint, on a line of held-out text (query position down, key position across).

Checkpoints are read with the verified, weights-only loader the trainer uses.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from snippets.data.dataset import load_tokens, train_val_split
from snippets.data.tokenizer import ByteTokenizer
from snippets.models.gpt import GPT, GPTConfig, apply_rotary_pos_emb
from snippets.training.checkpoint import CheckpointError, CheckpointManager, load_checkpoint
from snippets.flags import Parser


# --8<-- [start:weight-norms]
def weight_groups(state_dict: dict) -> dict[str, list[str]]:
    """Parameter names grouped as the table shows them: the embedding, then each layer's
    attention (q, k, v, o) and MLP (gate, up, down). RMSNorm gains are left out: they start
    at 1 and barely move, and would only add a constant to every norm."""
    groups = {"embed": ["embed_tokens.weight"]}
    for name in state_dict:
        parts = name.split(".")  # layers.0.self_attn.q_proj.weight
        if parts[0] == "layers" and parts[2] in ("self_attn", "mlp"):
            kind = "attn" if parts[2] == "self_attn" else "mlp"
            groups.setdefault(f"L{parts[1]}.{kind}", []).append(name)
    return groups


def group_norms(state_dict: dict, groups: dict[str, list[str]]) -> dict[str, float]:
    """Frobenius norm of each group: the square root of the sum of its squared weights."""
    return {group: math.sqrt(sum(state_dict[n].float().pow(2).sum().item() for n in names))
            for group, names in groups.items()}


def relative_change(new: dict, old: dict) -> float:
    """||new - old|| / ||old|| over all parameters: how far one stretch of training moved them."""
    diff = sum((new[k].float() - old[k].float()).pow(2).sum().item() for k in old)
    size = sum(old[k].float().pow(2).sum().item() for k in old)
    return math.sqrt(diff / size)
# --8<-- [end:weight-norms]


# --8<-- [start:attention-maps]
@torch.no_grad()
def attention_maps(model: GPT, input_ids: torch.Tensor) -> torch.Tensor:
    """Attention probabilities (layers, heads, T, T) for one sequence input_ids (1, T).

    The model's fused attention (SDPA) never materialises the probabilities, so a hook
    records each attention layer's input during an ordinary forward pass, and the scores are
    recomputed from it with the layer's own projections and rotary embedding."""
    inputs = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
             for layer in model.layers]
    try:
        model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    maps = []
    for layer, x in zip(model.layers, inputs):
        attn = layer.self_attn
        B, T, _ = x.shape
        q = attn.q_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)  # (B, heads, T, hd)
        k = attn.k_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, attn.rope_cos[:T], attn.rope_sin[:T])
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(attn.head_dim)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        maps.append(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)[0])
    return torch.stack(maps)


def attention_summary(maps: torch.Tensor) -> list[dict]:
    """Per head: the mean distance back to the attended key, and the share of attention that
    goes to the query's own position and to the one just before it."""
    layers, heads, T, _ = maps.shape
    offset = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp(min=0).float()
    rows = []
    for layer in range(layers):
        for head in range(heads):
            p = maps[layer, head]
            rows.append({"layer": layer, "head": head,
                         "distance": (p * offset).sum(-1).mean().item(),
                         "self": p.diagonal().mean().item(),
                         "previous": p.diagonal(-1).sum().item() / (T - 1)})
    return rows
# --8<-- [end:attention-maps]


def held_out_line(run_dir: Path, length: int, startswith: str = "record") -> str:
    """A line of the run's validation text (one starting with `startswith` if there is one),
    cut to `length` bytes: text the model never trained on."""
    settings = {}
    if (run_dir / "run.json").is_file():
        settings = json.loads((run_dir / "run.json").read_text())["args"]
    tokenizer = ByteTokenizer()
    tokens = load_tokens(settings.get("data"), tokenizer)
    _, val = train_val_split(tokens, settings.get("val_fraction", 0.1))
    lines = tokenizer.decode(val.tolist()).split("\n")[1:-1]  # the first may start mid-line
    chosen = next((line for line in lines if line.startswith(startswith)), lines[0])
    return chosen[:length]


def val_losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    return {r["step"]: r["val_loss"] for r in records if r["kind"] == "eval"}


def inspect_run(run_dir: Path) -> dict:
    """Per-checkpoint rows (step, val loss, group norms, movement) and the newest model."""
    found = CheckpointManager(run_dir / "checkpoints").checkpoints()
    if not found:
        raise CheckpointError(f"no checkpoints in {run_dir / 'checkpoints'} (looked for "
                              "ckpt-*.pt); train with --ckpt-every N first")
    losses = val_losses(run_dir)
    rows, previous, groups = [], None, None
    for step, path in found:
        state = load_checkpoint(path)
        weights = state["model"]
        groups = groups or weight_groups(weights)
        rows.append({"step": step, "file": path.name, "bytes": path.stat().st_size,
                     "val_loss": losses.get(step),
                     "norms": group_norms(weights, groups),
                     "moved": relative_change(weights, previous) if previous else None})
        previous = weights
    config = GPTConfig(**state["config"])
    model = GPT(config)
    model.load_state_dict(state["model"])
    return {"rows": rows, "model": model.eval(), "config": config}


def trends(rows: list[dict], attention: list[dict]) -> dict[str, bool]:
    """What the two tables show, as yes/no statements about this one run. The tables' digits
    are this machine's (other CPU kernels add in another order, and a long run ends with other
    weights); the statements are about the shape of training, with thresholds far from where
    Lab 1's runs land, so they read the same whatever the digits."""
    embed = [r["norms"]["embed"] for r in rows]
    moved = [r["moved"] for r in rows if r["moved"] is not None]
    distance = {}  # layer -> mean distance over its heads
    for r in attention:
        distance.setdefault(r["layer"], []).append(r["distance"])
    distance = {layer: sum(d) / len(d) for layer, d in distance.items()}
    return {
        "the embedding's norm grew at every checkpoint":
            all(a < b for a, b in zip(embed, embed[1:])),
        "the weights moved less than a tenth as far in the last stretch as in the first":
            len(moved) >= 2 and moved[-1] < moved[0] / 10,
        "every layer-0 head puts over half its attention on its own or the previous byte":
            all(r["self"] + r["previous"] > 0.5 for r in attention if r["layer"] == 0),
        "every later layer looks further back than layer 0 (mean distance over its heads)":
            all(d > distance[0] for layer, d in distance.items() if layer > 0),
    }


def format_table(rows: list[dict]) -> str:
    groups = list(rows[0]["norms"])
    header = f"{'step':>5} {'val loss':>8} " + " ".join(f"{g:>8}" for g in groups)
    lines = [header + f" {'moved':>7}"]
    for r in rows:
        val = f"{r['val_loss']:8.3f}" if r["val_loss"] is not None else f"{'-':>8}"
        moved = f"{r['moved']:7.1%}" if r["moved"] is not None else f"{'-':>7}"
        norms = " ".join(f"{r['norms'][g]:8.2f}" for g in groups)
        lines.append(f"{r['step']:>5} {val} {norms} {moved}")
    return "\n".join(lines)


def plot_weight_norms(rows: list[dict], png_path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: leaves a notebook's backend alone
    from matplotlib.ticker import PercentFormatter

    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(11, 4))
    norms_ax, moved_ax = fig.subplots(1, 2)
    for i, group in enumerate(rows[0]["norms"]):
        style = "-" if group == "embed" or group.endswith("attn") else "--"
        norms_ax.plot(steps, [r["norms"][group] for r in rows], style, marker="o", ms=3,
                      color=f"C{i}", label=group)
    norms_ax.set(xlabel="step", ylabel="Frobenius norm", title="weight norm per group")
    norms_ax.legend(fontsize=8, ncol=2)
    moved = [(r["step"], r["moved"]) for r in rows if r["moved"] is not None]
    if moved:
        moved_ax.plot(*zip(*moved), "o-", color="C3")
    moved_ax.set(xlabel="step", ylabel="||W - W_prev|| / ||W_prev||",
                 title="how far the weights moved since the previous checkpoint")
    moved_ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    for ax in (norms_ax, moved_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


def plot_attention(maps: torch.Tensor, text: str, step: int, png_path: Path) -> None:
    from matplotlib.figure import Figure

    layers, heads, T, _ = maps.shape
    labels = [c if c != " " else "␣" for c in text[:T]]
    fig = Figure(figsize=(4.3 * heads, 4.6 * layers), layout="constrained")
    axes = fig.subplots(layers, heads, squeeze=False)
    for layer in range(layers):
        for head in range(heads):
            ax = axes[layer][head]
            ax.imshow(maps[layer, head].numpy(), cmap="viridis", vmin=0, vmax=1)
            ax.set_title(f"layer {layer}, head {head}", fontsize=11)
            ax.set_xticks(range(T), labels, fontsize=5.5, family="monospace")
            ax.set_yticks(range(T), labels, fontsize=5.5, family="monospace")
            ax.tick_params(length=0, pad=1)
    fig.suptitle(f"attention probabilities at step {step}: each row is a query position, "
                 f"each column a key position it may attend to\n{text!r}", fontsize=12)
    fig.savefig(png_path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run directory written by the trainer (--out)")
    p.add_argument("--out", type=Path, default=None,
                   help="where to save the two PNGs (default: the run directory)")
    p.add_argument("--text", default=None,
                   help="text for the attention map (default: a held-out line of the run's data)")
    args = p.parse_args(argv)
    out = args.out or args.run_dir
    try:
        result = inspect_run(args.run_dir)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows, model, config = result["rows"], result["model"], result["config"]
    print(f"{len(rows)} checkpoints in {args.run_dir / 'checkpoints'} "
          f"({rows[-1]['bytes'] / 1e6:.2f} MB each); weight norms per group:\n")
    print(format_table(rows))

    text = args.text or held_out_line(args.run_dir, config.max_position_embeddings)
    ids = torch.tensor([ByteTokenizer().encode(text)[: config.max_position_embeddings]])
    maps = attention_maps(model, ids)
    out.mkdir(parents=True, exist_ok=True)
    plot_weight_norms(rows, out / "weight_norms.png")
    plot_attention(maps, text, rows[-1]["step"], out / "attention.png")
    print(f"\nattention of step {rows[-1]['step']} on {text!r}:")
    print("layer head  mean distance  on itself  on previous")
    attention = attention_summary(maps)
    for r in attention:
        print(f"{r['layer']:>5} {r['head']:>4} {r['distance']:>14.1f} {r['self']:>10.0%} "
              f"{r['previous']:>12.0%}")
    print()
    for statement, holds in trends(rows, attention).items():
        print(f"{statement}: {holds}")
    print(f"wrote {out / 'weight_norms.png'}, {out / 'attention.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
