"""Run test cases on several processes over gloo, started once per test module (no GPU).

``spawn(run_case, cases, out_dir)`` starts ``world`` processes with
``torch.multiprocessing.spawn``; each joins one process group and runs every
case in a group of its own (so that one failing case does not derail the
others), calling ``run_case(case, rank, group)``, which must be a module-level
function (the children import it by name). Each rank's results (``case.id`` ->
what ``run_case`` returned, or ``{"error": traceback}``) come back through a file.
The whole spawn has a time limit, so that a hang fails the tests instead of
blocking CI, and so has each collective.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 20  # one collective; a rank stuck in a failed case gives up and moves on


def _worker(rank: int, world: int, port: int, run_case: Callable[[Any, int, Any], Any], cases: list[Any],
            out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # (the processes share the machine's cores)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        results: dict[str, Any] = {}
        for case in cases:
            group = dist.new_group(backend="gloo", timeout=timeout)  # a failed case leaves the next one alone
            try:
                results[case.id] = run_case(case, rank, group)
            except Exception:
                results[case.id] = {"error": traceback.format_exc()}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(run_case: Callable[[Any, int, Any], Any], cases: list[Any], out_dir: Path, world: int = 2,
          timeout_s: float = 90) -> list[dict[str, Any]]:
    """Run ``cases`` on ``world`` processes; each rank's results, or an error if a rank failed or the time ran out."""
    ctx = mp.spawn(_worker, args=(world, free_port(), run_case, cases, str(out_dir)), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the distributed run did not finish in {timeout_s} s (a hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def result(runs: list[dict[str, Any]], case: Any, rank: int) -> dict[str, Any]:
    """One rank's results for ``case``; fails the test with every rank's traceback if any rank raised."""
    errors = [f"rank {r}:\n{run[case.id]['error']}" for r, run in enumerate(runs) if "error" in run[case.id]]
    if errors:
        pytest.fail(f"{case.id} raised\n" + "\n".join(errors))
    return runs[rank][case.id]
