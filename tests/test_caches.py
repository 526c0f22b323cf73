"""Who owns remat's caches (remat/_context.py, ``Caches``): what is learnt per function and the slots per module tree
live in one object per context, weakly keyed, so that they die with their function or module and a body can ask
for caches of its own; nothing else in the library keeps state at module level."""

from __future__ import annotations

import ast
import gc
import pathlib
import weakref

import torch
from torch import nn

from remat import remat
from remat._context import CACHES, own_caches

ROOT = pathlib.Path(__file__).resolve().parent.parent / "remat"


def _block(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x).sum()


def test_what_is_learnt_is_shared_by_every_remat_of_a_function_and_dies_with_it() -> None:
    """Every wrapper of a function shares its entry (whether it is a reentrant region), and neither keeps the
    function alive."""

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x).sum()

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    remat(block)(x).backward()
    learnt = CACHES.get().learnt[block]
    assert len(learnt) == 1  # one policy and static arguments
    g = remat(block)  # a new wrapper, as written inside a forward pass: the same entry
    assert g._learnt is next(iter(learnt.values()))
    gone = weakref.ref(block)
    del block, g, learnt
    gc.collect()
    # by identity (a function named "block" made by another test, a docs page's, may be alive and cached): the
    # cache did not keep the function alive, so its weakly keyed entry went with it
    assert gone() is None
    assert all(k is not None for k in CACHES.get().learnt.keys())


def test_own_caches_start_empty_and_leave_the_outer_ones_untouched() -> None:
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    remat(_block)(x).backward()
    outer = CACHES.get()
    assert _block in outer.learnt
    with own_caches() as mine:
        assert CACHES.get() is mine and _block not in mine.learnt
        f = remat(_block)
        assert not f._learnt  # learnt anew: what was learnt outside is not reused
        f(x).backward()
        assert _block in mine.learnt
        lin = nn.Linear(2, 2)
        remat(lin)(torch.randn(1, 2)).sum().backward()
        assert len(mine.slots) == 1
    assert CACHES.get() is outer and lin not in outer.slots


def test_no_module_level_mutable_state_outside_the_context_module() -> None:
    """Every module-level container of the library is a constant (frozenset, tuple) or lives in _context.py (the
    benchmark package's tables of configurations, read by its scripts, are not the library's state)."""
    mutable = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    makers = {"dict", "list", "set", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "defaultdict",
              "OrderedDict", "deque"}
    found = []
    for path in ROOT.rglob("*.py"):
        if path.name == "_context.py" or path.parent.name == "bench":
            continue
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if value is None or getattr(target, "id", None) == "__all__":
                continue
            call = value.func if isinstance(value, ast.Call) else None
            name = getattr(call, "attr", None) or getattr(call, "id", None)
            if isinstance(value, mutable) or name in makers:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
