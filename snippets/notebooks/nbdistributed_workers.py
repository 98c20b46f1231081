"""Waiting for nbdistributed's workers, from the notebook, before the first distributed cell.

    %dist_init -n 2
    from snippets.notebooks.nbdistributed_workers import wait_for_workers
    wait_for_workers()

`%dist_init` (nbdistributed 0.1.0) starts the workers and returns after a fixed two-second pause,
often before they have imported torch and connected to the notebook. The notebook talks to them
through a ZeroMQ ROUTER socket, which silently drops a message addressed to a worker that has not
connected yet: the first `%%distributed` cell then waits 30 s and prints a timeout instead of
running. Asking every worker for its status until all of them answer closes that gap.
"""

import time


# --8<-- [start:wait]
def wait_for_workers(timeout_s: float = 60.0) -> int:
    """Block until every worker started by %dist_init answers; return how many there are."""
    from IPython import get_ipython

    magic = get_ipython().magics_manager.registry["DistributedMagic"]
    if magic._comm_manager is None:
        raise RuntimeError("no nbdistributed workers: %dist_init failed or has not run (see its output)")
    deadline = time.monotonic() + timeout_s
    while True:
        try:  # a request to a worker that is not connected yet is dropped: ask again
            magic._comm_manager.send_to_all("get_status", {}, timeout=1.0)
            return magic._num_processes
        except TimeoutError:
            for rank, process in enumerate(magic._process_manager.processes):
                if process.poll() is not None:  # crashed while starting: show why
                    raise RuntimeError(f"worker {rank} exited with code {process.returncode}:\n"
                                       f"{process.stderr.read()}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers did not answer within {timeout_s:.0f} s") from None
# --8<-- [end:wait]
