"""The collectives playground (2 and 4 ranks) and the nbdistributed notebook, executed in a real
Jupyter kernel with two gloo workers."""

import pytest

from snippets.dist import spawn
from snippets.scratch import collectives_playground as playground
from tests.conftest import ROOT

NOTEBOOK = ROOT / "snippets" / "notebooks" / "nbdistributed_collectives.py"


def run_every_collective(rank, world):
    return {c.__name__: c(rank, world) for c in playground.COLLECTIVES}


@pytest.mark.parametrize("world", [2, 4])
def test_each_collective_moves_the_data_it_should(world):
    results = spawn(run_every_collective, world)
    start = [playground.starting_tensor(r, world) for r in range(world)]
    total = sum(start)
    for rank, result in enumerate(results):
        assert result["all_reduce"] == (start[rank].tolist(), total.tolist())
        assert result["broadcast"] == (start[rank].tolist(), start[0].tolist())
        assert result["all_gather"] == (start[rank].tolist(), [t.tolist() for t in start])
        assert result["reduce_scatter"] == (start[rank].tolist(), [total[rank].item()])
        assert result["all_to_all"] == (start[rank].tolist(), [t[rank].item() for t in start])


def cell_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


def test_the_notebook_runs_every_cell_on_two_workers_and_stops_them():
    import nbdistributed  # noqa: F401 - pinned in pyproject.toml's test extra: missing is a failure
    import jupytext
    import psutil
    from nbclient import NotebookClient

    notebook = jupytext.read(NOTEBOOK)
    # Per cell: %dist_init's own wait for the workers (60 s) must run out first, with its message
    client = NotebookClient(notebook, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}})
    workers = []
    with client.setup_kernel():
        kernel = psutil.Process(client.km.provisioner.process.pid)
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
            if "%dist_init" in cell.source:
                workers = [p for p in kernel.children(recursive=True)
                           if "nbdistributed/worker.py" in " ".join(p.cmdline())]
    # Shutting the kernel down interrupts its process group, workers included. Anything left is
    # one of the workers this test started: stop it by its id, and fail.
    _, alive = psutil.wait_procs(workers, timeout=15)
    for process in alive:
        process.kill()
    assert len(workers) == 2 and not alive, f"workers {workers}, still running: {alive}"

    everything = "\n".join(cell_text(cell) for cell in notebook.cells)
    # nbdistributed prints a worker's error (or a timeout) instead of raising it.
    assert "Error" not in everything and "❌" not in everything and "Timeout" not in everything
    hello, all_reduce, one_rank, all_gather = [
        cell_text(c) for c in notebook.cells if c.source.startswith(("%%distributed", "%%rank"))]
    assert "rank 0 of 2, backend gloo" in hello and "rank 1 of 2, backend gloo" in hello
    assert "all_reduce: [0, 1, 2, 3] -> [10, 12, 14, 16]" in all_reduce
    assert "all_reduce: [10, 11, 12, 13] -> [10, 12, 14, 16]" in all_reduce
    assert "Rank 0" in one_rank and "Rank 1" not in one_rank and "[10, 12, 14, 16]" in one_rank
    assert all_gather.count("all_gather: [[0, 100], [1, 101]]") == 2
