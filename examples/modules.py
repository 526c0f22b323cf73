"""remat on nn.Modules: the patterns of torch.utils.checkpoint users, the module API, and torch.func.

A CNN with BatchNorm and an MLP head, written the way checkpointing code is usually
written (``checkpoint(self.conv1, x)`` inside ``forward``), here ``remat(self.conv1)(x)``;
then the same model with ``remat.remat_modules`` instead. Both are trained with plain
autograd and differentiated with ``torch.func.grad`` over a parameter dict through
``functional_call`` (parameters that are not the module's own), and compared with the
model without remat: gradients and BatchNorm statistics bit for bit. torch.utils.checkpoint
updates BatchNorm's running statistics twice (pytorch issue 96136); remat once.

    python examples/modules.py
"""

from __future__ import annotations

import copy
import io

import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.func import functional_call, grad

import remat


class CNN(nn.Module):
    """``mode``: "plain", "remat" (``remat(self.conv1)(x)``) or "torch" (``torch.utils.checkpoint``)."""

    def __init__(self, mode: str = "plain") -> None:
        super().__init__()
        self.mode = mode
        self.conv1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                   nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc1 = nn.Linear(16 * 16, 64)
        self.fc2 = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))

    def block(self, f: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "remat":
            return remat.remat(f)(x)  # was: checkpoint(self.conv1, x)
        if self.mode == "torch":
            return tuc.checkpoint(f, x, use_reentrant=False)
        return f(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.block(self.conv1, x)).flatten(1)
        return self.block(self.fc2, torch.relu(self.fc1(h)))


def make(mode: str) -> CNN:
    torch.manual_seed(0)
    return CNN(mode)


def train(model: nn.Module, steps: int = 5) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def func_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """torch.func.grad over parameters that differ from the module's own (e.g. a meta-learning inner step)."""
    params = {k: v.detach() + 0.01 for k, v in model.named_parameters()}
    x, y = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(2)), torch.arange(8)
    model.eval()  # running statistics are read, not written, under torch.func here
    try:
        return grad(lambda p: nn.functional.cross_entropy(functional_call(model, p, (x,)), y))(params)
    finally:
        model.train()


def main() -> None:
    plain = make("plain")
    seed_style = make("remat")
    module_api_model = make("plain")
    names = remat.remat_modules(module_api_model, lambda name, m: name in ("conv1", "fc2"),
                                policy="save-matmuls")
    print(f"remat_modules changed {names} (state_dict keys unchanged: "
          f"{list(module_api_model.state_dict()) == list(plain.state_dict())})")
    torch_ckpt = make("torch")

    losses = train(plain)
    train(seed_style)
    train(module_api_model)
    train(torch_ckpt)
    print(f"loss over 5 steps: {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"remat(self.conv1)(x): parameters and BatchNorm statistics bitwise equal to plain: {same(seed_style, plain)}")
    print(f"remat_modules: parameters and BatchNorm statistics bitwise equal to plain: {same(module_api_model, plain)}")
    print(f"BatchNorm batches counted after 5 steps: plain {plain.conv1[1].num_batches_tracked.item()}, "
          f"remat {seed_style.conv1[1].num_batches_tracked.item()}, "
          f"torch.utils.checkpoint {torch_ckpt.conv1[1].num_batches_tracked.item()}")

    want = func_grads(plain)
    for label, model in (("remat(self.conv1)(x)", seed_style), ("remat_modules", module_api_model)):
        got = func_grads(model)
        equal = all(torch.equal(got[k], want[k]) for k in want)
        print(f"torch.func.grad + functional_call, {label}: gradients bitwise equal: {equal}")

    copied = copy.deepcopy(module_api_model)
    buf = io.BytesIO()
    torch.save(module_api_model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(2, 3, 16, 16)
    outs = [m(x) for m in (module_api_model, copied, loaded)]
    print(f"deepcopy and torch.save/torch.load keep the remat'd forward: "
          f"{all(m.conv1.forward.__remat_target__.__self__ is m.conv1 for m in (copied, loaded))}, "
          f"same outputs: {all(torch.equal(o, outs[0]) for o in outs)}")


if __name__ == "__main__":
    main()
