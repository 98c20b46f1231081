"""Lab 1's tools: the config sweep, the checkpoint inspector, and the shape-error demonstrations."""

import json
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch

from snippets.data.dataset import load_tokens, train_val_split
from snippets.data.tokenizer import ByteTokenizer
from snippets.labs import lab1_sweep
from snippets.models.gpt import GPT, ConfigError, get_config
from snippets.scripts.train_tiny_transformer import DEFAULT_CONFIG, main, parse_args, train
from snippets.tools import inspect_checkpoints as inspect

REPO = Path(__file__).resolve().parents[1]
LAB1 = REPO / "snippets" / "models" / "lab1"
PNG = b"\x89PNG\r\n\x1a\n"
FAST = ["--config", str(DEFAULT_CONFIG), "--batch-size", "4", "--context-length", "16",
        "--device", "cpu", "--eval-batches", "2", "--sample-tokens", "5", "--threads", "1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """15 steps of the tiny model, a checkpoint and an evaluation every 5."""
    out = tmp_path_factory.mktemp("lab1") / "run"
    train(parse_args(FAST + ["--epochs", "1", "--steps-per-epoch", "15", "--ckpt-every", "5",
                             "--eval-every", "5", "--keep-last", "5", "--out", str(out)]))
    return out


def test_lab1_configs_change_one_field_each():
    base = get_config(DEFAULT_CONFIG).to_dict()
    expected = {"hidden-128": "hidden_size 64->128", "ffn-344": "intermediate_size 172->344",
                "heads-8": "num_attention_heads 4->8", "layers-4": "num_hidden_layers 2->4"}
    assert [p.stem for p in lab1_sweep.DEFAULT_VARIANTS[1:]] == list(expected)
    for name, change in expected.items():
        variant = get_config(LAB1 / f"{name}.json").to_dict()
        assert lab1_sweep.config_changes(base, variant) == change
    assert lab1_sweep.config_changes(base, base) == "(baseline)"
    with pytest.raises(ConfigError, match="not divisible by num_attention_heads=6"):
        get_config(LAB1 / "bad-heads-6.json")


def test_sweep_trains_each_config_the_same_way(tmp_path):
    configs = [DEFAULT_CONFIG, LAB1 / "layers-4.json"]
    rows = lab1_sweep.sweep(configs, tmp_path, steps=12, batch_size=4, context_length=16,
                            progress=lambda _: None)
    assert [r["name"] for r in rows] == ["base", "layers-4"]
    assert [r["params"] for r in rows] == [115_520, 214_592]
    for r in rows:
        assert len(r["curve"]) == 12
        assert [s for s, _ in r["val_curve"]] == [3, 6, 9, 12]  # every steps // 4
        assert r["val_loss"] == r["val_curve"][-1][1]
        assert r["train_loss"] < math.log(256)  # it learned something in 12 steps
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0
        assert "device cpu" in (tmp_path / r["name"] / "train.log").read_text()
    # Same seed and data: the first step's loss depends only on the model's initialisation,
    # and both start at the uniform guess.
    assert rows[0]["curve"][0][1] == pytest.approx(math.log(256), abs=0.1)
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == PNG
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["name"] for s in summary] == ["base", "layers-4"]
    table = lab1_sweep.format_table(rows)
    assert "(baseline)" in table and "num_hidden_layers 2->4" in table and "214,592" in table


def test_sweep_checks_every_config_before_training(tmp_path, capsys):
    assert lab1_sweep.main([str(DEFAULT_CONFIG), str(LAB1 / "bad-heads-6.json"),
                            "--out", str(tmp_path / "sweep")]) == 2
    assert "not divisible by num_attention_heads=6" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()  # the baseline was not trained first


def test_sweep_refuses_a_folder_that_holds_anything_and_leaves_it_as_it_was(tmp_path, capsys):
    out = tmp_path / "sweep"
    (out / "base").mkdir(parents=True)
    (out / "base" / "run.json").write_text("{}")  # say, the learner's own run of the trainer
    for _ in range(2):  # refused twice: the first refusal leaves nothing that would pass the second
        assert lab1_sweep.main(["--out", str(out), "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err == (f"error: an earlier run left base in {out}: pass another --out to keep "
                       "it, or --overwrite to replace it\n")
        assert [p.relative_to(out).as_posix() for p in sorted(out.rglob("*"))] == [
            "base", "base/run.json"]


def test_moving_average():
    assert lab1_sweep.moving_average([1, 2, 3, 4, 5], 2) == [1, 1.5, 2.5, 3.5, 4.5]


def test_inspect_reads_every_checkpoint(run_dir):
    result = inspect.inspect_run(run_dir)
    rows = result["rows"]
    assert [r["step"] for r in rows] == [5, 10, 15]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_loss"] for r in rows] == [r["val_loss"] for r in logged if r["kind"] == "eval"]
    assert list(rows[0]["norms"]) == ["embed", "L0.attn", "L0.mlp", "L1.attn", "L1.mlp"]
    assert rows[0]["moved"] is None and all(r["moved"] > 0 for r in rows[1:])

    # The group norm is the norm of the concatenated weights.
    state = torch.load(run_dir / "checkpoints" / "ckpt-00000015.pt", weights_only=True)["model"]
    mlp = torch.cat([state[f"layers.1.mlp.{m}.weight"].flatten()
                     for m in ("gate_proj", "up_proj", "down_proj")])
    assert rows[-1]["norms"]["L1.mlp"] == pytest.approx(mlp.norm().item(), rel=1e-6)
    # The newest checkpoint's model is returned, loaded.
    assert torch.equal(result["model"].embed_tokens.weight, state["embed_tokens.weight"])


def test_relative_change():
    old = {"w": torch.tensor([3.0, 4.0])}
    assert inspect.relative_change({"w": torch.tensor([3.0, 4.0])}, old) == 0.0
    assert inspect.relative_change({"w": torch.tensor([3.0, 9.0])}, old) == pytest.approx(1.0)


def test_attention_maps_are_the_probabilities_the_model_uses():
    torch.manual_seed(0)
    model = GPT(get_config("tiny")).eval()
    ids = torch.randint(0, 256, (1, 20))
    inputs = []
    hooks = [layer.self_attn.register_forward_hook(
        lambda module, args, out: inputs.append((args[0], out))) for layer in model.layers]
    maps = inspect.attention_maps(model, ids)
    for hook in hooks:
        hook.remove()
    assert maps.shape == (2, 4, 20, 20)
    torch.testing.assert_close(maps.sum(-1), torch.ones(2, 4, 20))  # each query's row sums to 1
    assert (maps.triu(1) == 0).all()  # causal: no attention to later positions
    # Probabilities @ values, heads merged, output projection: the fused SDPA layer's output.
    for i, (layer, (x, out)) in enumerate(zip(model.layers, inputs)):
        attn = layer.self_attn
        v = attn.v_proj(x).view(1, 20, -1, attn.head_dim).transpose(1, 2)
        y = (maps[i] @ v[0]).transpose(0, 1).reshape(1, 20, -1)
        torch.testing.assert_close(attn.o_proj(y), out, atol=1e-5, rtol=1e-5)
    summary = inspect.attention_summary(maps)
    assert len(summary) == 8 and all(0 <= r["self"] <= 1 for r in summary)


def test_trends_say_what_the_tables_show():
    # Norms that grow, moves that shrink tenfold, a layer 0 that looks at the last two bytes
    # and a layer 1 that looks further back: Lab 1's run in miniature, every statement True.
    rows = [{"norms": {"embed": e}, "moved": m} for e, m in [(1.0, None), (2.0, 0.5), (3.0, 0.04)]]
    attention = [{"layer": 0, "head": 0, "distance": 1.0, "self": 0.4, "previous": 0.2},
                 {"layer": 0, "head": 1, "distance": 1.5, "self": 0.3, "previous": 0.3},
                 {"layer": 1, "head": 0, "distance": 3.0, "self": 0.1, "previous": 0.1}]
    assert list(inspect.trends(rows, attention).values()) == [True] * 4

    # Each statement turns False when its table says otherwise, at the threshold itself too.
    def statements(rows=rows, attention=attention):
        return list(inspect.trends(rows, attention).values())
    dipped = [dict(r, norms={"embed": e}) for r, e in zip(rows, [1.0, 3.0, 2.0])]
    assert statements(rows=dipped) == [False, True, True, True]
    tenth = [dict(r, moved=m) for r, m in zip(rows, [None, 0.5, 0.05])]
    assert statements(rows=tenth) == [True, False, True, True]
    assert statements(rows=rows[:2]) == [True, False, True, True]  # one move: nothing to compare
    assert statements(rows=rows[:1]) == [True, False, True, True]  # one checkpoint, no move
    half = [dict(attention[0], previous=0.1)] + attention[1:]
    assert statements(attention=half) == [True, True, False, True]
    near = attention[:2] + [dict(attention[2], distance=1.25)]  # layer 0's mean distance
    assert statements(attention=near) == [True, True, True, False]


def test_held_out_line_is_validation_text(run_dir):
    line = inspect.held_out_line(run_dir, 64)
    assert line.startswith("record") and len(line) <= 64
    tokenizer = ByteTokenizer()
    train_part, val_part = train_val_split(load_tokens(None, tokenizer), 0.1)
    assert line in tokenizer.decode(val_part.tolist())
    assert line not in tokenizer.decode(train_part.tolist())


def test_inspect_command_writes_both_pictures(run_dir, tmp_path, capsys):
    # A short --text keeps the attention figure (one tick label per byte) quick to draw.
    assert inspect.main([str(run_dir), "--out", str(tmp_path), "--text", "name=ana"]) == 0
    out = capsys.readouterr().out
    assert "3 checkpoints in" in out and "L1.mlp" in out and "mean distance" in out
    assert "attention of step 15 on 'name=ana'" in out
    assert "the embedding's norm grew at every checkpoint: " in out  # the first of the trends
    for name in ("weight_norms.png", "attention.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG


def test_inspect_without_checkpoints_is_a_clear_error(tmp_path, capsys):
    assert inspect.main([str(tmp_path)]) == 2
    assert "no checkpoints in" in capsys.readouterr().err


def test_resume_with_another_config_names_the_changed_field(run_dir, capsys):
    assert main(FAST[2:] + ["--config", str(LAB1 / "heads-8.json"), "--resume",
                            "--out", str(run_dir)]) == 2
    assert "(checkpoint -> --config: num_attention_heads 4 -> 8)" in capsys.readouterr().err


def run_script(path: str, *args, capsys, monkeypatch) -> str:
    """Run a demonstration script as `python path args` would, in this process (no second
    interpreter start-up), and return what it printed."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [path, *args])
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(REPO / path), run_name="__main__")
    finally:
        torch.set_num_threads(threads)  # a script may set it; leave the next test as it was
    return capsys.readouterr().out


def test_checkpoint_mismatch_shows_each_outcome(run_dir, capsys, monkeypatch):
    out = run_script("snippets/debugging/checkpoint_mismatch.py", str(run_dir),
                     capsys=capsys, monkeypatch=monkeypatch)
    assert "size mismatch for layers.0.mlp.gate_proj.weight: copying a param with shape" in out
    assert 'Missing key(s) in state_dict: "layers.2.input_layernorm.weight"' in out
    assert "heads-8.json: loaded without an error" in out


def test_shape_error_scripts(capsys, monkeypatch):
    out = run_script("snippets/debugging/config_error.py", capsys=capsys, monkeypatch=monkeypatch)
    assert "hidden_size=64 is not divisible by num_attention_heads=6" in out
    out = run_script("snippets/debugging/attention_view_error.py", capsys=capsys,
                     monkeypatch=monkeypatch)
    assert "is invalid for input of size 1024" in out
    assert "view size is not compatible" in out
    assert "equal to the right merge: False" in out


def test_rerunning_step_1_with_another_config_keeps_the_earlier_run(tmp_path, capsys):
    # Lab 1's challenge: set num_hidden_layers to 4 and rerun step 1's command, --overwrite
    # included. The 2-layer run, and the pictures the inspection script drew of it, stay.
    out = tmp_path / "base"
    step_1 = FAST[2:] + ["--epochs", "1", "--steps-per-epoch", "4", "--ckpt-every", "2",
                         "--eval-every", "0", "--out", str(out), "--overwrite"]
    assert main(["--config", str(DEFAULT_CONFIG)] + step_1) == 0
    for picture in ("attention.png", "weight_norms.png"):
        (out / picture).write_bytes(PNG)  # as inspect_checkpoints.py leaves them
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["--config", str(LAB1 / "layers-4.json")] + step_1) == 2
    assert capsys.readouterr().err == (
        f"error: {out} holds a run of another model config (that run -> --config: "
        "num_hidden_layers 2 -> 4); --resume and --overwrite accept only that run's config: "
        f"give this one its own --out, e.g. --out {tmp_path / 'num_hidden_layers-4'}\n")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    # The same config's run is replaced; the pictures are kept, and said to be the old run's.
    assert main(["--config", str(DEFAULT_CONFIG)] + step_1 + ["--seed", "1"]) == 0
    printed = capsys.readouterr().out
    assert ("--overwrite: kept attention.png, weight_norms.png, which this script did not "
            "write: they show the run it replaced, not this one\n") in printed
    assert all((out / p).read_bytes() == PNG for p in ("attention.png", "weight_norms.png"))
    assert (out / "checkpoints" / "ckpt-00000004.pt").read_bytes() != (
        before[out / "checkpoints" / "ckpt-00000004.pt"])
