"""Lab 3: measured scaling of the simulated cluster, 1 -> 2 -> 4 processes.

    python -m snippets.cluster.scaling

Runs multi_node_train.py under the fake launcher three times, with the same per-process
batch (weak scaling: more processes, proportionally more tokens per step), and reads rank 0's
median step time. On a real cluster each process has its own GPU, and the ideal is a constant
step time, so tokens/s grows with the process count. Here all processes share this machine's
CPU cores, so once there are more processes than cores, adding one only adds waiting.
run() returns the numbers for `make bench`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = [(1, 1), (1, 2), (2, 2)]  # (nodes, processes per node): 1, 2, 4 processes
DONE = re.compile(r"done: world size (\d+), (\d+) tokens/step, median step (\d+) ms, ([\d,]+) tokens/s")


# --8<-- [start:measure]
def measure(nnodes: int, nproc_per_node: int, steps: int = 8) -> dict:
    """One launcher run; rank 0's median step time (first step excluded) and tokens/s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-m", "snippets.cluster.fake_multi_node_launcher",
             f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
             "snippets/cluster/multi_node_train.py", "--max-steps", str(steps),
             "--ckpt", os.path.join(tmp, "ckpt.pt")],
            cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
    world, tokens, step_ms, tokens_per_s = DONE.search(out).groups()
    return {"processes": int(world), "nodes": nnodes, "tokens_per_step": int(tokens),
            "step_ms": int(step_ms), "tokens_per_s": int(tokens_per_s.replace(",", ""))}
# --8<-- [end:measure]


def run(steps: int = 8) -> dict:
    rows = [measure(n, p, steps) for n, p in LAYOUTS]
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup"] = round(r["tokens_per_s"] / base, 2)
        r["efficiency"] = round(r["speedup"] / r["processes"], 2)  # 1.0 = perfect scaling
    return {"cpu_cores": os.cpu_count(), "rows": rows}


def main() -> None:
    result = run()
    print(f"{result['cpu_cores']} CPU cores; tiny GPT, 8 sequences x 64 tokens per process per step")
    print("processes  nodes  tokens/step  step ms  tokens/s  speed-up  efficiency")
    for r in result["rows"]:
        print(f"{r['processes']:9d}  {r['nodes']:5d}  {r['tokens_per_step']:11d}  "
              f"{r['step_ms']:7d}  {r['tokens_per_s']:8,d}  {r['speedup']:7.2f}x  "
              f"{r['efficiency']:10.2f}")


if __name__ == "__main__":
    main()
