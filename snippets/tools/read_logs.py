"""Read back one run's three logs and show that they hold the same numbers.

    python snippets/tools/read_logs.py runs/local/train-bpe

A run of ``train_tiny_transformer.py`` with ``--tensorboard --wandb`` writes the same records
three times, under its ``--out`` folder:

* ``metrics.jsonl``: one JSON object per line, the trainer's own log;
* ``tensorboard/events.out.tfevents.*``: TensorBoard's event files, read here with
  TensorBoard's own ``EventAccumulator`` (what ``tensorboard --logdir`` reads);
* ``wandb/offline-run-*/run-*.wandb``: W&B's offline run file, which ``wandb sync`` uploads
  later. It is a LevelDB-format log (https://github.com/google/leveldb/blob/main/doc/log_format.md)
  of protobuf ``Record`` messages, after a 7-byte header (``:W&B``, a 2-byte magic, a version
  byte). wandb 0.31.0 ships the message types (``wandb.proto.wandb_internal_pb2``) but no Python
  reader any more (its Go ``wandb-core`` writes the file), so ``wandb_history`` below is a small
  one; it does not check the records' CRC32C checksums.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

BLOCK = 32_768  # LevelDB log: records never straddle a 32 KiB block without being split
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def metrics_records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# --8<-- [start:tensorboard]
def tensorboard_scalars(run: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from the run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()  # reads every events.out.tfevents.* file in the folder
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]}
# --8<-- [end:tensorboard]


# --8<-- [start:wandb]
def wandb_history(run_file: Path) -> list[dict]:
    """The rows ``wandb.log`` wrote to an offline run file, as {key: value} dicts."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = run_file.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a W&B run file")
    payloads, partial, pos = [], b"", 7  # after the header
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # too little room left for a record header: padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == FULL:
            payloads.append(chunk)
        elif kind in (FIRST, MIDDLE):  # a record longer than a block arrives in pieces
            partial = (b"" if kind == FIRST else partial) + chunk
        elif kind == LAST:
            payloads.append(partial + chunk)
    rows = []
    for payload in payloads:
        record = Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
# --8<-- [end:wandb]


def main(argv: list[str] | None = None) -> int:
    from snippets.flags import Parser

    p = Parser(description="Compare a run's metrics.jsonl, TensorBoard and W&B logs.")
    p.add_argument("run", help="the trainer's --out folder")
    run = Path(p.parse_args(argv).run)
    if not (run / "metrics.jsonl").is_file():
        p.error(f"{run}/metrics.jsonl not found: give the --out folder of a finished run")
    records = metrics_records(run)
    scalars = tensorboard_scalars(run)
    run_files = sorted((run / "wandb" / "latest-run").glob("run-*.wandb"))
    if not run_files:
        print(f"error: no W&B run in {run / 'wandb' / 'latest-run'} (train with --wandb)",
              file=sys.stderr)
        return 2
    history = {row["_step"]: row for row in wandb_history(run_files[0])}
    # The wandb folder name holds a time and a random id: show the pattern, not the name.
    print(f"{run}/metrics.jsonl: {len(records)} records")
    print(f"{run}/tensorboard/events.out.tfevents.*: "
          + ", ".join(f"{tag} ({len(v)})" for tag, v in sorted(scalars.items())))
    print(f"{run}/wandb/latest-run/run-*.wandb: {len(history)} history rows")
    print(f"{'kind':5} {'step':>4} {'metrics.jsonl':>13} {'tensorboard':>11} {'wandb':>8}")
    mismatches = 0
    for r in records:
        key = "loss" if r["kind"] == "train" else "val_loss"
        tag = f"{r['kind']}/{key}"
        tb, wb = scalars[tag][r["step"]], history[r["step"]][tag]
        # TensorBoard stores float32; W&B and the JSON lines keep the float64.
        mismatches += abs(tb - r[key]) > 1e-6 * abs(r[key]) or wb != r[key]
        if r["kind"] == "eval" or r["step"] in (1, len(history)) or r["step"] % 10 == 0:
            print(f"{r['kind']:5} {r['step']:>4} {r[key]:>13.4f} {tb:>11.4f} {wb:>8.4f}")
    print("the three logs agree at every step" if not mismatches
          else f"{mismatches} values differ between the logs")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
