"""State-mutation fuzzer (issue 38): Python state changed between a call's forward and backward pass.

Each program is a seeded little model whose forward pass reads Python state besides its inputs: a number on the
module, a module-level global, a closure cell, a default argument, which expert of a ModuleList or ModuleDict runs,
the order of a list of experts, Python's and NumPy's random numbers, a dict in a closure, a buffer replaced by a
same-shaped one, an op's list argument (``roll``'s shifts), torch's RNG seeded inside the forward pass from a counter
it bumps (then dropout), a factory that follows the default dtype, a global tensor (written in place between the
passes), ``torch.tensor`` of a number on the module (issue 46), a mask of denormal values. Its first call is clean;
every later call mutates some of that state before its forward pass and some between its forward and its backward
pass (there also the default dtype, matmul precision and ``torch.set_flush_denormal``), and some calls run two forward passes, with mutations between them, before one
backward pass over both. The wrappings: a function, a bound method, ``remat_module``, ``debug=True`` (the re-run
engine), ``torch.func.vjp``, ``grad``, ``jacrev`` and ``vmap(grad)`` over ``functional_call`` (the mutations between
the passes inside the transformed function), and two nested calls inside an outer remat'd one. Any call may run with a user's dispatch mode (``CommDebugMode``, a
counting mode, a module tracker reading ``param.data`` under it as ``CommDebugMode``'s does) or global module hooks
around its forward pass, its backward pass or both (issue 39; ``CommDebugMode`` itself fails on these programs without
remat: its tracker needs the outermost module called as a module and breaks on later uses). The outcome of each call is plain autograd's gradient (float64,
1e-10; plain autograd differentiates what its forward pass computed) or a ``RematError``; anything else is a
*silent mismatch*, the one outcome remat never allows (NOTE [same reads] in ``remat/_engine/wiring.py``).

Run: ``python benchmarks/fuzz.py --programs 500 --calls 7`` (240,000 calls; ``--seed`` splits a run across processes) prints, per policy and wrapping, the number of calls,
how many matched, raised, and mismatched silently. ``tests/test_python_state.py::test_state_fuzzer_slice`` runs a
slice.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
import warnings
from collections import Counter
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import RematError, policies

D = torch.float64
TOL = 1e-10
GLOBAL = {"scale": 1.0}  # read through a module-level global (rebound, not mutated: see _set_global)
_GLOBAL_SCALE = 1.0

STEPS = ["attr", "global", "cell", "default", "expert", "moddict", "order", "random", "nprandom", "cfg", "buffer",
         "roll", "tanh", "sin", "lin", "seed", "factory", "gtensor", "pydata", "denormal", "outmax", "cache"]
MUTATIONS = ["attr", "global", "cell", "default", "expert", "moddict", "order", "cfg", "buffer", "roll", "gtensor",
             "pydata"]
# between the passes only (undone before plain autograd runs): global settings, which a replay must not follow
BETWEEN_ONLY = ["settings"]
G_TENSOR = torch.full((8,), 0.25, dtype=D)
CACHE = torch.zeros(2, 8, dtype=D)  # a global key/value cache: a slot is written in place in the forward pass
GAINS = [torch.rand(8, dtype=D, generator=torch.Generator().manual_seed(i)) + 0.5 for i in range(8)]  # a global tensor an op reads (add: saved by no node), written in place

POLICIES: dict[str, Any] = {
    "save-nothing": policies.nothing_saveable,
    "save-matmuls": policies.dots_saveable,
    "names": policies.save_only_these_names("h"),
    "all-but-names": policies.save_anything_except_these_names("h"),  # (a name drops a value the policy keeps)
    "offload": policies.offload_dot_with_no_batch_dims("cpu", "cpu"),
    "budget": policies.memory_budget(0.5),
    "custom": lambda op, *a, **k: str(op).startswith("aten.mm"),
}
WRAPS = ["function", "method", "module", "debug", "subclass", "vjp", "grad", "jacrev", "vmap(grad)", "nested"]
FUNC_WRAPS = ("vjp", "grad", "jacrev", "vmap(grad)")  # torch.func transforms over functional_call
# what runs around a call besides it (issue 39): a user's dispatch mode, or module hooks, around its forward pass
# only, its backward pass only, or both (CommDebugMode's module hooks detach parameters in the forward pass only;
# global full backward hooks wrap module inputs and outputs in views under grad mode): NOTE [hooks' aliases]
AMBIENTS_OFF = 0
AMBIENTS = ["none"] if AMBIENTS_OFF else ["none", "none", "tracker-forward", "tracker-both", "hooks-forward", "hooks-both", "count-backward"]


class _Counting(TorchDispatchMode):
    """A profiler's dispatch mode: counts ops, and runs one of its own per op."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            out.detach().abs().sum()
        return out


class _Tracker:
    """What CommDebugMode's module tracker does, without its own fragility: a dispatch mode, and a global forward
    pre-hook that reads every parameter's ``.data`` (a ``detach`` under the mode) while it is installed."""

    def __enter__(self) -> None:
        self.mode = _Counting()
        self.mode.__enter__()
        self.handle = nn.modules.module.register_module_forward_pre_hook(_read_data)

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()
        self.mode.__exit__(*exc)


def _read_data(module: nn.Module, args: Any) -> None:
    for p in module.parameters(recurse=False):
        p.data  # noqa: B018 (read for its detach, as a tracker records it)


def _ambient(name: str) -> Any:
    if name.startswith("tracker"):
        return _Tracker()
    if name.startswith("hooks"):
        return _BackwardHooks()
    if name.startswith("count"):
        return _Counting()
    return contextlib.nullcontext()


class _BackwardHooks:
    def __enter__(self) -> None:
        self.handle = nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None)

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


def _read_global() -> float:
    return _GLOBAL_SCALE


def _set_global(v: float) -> None:
    global _GLOBAL_SCALE
    _GLOBAL_SCALE = v


class Program(nn.Module):
    """A seeded program: a list of steps over one (4, 8) activation, each reading one kind of state."""

    def __init__(self, seed: int, n_steps: int = 6, seeded: bool = True) -> None:
        super().__init__()
        rng = random.Random(seed)
        torch.manual_seed(seed)
        # (a draw from Python's or NumPy's random numbers in the forward pass: one program in five has them; a seed
        # set inside, ``seeded``: not under vmap, which refuses it with or without remat)
        menu = STEPS if seed % 5 == 0 else [s for s in STEPS if s not in ("random", "nprandom")]
        if not seeded:  # (under vmap: no seed set inside, and no out= op, which vmap cannot batch)
            menu = [s for s in menu if s not in ("seed", "outmax", "cache")]
        self.steps = [rng.choice(menu) for _ in range(n_steps)]
        self.lin = nn.Linear(8, 8).to(D)
        self.experts = nn.ModuleList([nn.Linear(8, 8).to(D) for _ in range(3)])
        self.table = nn.ModuleDict({k: nn.Linear(8, 8).to(D) for k in ("a", "b")})
        self.register_buffer("gain", torch.rand(8, dtype=D) + 0.5)
        self.temperature = 1.0
        self.active = 0
        self.key = "a"
        self.order = [0, 1, 2]
        self.shift = 1  # (an op's list argument: roll's shifts)
        self.seed = 1000 + seed  # (torch's RNG seeded inside the forward pass, from this counter, which it bumps)
        self.value = 0.5  # (torch.tensor(self.value): a tensor from Python data)
        cell = [1.0]  # (a closure cell's value, rebound through the setter)
        cfg = {"shift": 0.0}
        scale = 1.0

        def set_cell(v: float) -> None:
            nonlocal scale
            scale = v

        def read_cell() -> float:
            return scale

        def read_default(_mult: float = 1.0) -> float:
            return _mult

        self.set_cell, self.read_cell, self.read_default, self.cfg, self._unused = set_cell, read_cell, read_default, \
            cfg, cell

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for s in self.steps:
            if s == "attr":
                h = torch.tanh(h * self.temperature)
            elif s == "global":
                h = torch.sin(h * _read_global())
            elif s == "cell":
                h = torch.tanh(h + self.read_cell())
            elif s == "default":
                h = torch.sin(h * self.read_default())
            elif s == "expert":
                h = torch.tanh(self.experts[self.active](h))
            elif s == "moddict":
                h = torch.tanh(self.table[self.key](h))
            elif s == "order":
                for j in self.order[:2]:
                    h = torch.sin(self.experts[j](h))
            elif s == "random":
                h = torch.tanh(random.choice(list(self.experts))(h))
            elif s == "nprandom":
                h = torch.tanh(self.experts[int(np.random.randint(3))](h))
            elif s == "cfg":
                h = torch.sin(h - self.cfg["shift"])
            elif s == "buffer":
                h = torch.tanh(h * self.gain)
            elif s == "roll":
                h = torch.sin(torch.roll(h, shifts=self.shift, dims=1) * h)
            elif s == "seed":
                torch.manual_seed(self.seed)
                self.seed += 1
                h = torch.nn.functional.dropout(torch.tanh(h), 0.25, training=True)
            elif s == "factory":
                h = torch.sin(h + torch.ones(8).to(D) / 3)  # (follows the default dtype)
            elif s == "gtensor":
                h = torch.tanh(h + G_TENSOR)
            elif s == "pydata":
                h = torch.sin(h * torch.tensor(self.value, dtype=D))
            elif s == "denormal":  # (a mask of denormal values: all zero under torch.set_flush_denormal(True))
                h = torch.tanh(h * (1 + 0.1 * ((h.abs() + 1) * 1e-310 != 0).to(D)))
            elif s == "outmax":  # (an out= op writing tensors the call made; its results read by others)
                vals, idx = torch.empty(4, dtype=D), torch.empty(4, dtype=torch.long)
                torch.max(h.detach(), 1, out=(vals, idx))
                m, _ = torch.max(h, 1)
                h = torch.tanh(h * (1 + 0.1 * vals[:, None])) + 0.1 * m[:, None] * h.gather(1, idx[:, None])
            elif s == "cache":  # (a slot of a global cache, viewed before an out= op writes it, read through the view after)
                slot = CACHE[self.active % 2]
                torch.tanh(h.detach()[0], out=slot)
                h = torch.sin(h * (1 + 0.1 * slot)) + 0.1 * CACHE[self.active % 2] * h
            elif s == "tanh":
                h = torch.tanh(h)
            elif s == "sin":
                h = torch.sin(h) * 1.5
            else:
                h = remat.checkpoint_name(self.lin(h), "h")
        return h


def mutate(m: Program, what: str, rng: random.Random) -> None:
    """Change one piece of the program's Python state (to another value, or the same: both happen in training)."""
    if what == "attr":
        m.temperature = rng.choice([1.0, 2.0, 3.0])
    elif what == "global":
        _set_global(rng.choice([1.0, 0.5, 2.0]))
    elif what == "cell":
        m.set_cell(rng.choice([1.0, 0.25, -1.0]))
    elif what == "default":
        m.read_default.__defaults__ = (rng.choice([1.0, 2.0, 0.5]),)
    elif what == "expert":
        m.active = rng.randrange(3)
    elif what == "moddict":
        m.key = rng.choice(["a", "b"])
    elif what == "order":
        rng.shuffle(m.order)
    elif what == "cfg":
        m.cfg["shift"] = rng.choice([0.0, 0.5, -0.5])
    elif what == "roll":
        m.shift = rng.choice([1, 2, -1])
    elif what == "gtensor":
        G_TENSOR.add_(rng.choice([0.0, 0.5, -0.25]))  # in place
    elif what == "pydata":
        m.value = rng.choice([0.5, 1.5, -1.0])
    elif what == "settings":
        torch.set_default_dtype(torch.float16)
        torch.set_float32_matmul_precision("medium")
        torch.set_flush_denormal(True)
    elif what == "buffer":
        if rng.random() < 0.5:
            m.gain = GAINS[rng.randrange(len(GAINS))]  # replaced by a same-shaped tensor (drawn beforehand: a
            # mutation may run inside a transform)
        else:
            m.gain = m.gain  # (unchanged)


def _grads(m: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]


def _flat(g: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient as plain values (a ``TwoTensor``'s two halves side by side)."""
    if isinstance(g, TwoTensor):
        return torch.cat([g.a.reshape(-1), g.b.reshape(-1)])
    return g


def _input(t: torch.Tensor, wrap: str) -> torch.Tensor:
    """The call's input: a leaf; of a wrapper subclass for the "subclass" wrapping."""
    if wrap == "subclass":
        return TwoTensor(t, t * 1.5).requires_grad_()
    return t.requires_grad_()


def _wrapped(m: Program, policy: Any, wrap: str) -> Any:
    """The program's forward remat'd as a function, a bound method, in place through remat_module (also what the
    torch.func wrappings call through functional_call), or twice inside an outer remat'd function (nested)."""
    if wrap == "function":
        return remat.remat(lambda x: Program.forward(m, x), policy=policy)
    if wrap == "method":
        return remat.remat(m.forward, policy=policy)
    if wrap == "debug":  # the full engine on every call
        return remat.remat(m.forward, policy=policy, debug=True)
    if wrap == "subclass":  # inputs of a wrapper subclass: the full engine, its recompute replaying the program
        return remat.remat(m.forward, policy=policy)
    if wrap == "nested":
        inner = remat.remat(m.forward, policy=policy)
        return remat.remat(lambda x: inner(torch.tanh(inner(x))), policy=policy)
    remat.remat_module(m, policy=policy)
    return m


def _plain(wrap: str, m: Program, x: torch.Tensor) -> torch.Tensor:
    return Program.forward(m, torch.tanh(Program.forward(m, x))) if wrap == "nested" else Program.forward(m, x)


def _func_grads(module: nn.Module, wrap: str, x: torch.Tensor, between: Any) -> list[torch.Tensor]:
    """Gradients of every parameter and of ``x`` under a torch.func transform over ``functional_call(module)``;
    ``between()`` runs after the forward pass, before the backward pass."""
    params = {k: v.detach() for k, v in module.named_parameters()}
    x = x.detach()

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        y = torch.func.functional_call(module, p, (x,)).sum()
        between()
        return y

    if wrap == "vjp":  # the mutation between vjp and its function
        y, pull = torch.func.vjp(lambda p, x: torch.func.functional_call(module, p, (x,)), params, x)
        between()
        gp, gx = pull(torch.ones_like(y))
    elif wrap == "grad":
        gp, gx = torch.func.grad(loss, argnums=(0, 1))(params, x)
    elif wrap == "jacrev":
        gp, gx = torch.func.jacrev(loss, argnums=(0, 1))(params, x)
    else:  # per-example gradients
        gp, gx = torch.func.vmap(torch.func.grad(lambda p, xi: loss(p, xi[None]), argnums=(0, 1)), in_dims=(None, 0),
                                 randomness="same")(params, x)
    return [gp[k] for k, _ in module.named_parameters()] + [gx]


def _restore_settings(dtype: torch.dtype, precision: str) -> None:
    torch.set_default_dtype(dtype)
    torch.set_float32_matmul_precision(precision)
    torch.set_flush_denormal(False)


def run_program(seed: int, policy_name: str, wrap: str, calls: int = 6) -> Counter[str]:
    """One program, its first call clean and ``calls`` mutated ones: a count of the outcomes. A mutated call may run
    two forward passes (a mutation between them) before one backward pass over both (forward-all-then-backward-
    all)."""
    rng = random.Random(seed * 7919 + 1)
    m = Program(seed, seeded=wrap != "vmap(grad)")
    ref = Program(seed, seeded=wrap != "vmap(grad)")
    ref.load_state_dict(m.state_dict())
    f = _wrapped(m, POLICIES[policy_name], wrap)
    out: Counter[str] = Counter()
    saved_global, saved_g = _GLOBAL_SCALE, G_TENSOR.clone()
    dtype, precision = torch.get_default_dtype(), torch.get_float32_matmul_precision()
    func = wrap in FUNC_WRAPS
    try:
        for call in range(calls + 1):
            x = _input(torch.randn(4, 8, dtype=D, generator=torch.Generator().manual_seed(seed + call)), wrap)
            x2 = _input(torch.randn(4, 8, dtype=D, generator=torch.Generator().manual_seed(seed + call + 500)), wrap)
            before = [] if call == 0 else rng.sample(MUTATIONS, rng.randrange(0, 3))
            # (inside grad, jacrev and vmap, torch.func refuses an in-place write to a captured tensor, with or
            # without remat: the global tensor is written between the passes under vjp and in eager mode)
            menu = [w for w in MUTATIONS + BETWEEN_ONLY if w != "gtensor" or wrap not in FUNC_WRAPS[1:]]
            between = [] if call == 0 else rng.sample(menu, rng.randrange(0, 3))
            twice = call > 0 and not func and rng.random() < 0.3
            mid = rng.sample(MUTATIONS, rng.randrange(1, 3)) if twice else []
            for w in before:
                mutate(m, w, rng)
            state = _state_of(m)
            state2 = None
            ambient = "none" if func else rng.choice(AMBIENTS)
            draw = rng.randrange(1 << 30)
            random.seed(draw)
            np.random.seed(draw % (1 << 31))
            m.zero_grad(set_to_none=True)

            def during(between: list[str] = between) -> None:
                for w in between:
                    mutate(m, w, rng)

            try:
                try:
                    if func:
                        got = _func_grads(m, wrap, x, during)
                    else:
                        with contextlib.ExitStack() as around:
                            if ambient.endswith("both"):
                                around.enter_context(_ambient(ambient))
                            with _ambient(ambient) if ambient.endswith("forward") else contextlib.nullcontext():
                                y = f(x).sum()
                                if twice:
                                    for w in mid:
                                        mutate(m, w, rng)
                                    state2 = _state_of(m)
                                    y = y + f(x2).sum()
                            during()
                            with _ambient(ambient) if ambient.endswith("backward") else contextlib.nullcontext():
                                y.backward()
                        got = [*_grads(m), x.grad] + ([x2.grad] if twice else [])
                finally:
                    _restore_settings(dtype, precision)
            except RematError:
                out["raised"] += 1
                continue
            finally:
                x.grad = x2.grad = None
            # plain autograd, with the state each forward pass read and the same random draws
            after = _state_of(m)
            _set_state(ref, m, state)
            random.seed(draw)
            np.random.seed(draw % (1 << 31))
            ref.zero_grad(set_to_none=True)
            if func:
                want = _func_grads(ref, wrap, x, lambda: None)
            else:
                y = _plain(wrap, ref, x).sum()
                if twice:
                    assert state2 is not None
                    _set_state(ref, m, state2)
                    y = y + _plain(wrap, ref, x2).sum()
                y.backward()
                want = [*_grads(ref), x.grad] + ([x2.grad] if twice else [])
                x.grad = x2.grad = None
            _set_state(ref, m, after)
            ok = all(torch.allclose(_flat(a), _flat(b), rtol=TOL, atol=TOL) for a, b in zip(got, want))
            out["equal" if ok else "silent"] += 1
    finally:
        _set_global(saved_global)
        G_TENSOR.copy_(saved_g)
    return out


def _state_of(m: Program) -> tuple[Any, ...]:
    return (m.temperature, _GLOBAL_SCALE, m.read_cell(), m.read_default.__defaults__, m.active, m.key, list(m.order),
            dict(m.cfg), m.gain, m.shift, m.seed, m.value, G_TENSOR.clone())


def _set_state(ref: Program, m: Program, state: tuple[Any, ...]) -> None:
    """``ref`` takes the Python state ``state``; module-level and shared pieces (the globals) are set once."""
    ref.temperature, g, c, d, ref.active, ref.key, order, cfg, gain, ref.shift, ref.seed, ref.value, gt = state
    _set_global(g)
    ref.set_cell(c)
    ref.read_default.__defaults__ = d
    ref.order[:] = order
    ref.cfg.clear()
    ref.cfg.update(cfg)
    ref.gain = gain
    G_TENSOR.copy_(gt)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--calls", type=int, default=6, help="mutated calls per program, after one clean call")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--wraps", default=",".join(WRAPS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    names = args.policies.split(",")
    wraps = args.wraps.split(",")
    for n in names:
        if n not in POLICIES:
            ap.error(f"unknown policy {n!r}; choose from {', '.join(POLICIES)}")
    for w in wraps:
        if w not in WRAPS:
            ap.error(f"unknown wrapping {w!r}; choose from {', '.join(WRAPS)}")
    t0 = time.perf_counter()
    total: Counter[str] = Counter()
    print("| policy | wrapping | programs | calls (first ones included) | equal | RematError | silent |")
    print("|---|---|--:|--:|--:|--:|--:|")
    for n in names:
        for w in wraps:
            c: Counter[str] = Counter()
            for p in range(args.programs):
                c += run_program(args.seed + p, n, w, args.calls)
            calls = c["equal"] + c["raised"] + c["silent"]
            print(f"| {n} | {w} | {args.programs} | {calls} | {c['equal']} | {c['raised']} | {c['silent']} |",
                  flush=True)
            total += c
    calls = total["equal"] + total["raised"] + total["silent"]
    print(f"\n{calls} calls ({args.programs} programs x {args.calls + 1} calls x {len(names)} policies x "
          f"{len(wraps)} wrappings, first calls included): {total['equal']} equal to plain autograd, "
          f"{total['raised']} RematError, {total['silent']} silent mismatches; {time.perf_counter() - t0:.0f} s")
    return 1 if total["silent"] else 0


if __name__ == "__main__":
    sys.exit(main())
