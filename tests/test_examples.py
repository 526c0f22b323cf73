"""Every script in examples/ runs to completion within its time limit and shows what it claims."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LIMIT_S = 120  # each example takes 5-20 s of CPU on one thread; the limit leaves room for a loaded machine


def run_example(name: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True,
                          timeout=LIMIT_S, env=env, cwd=EXAMPLES.parent)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m is not None, f"{pattern!r} not found in:\n{text[-3000:]}"
    return float(m.group(1))


def test_every_example_has_a_test() -> None:
    tested = {"cnn_training.py", "mlp_resume.py", "per_example_grads.py", "policies.py", "modules.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_cnn_training_example_learns_bitwise_and_keeps_less() -> None:
    out = run_example("cnn_training.py")
    assert "gradients with and without remat bitwise equal: True" in out
    first = number(r"mean loss of the first 20 steps ([\d.]+)", out)
    last = number(r"of the last 20 steps ([\d.]+)", out)
    assert last < 0.5 * first, out
    plain = number(r"without remat (\d+) KiB", out)
    rem = number(r"with remat (\d+) KiB", out)
    saved = number(r"saved (-?\d+) KiB", out)
    assert saved > 0 and rem < plain, out


def test_mlp_resume_example_resumes_bitwise_from_a_saved_step() -> None:
    out = run_example("mlp_resume.py")
    crash = number(r"interrupted after step (\d+)", out)
    start = number(r"resumed from the file saved at step (\d+)", out)
    assert 0 < start < crash, out  # the resumed run really restarted from an earlier saved state
    pairs = re.findall(r"uninterrupted ([\d.]+)\s+resumed ([\d.]+)", out)
    assert len(pairs) >= 5 and all(a == b for a, b in pairs), out
    assert "resumed losses bitwise equal to the uninterrupted run: True" in out


def test_mlp_resume_docstring_separates_the_two_checkpoints() -> None:
    doc = (EXAMPLES / "mlp_resume.py").read_text()
    assert "saves *memory* by\n  recomputing" in doc and "torch.save" in doc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is read from /proc")
def test_per_example_grads_example_is_bitwise_and_recomputes_each_block_once() -> None:
    out = run_example("per_example_grads.py")
    assert "bitwise equal with and without remat (vmap of grad, and of vjp): True" in out
    plain_calls = number(r"block calls: without remat (\d+)", out)
    rem_calls = number(r"block calls: without remat \d+, with remat (\d+)", out)
    assert rem_calls == plain_calls == 2, out  # the Python runs once (NOTE [program replay])
    plain_sm = number(r"softmax ops: without remat (\d+)", out)
    rem_sm = number(r"softmax ops: without remat \d+, with remat (\d+)", out)
    assert rem_sm == plain_sm + plain_calls, out  # every block's softmax replayed once in the backward pass
    plain = number(r"create_graph=False\s+without remat\s+([\d.]+)", out)
    rem = number(r"create_graph=False\s+without remat\s+[\d.]+, with remat\s+([\d.]+)", out)
    assert rem < plain, out


def test_policies_example_orders_memory_and_recompute_as_documented() -> None:
    out = run_example("policies.py")
    assert "every policy: loss and gradients bitwise equal to plain autograd" in out
    assert out.count("saved residuals of") == 11  # print_saved_residuals for every policy

    def row(name: str) -> tuple[float, int, int]:
        m = re.search(re.escape(name) + r"\s+([\d.]+)\s+(\d+)\s+(\d+)\s+True", out)
        assert m is not None, f"no row for {name}:\n{out[-3000:]}"
        return float(m.group(1)), int(m.group(2)), int(m.group(3))

    plain, nothing, everything, dots = (row(n) for n in ("plain autograd", "nothing_saveable",
                                                         "everything_saveable", "dots_saveable"))
    assert nothing[0] < dots[0] < plain[0]  # held memory
    assert nothing[1] == everything[1] == dots[1] == plain[1] == 2  # the blocks' Python ran once each
    assert everything[2] == plain[2] < nothing[2]  # the backward pass recomputed products / did not
    assert dots[2] == plain[2]  # dots_saveable recomputes no matrix product


def test_modules_example_keeps_state_and_gradients_bitwise() -> None:
    out = run_example("modules.py")
    assert "remat_modules changed ['conv1', 'fc2'] (state_dict keys unchanged: True)" in out
    assert "remat(self.conv1)(x): parameters and BatchNorm statistics bitwise equal to plain: True" in out
    assert "remat_modules: parameters and BatchNorm statistics bitwise equal to plain: True" in out
    assert "plain 5, remat 5, torch.utils.checkpoint 10" in out  # torch's checkpoint counts twice
    assert out.count("gradients bitwise equal: True") == 2
    assert "keep the remat'd forward: True, same outputs: True" in out
