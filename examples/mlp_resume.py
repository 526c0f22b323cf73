"""Resume training from a saved state, bit for bit, with ``remat`` in the model.

Two different things share the word "checkpoint":

* **remat** (``remat.checkpoint`` is another name for it, as in
  ``jax.checkpoint`` and ``torch.utils.checkpoint``) saves *memory* by
  recomputing: the wrapped layer's activations are not kept between the forward
  and the backward pass, and the backward pass runs the layer again to get them
  back. Nothing is written to disk, and the results are unchanged.
* **Saving a training checkpoint** (``torch.save`` of the parameters, the
  optimizer state and the step) lets an interrupted run *resume*. remat plays no
  part in that: it keeps no state between steps, so there is nothing of remat's
  to save or restore.

This script trains an MLP 1000-500-100-10, whose middle layer is wrapped in
``@remat``, with SGD (momentum, so the optimizer has state) on random data. It
writes a training checkpoint every ``SAVE_EVERY`` steps, is "interrupted" after
step ``CRASH_AT``, resumes from the last file in a fresh model and optimizer, and
shows that the resumed run's losses are bitwise equal to an uninterrupted run's.
The batch of each step is drawn from a generator seeded with the step number, so
the data stream resumes too.

Run: ``python examples/mlp_resume.py`` (a few seconds).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

from remat import remat

STEPS, SAVE_EVERY, CRASH_AT, BATCH = 60, 20, 47, 32


@remat
def middle(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The 500 -> 100 layer: its activations are recomputed in the backward pass, not stored."""
    return torch.relu(F.linear(h, weight, bias))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1000, 500)
        self.fc2 = nn.Linear(500, 100)
        self.fc3 = nn.Linear(100, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        h = middle(h, self.fc2.weight, self.fc2.bias)
        return self.fc3(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(BATCH, 1000, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def fresh() -> tuple[MLP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(model: MLP, opt: torch.optim.Optimizer, start: int, stop: int, path: str | None) -> list[float]:
    """Steps ``start`` .. ``stop - 1``; saves a training checkpoint to ``path`` every SAVE_EVERY steps."""
    losses = []
    for step in range(start, stop):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if path is not None and (step + 1) % SAVE_EVERY == 0:
            torch.save({"step": step + 1, "model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return losses


def resume_matches(steps: int = STEPS, crash_at: int = CRASH_AT) -> tuple[list[float], list[float], int]:
    """Losses of an uninterrupted run and of a run interrupted after ``crash_at`` steps and resumed.

    Returns (uninterrupted losses, losses of the interrupted run then the resumed
    one for the steps after the last save, the step the resumed run started from).
    """
    torch.set_num_threads(1)
    model, opt = fresh()
    reference = train(model, opt, 0, steps, path=None)

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "train_state.pt")
        model, opt = fresh()
        before = train(model, opt, 0, crash_at, path)  # ... and then the process dies
        del model, opt

        model, opt = fresh()  # a new process would start here
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        after = train(model, opt, start, steps, path)
    return reference, before[:start] + after, start


def main() -> None:
    reference, resumed, start = resume_matches()
    print(f"trained {STEPS} steps; interrupted after step {CRASH_AT}, resumed from the file saved at step {start}")
    for step in range(start - 2, STEPS, 4):
        print(f"step {step:3d}  uninterrupted {reference[step]:.10f}  resumed {resumed[step]:.10f}")
    same = reference == resumed
    print(f"resumed losses bitwise equal to the uninterrupted run: {same}")
    if not same:
        raise SystemExit("the resumed run diverged")


if __name__ == "__main__":
    main()
