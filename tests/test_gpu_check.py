"""The GPU check (``benchmarks/gpu_check.sh``) runs on the CPU with ``--tiny`` within its time limit and prints its
results in markdown: the script the GPU machine runs is the script the suite runs."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT_S = 300  # about 10 s of CPU on one thread; the limit leaves room for a loaded machine

CHECKS_RUN = ["delayed copies, exact gradients", "no waits for a copy under the cap",
              "backward with and without prefetch", "in-place write after offload"]
CHECKS_SKIPPED = ["in-flight cap enforced", "pinned allocations flat over 5 back-to-back steps"]
ROWS = ["no remat", "save-nothing", "save-matmuls", "offload-to-cpu", "offload-to-cpu, prefetch=False",
        "save_on_cpu(pin_memory=True)", "torchtune-style offload"]
COLUMNS = ["configuration", "peak alloc MiB", "peak reserved MiB", "held MiB", "retries", "syncs", "D2H MiB",
           "H2D MiB", "fwd ms", "bwd ms", "step ms", "vs no remat", "copy exposed", "grads equal"]


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


NEEDS_SHELL = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                 reason="needs bash and timeout")


@NEEDS_SHELL
def test_gpu_check_tiny_runs_on_cpu(tmp_path: pathlib.Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable, GPU_CHECK_LOGDIR=str(tmp_path),
               OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--tiny"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=LIMIT_S)
    out = r.stdout
    assert r.returncode == 0, out[-6000:] + r.stderr[-3000:]
    assert "gpu_check.sh: all stages passed" in out
    for item in ["torch", "torch CUDA", "device", "optree", "remat", "mode"]:  # the environment table
        assert f"| {item} | " in out, item
    summary = out[out.index("## Summary"):]  # the end of the output repeats every result
    assert "**FAIL**" not in out
    for name in CHECKS_RUN:
        assert f"- **PASS** {name}" in summary, summary
    for name in CHECKS_SKIPPED:
        assert f"- SKIP {name}: needs CUDA" in summary, summary
    assert "gpu_check: 4 passed, 0 failed, 2 skipped" in summary
    assert "plain autograd gives RuntimeError" in summary and "WRONG" not in summary
    assert "leak check: PASS" in summary
    # the benchmark's table, in markdown: a header, a separator, one row per configuration
    table = [cells(line) for line in summary.splitlines() if line.startswith("|")]
    table = [row for row in table if len(row) == len(COLUMNS)]  # not the stages' table
    assert table[0] == COLUMNS and set(table[1][0]) <= set("-:")
    rows = {row[0]: row for row in table[2:]}
    assert list(rows) == ROWS, summary
    for name, row in rows.items():
        assert row[-1] == "True", (name, row)  # gradients bitwise equal to no remat's
    for name in ["offload-to-cpu", "offload-to-cpu, prefetch=False", "save_on_cpu(pin_memory=True)",
                 "torchtune-style offload"]:
        d2h, h2d = float(rows[name][6]), float(rows[name][7])
        assert d2h > 0 and h2d > 0, (name, rows[name])  # bytes moved, per step
    assert "copy bandwidth" in summary and "started ahead of need" in summary
    # the budgets' table (benchmarks/budget_gpu.py): both kinds of plan at both budgets, the compiled row,
    # every gradient equal to no remat's (bitwise in eager code)
    budget_rows = [cells(line) for line in summary.splitlines() if line.startswith("|")]
    budget_rows = [row for row in budget_rows if len(row) == 9 and row[0] != "budget" and set(row[1]) - set("-:")]
    kinds = [(row[0], row[1]) for row in budget_rows]
    assert kinds == [("-", "no remat"), ("10%", "keep/recompute"), ("10%", "keep/offload/recompute"),
                     ("25%", "keep/recompute"), ("25%", "keep/offload/recompute"),
                     ("-", "torch.compile, offload_to_cpu per block")], summary
    assert [row[6] for row in budget_rows[:-1]] == ["bitwise"] * 5 and budget_rows[-1][6] in ("bitwise", "close")
    assert {"checks.log", "bench.log", "budget.log"} <= {p.name for p in tmp_path.iterdir()}


@NEEDS_SHELL
def test_gpu_check_refuses_unknown_arguments() -> None:
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--fast"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage: bash benchmarks/gpu_check.sh [--tiny]" in r.stderr


def _load_benchmark() -> Any:
    spec = importlib.util.spec_from_file_location("offload_gpu", ROOT / "benchmarks" / "offload_gpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("offload_gpu", mod)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules["offload_gpu"])
    return sys.modules["offload_gpu"]


def test_ahead_of_need_counts_copies_started_by_the_fetch_of_another_tensor() -> None:
    """A fetch logs the copies back it starts, then one "use" of the tensor it reads: the copy started for
    that tensor was not ahead of need, the others were."""
    ahead_of_need = _load_benchmark().ahead_of_need
    trace = [("d2h", 0, 0), ("d2h", 0, 1), ("d2h", 1, 2),
             ("h2d", 1, 2), ("h2d", 0, 1), ("h2d", 0, 0), ("use", 1, 2),  # reading 2 starts its group and the next
             ("use", 0, 1), ("use", 0, 0)]
    assert ahead_of_need(trace) == (2, 3)
    on_demand = [("h2d", 0, 1), ("use", 0, 1), ("h2d", 0, 0), ("use", 0, 0), ("use", 0, 0)]
    assert ahead_of_need(on_demand) == (0, 2)
    assert ahead_of_need([("keep", 0, 0), ("use", 0, 0)]) == (0, 0)  # kept on the device: no copy back
