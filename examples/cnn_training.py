"""Train a small CNN whose first convolution block is wrapped in ``@remat``.

``remat`` trades compute for memory: the first block's activations (the largest
ones, at full resolution) are not kept between the forward and the backward pass;
the backward pass recomputes them from the block's input. The training itself is
unchanged: the loss and the gradients are the same as without ``remat`` (bitwise,
with deterministic kernels), and a step takes a little longer, not less.

The data are synthetic 3x8x8 images in 10 classes (no downloads): each class has a
fixed random pattern, and an image is its class pattern plus noise, so the network
can learn the rule and the loss falls.

The memory saved is measured from outside remat: a ``TorchDispatchMode``
(``remat.bench.measure.LiveCensus``) records every storage the forward pass
allocates, and after the forward pass we add up the bytes of those still alive (the activations held for the backward pass), once
with the block under ``remat`` and once without.

Run: ``python examples/cnn_training.py`` (about 10 s on one CPU thread).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from remat import remat
from remat.bench.measure import live_bytes_after

CLASSES, BATCH, STEPS = 10, 64, 300


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1, stride=2)
        self.head = nn.Linear(64, CLASSES)

    @remat
    def block1(self, x: torch.Tensor) -> torch.Tensor:
        """The first block, at full 8x8 resolution: its activations are recomputed, not stored."""
        return F.relu(self.conv2(F.relu(self.conv1(x))))

    def forward(self, x: torch.Tensor, use_remat: bool = True) -> torch.Tensor:
        # block1.__wrapped__ is the same function without remat (for the comparison below)
        h = self.block1(x) if use_remat else Net.block1.__wrapped__(self, x)
        h = F.relu(self.conv3(h))
        return self.head(h.mean(dim=(2, 3)))


def make_data(gen: torch.Generator) -> Any:
    """A batch of synthetic images: the class's fixed pattern plus noise."""
    patterns = torch.randn(CLASSES, 3, 8, 8, generator=torch.Generator().manual_seed(1234))

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
        x = patterns[y] + 1.5 * torch.randn(BATCH, 3, 8, 8, generator=gen)
        return x, y

    return batch


def held_after_forward(model: Net, x: torch.Tensor, y: torch.Tensor, use_remat: bool) -> int:
    """Bytes of activations the forward pass leaves alive for the backward pass."""
    loss, held = live_bytes_after(lambda: F.cross_entropy(model(x, use_remat), y))
    loss.backward()  # frees them
    model.zero_grad()
    return held


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    batch = make_data(torch.Generator().manual_seed(0))

    # remat changes no result: one step's gradients with and without it are bitwise equal
    x, y = batch()
    grads = {}
    for use in (False, True):
        model.zero_grad()
        F.cross_entropy(model(x, use), y).backward()
        grads[use] = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    equal = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    print(f"gradients with and without remat bitwise equal: {equal}")

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        x, y = batch()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == STEPS - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    print(f"mean loss of the first 20 steps {first:.4f}, of the last 20 steps {last:.4f}")

    x, y = batch()
    plain = held_after_forward(model, x, y, use_remat=False)
    rem = held_after_forward(model, x, y, use_remat=True)
    print(f"activations held between forward and backward (batch {BATCH}): "
          f"without remat {plain / 1024:.0f} KiB, with remat {rem / 1024:.0f} KiB, "
          f"saved {(plain - rem) / 1024:.0f} KiB")
    if not equal:
        raise SystemExit("gradients with and without remat differ")


if __name__ == "__main__":
    main()
