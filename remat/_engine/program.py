"""A call's *program* on the full engine (under ``torch.func``, tensor subclasses, a memory budget's measuring
call): the torch functions its forward pass called at its own level, replayed by the recompute in place of the
user's Python.

NOTE [program replay]
    Under ``torch.func`` the ATen trace (NOTE [the trace]) cannot serve: a dispatch mode sees the ops below every
    functorch layer (a vmap level batches them, a jvp level adds its tangents' ops), while the recompute must
    make the saved tensors again at the level that saved them, on the rebuilt stack (NOTE [per-level replay] in
    ``_engine/functorch.py``). So the full engine runs the call again on that stack; what it runs is not the user's
    Python but the call's program. A ``TorchFunctionMode`` (:class:`ProgramRecorder`) sees, above every layer,
    each torch function the forward pass called (``torch.matmul``, ``Tensor.__getitem__``, ``F.layer_norm``,
    ``torch.ops.aten.alias``) and stores it as a :class:`Call`: the function, its non-tensor arguments as they
    were, and each tensor argument as a slot (an input of the call, a tensor of the module state, an output of an
    earlier call, or an outside tensor, held). The replay calls them in order on the rebuilt stack's values, so
    every Python decision of the forward pass stands: which tensor a call reads, a temperature, a random branch,
    ``torch.tensor(python_value)``, a list of experts reordered. Grad mode (a ``torch.no_grad()`` block), the
    default dtype, the thread count and a pending ``checkpoint_name`` are set as they were. The recompute's dispatch ``Replayer``
    and ``Capture`` check what the program runs exactly as they checked a re-run, and the ``Replayer`` gives each
    random op the generator state it drew from in the forward pass (NOTE [random ops] in ``replay.py``: a seed set
    inside the function, a Megatron-style tracker, a user's generator).

    A program that cannot stand for the Python is *spoiled*, and the recompute runs the Python again as before
    (with the re-run's checks: exact or ``RematError``): a call at another functorch level than the call's own (a
    vmap inside the function), a call made while another remat call is active (other than a nested remat call
    recorded as one call: NOTE [nested programs]), an iterator
    returned (its tensors come from no call the mode sees), a tensor with history made inside the call that no call
    made (the output of a custom ``autograd.Function``; ``DTensor.from_local`` and ``to_local``, which are such
    Functions, and FSDP2's hooks: tensor parallel and FSDP2 calls re-run; one made before the call began, such as
    the enclosing function's key cache, is held and read as it is, as any outside tensor), a tensor of the call
    that an ``autograd.Function`` returned as its own output (a module's full backward hook), autocast switched inside the function, saved-tensor hooks the
    function pushes itself (``torch.utils.checkpoint``, ``save_on_cpu``: its ops' saves go to those hooks, which a
    replay of the calls alone would not push). A recompute asked for before the forward pass ends (a backward pass
    inside it: a gradient penalty) finds the program unfinished, and runs the Python.

    NOTE [nested programs]: a remat call inside the forward pass of another full-engine call (under
    ``torch.func``, or a memory budget's measuring call), at its level, records a program of its own and is one
    call of the enclosing program (``record_nested``): a ``recompute.NestedProgram``, which the enclosing recompute
    runs as it runs any nested call (its saves pass through to the enclosing recompute: ``call_nested_replay``),
    with the inner program, not the inner Python, as its body, on the inputs and the module state or closed-over
    tensors the enclosing program hands it (a closure over a value of the enclosing call: the value its replay
    made); the inner call's own recompute replays that program too. So no level runs the user's Python twice
    (a seed advanced inside, a counter: the inner block ran three times a call before, and a later call drew other
    numbers). A nested program notes where its result comes from (``finish``); one that is spoiled itself runs
    its Python there, as before.

    NOTE [unseen aliases]: ``nn.Parameter(t)`` (``Tensor._make_subclass``: ``nn.Linear`` built inside the function)
    makes an alias of ``t`` that no torch function makes. Held as a tensor from outside, its replay read the forward
    pass's tensor, which a write of the call (``t.mul_``, ``kaiming_uniform_``, ``out=``) had already written, and wrote
    it again (under ``grad`` a wrong gradient; under ``vjp``, torch's "mutate a captured Tensor"). So the storages a
    call makes are noted (``_made``: a storage met first as a call's output, not a getter's such as ``p.grad``, nor a
    nested call's, which may return a view of a global; by its Python object, which torch keeps one of per live
    storage, so that an address used again is another storage), with the tensors the calls made on them; a tensor of
    no slot on such a storage (never an input's, the state's or an outside tensor's: a closed-over row of the batch a
    vmap runs over shares the input's) is made again by a call of ``ops.Alias`` on the replay's value of a tensor made
    there (of its dtype and geometry, if one is: no view then): its dtype, geometry, type and ``requires_grad``, with
    no history. On the ATen trace (``trace.unseen_aliases``) the question waits for the first write into such a
    storage, or for a subclass's alias the end of the forward pass, after which the caller may write it
    (``h.as_subclass(T)`` returned: ``replaying.adopt``; until then, reading the alias as a tensor from outside reads
    what the forward pass read; a module's buffers, read on every call, are never asked): an outside tensor there,
    of any type (``t.data`` too), becomes a step that makes it from a live tensor the call's ops made on that
    storage, placed before its first reader.

    Without ``torch.func`` the same program serves a call the ATen trace does not take (tensor subclasses: a
    wrapper such as ``TwoTensor`` whose values the torch calls make is replayed exactly; NOTE [wrapper subclasses]
    in ``_engine/dispatch.py``).
"""

from __future__ import annotations

import collections
import collections.abc
import weakref
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from .. import _torch_internals as ti
from .._context import INTERNAL, PENDING_NAME, active_context
from .._errors import outside_written_before_backward
from . import outside as ox
from .ambient import put_settings, settings
from .ops import Alias, plain_subclass

__all__ = ["Program", "ProgramRecorder", "GAVE_WAY"]

Tensor = torch.Tensor
GAVE_WAY = object()  # (Program.result: the program is not finished, a backward pass inside the forward; the Python runs)


class Call:
    """One torch function the forward pass called: ``func(*args, **kwargs)``, the tensors at ``refs`` from slots."""

    __slots__ = ("func", "spec", "leaves", "refs", "outs", "grad", "inference", "settings", "name")

    def __init__(self, func: Any, spec: Any, leaves: list[Any], refs: list[tuple[int, int]], grad: bool,
                 settings: tuple[torch.dtype, int], name: str | None) -> None:
        self.func = func
        self.spec = spec  # the structure of (args, kwargs)
        self.leaves = leaves  # their leaves, tensors replaced by None
        self.refs = refs  # (leaf index, slot)
        self.outs: list[int] = []  # the slots of its tensor outputs, in order (-1: a leaf that is not a tensor)
        self.grad = grad
        self.settings = settings  # the default dtype and thread count it ran under
        self.inference = torch.is_inference_mode_enabled()  # (an inference_mode block: ops reach the modes whole)
        self.name = name  # a checkpoint_name pending around it


class Program:
    """One call's program (NOTE [program replay])."""

    def __init__(self, fn_name: str) -> None:
        self.fn_name = fn_name
        self.calls: list[Call] = []
        self.n = 0
        # id(tensor) -> (the tensor, weakly; its slot; the id of its autograd node then)
        self._slot_of: dict[int, tuple[weakref.ref[Tensor], int, int]] = {}
        self._nograd: set[int] = set()  # slots made by a call with grad mode off
        self.inputs: dict[int, int] = {}  # slot -> index among the call's leaves
        self.state: dict[int, int] = {}  # slot -> index among the module state's tensors
        self.outside: dict[int, Any] = {}  # slot -> an outside tensor, held
        self.versions: dict[int, int] = {}  # slot -> an outside tensor's version when the forward pass ended
        self.spoiled: str | None = None  # why the Python must run again instead
        self.running = False  # a recorded call is running (the torch calls it makes are its own)
        self.frame: Any = None
        self.level = -1
        self.order0 = 0
        self.grad0 = True
        self.autocast0: tuple[Any, ...] = (None, None)
        self.last_use: list[list[int]] | None = None
        self.nested = False  # a remat call inside another's forward pass (NOTE [nested programs]): its result is noted
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []
        self.out_refs: list[tuple[int, int]] = []  # (leaf index, slot) of the result's tensors
        # NOTE [unseen aliases]
        self._storages: dict[int, Any] = {}  # address -> each storage met, weakly (its Python object: one per storage)
        self._fresh: dict[int, list[Any]] = {}  # address of a storage a call made -> (ref, slot, dtype, geometry)s on it

    # ---- recording -------------------------------------------------------------------
    def start(self, frame: Any, flat: list[Any], state_tensors: list[Tensor]) -> None:
        self.frame = frame
        self.order0 = ti.autograd_order()  # (the autograd nodes made since are the call's)
        top = ti.peek_interpreter()
        self.level = top.level() if top is not None else -1
        self.grad0 = torch.is_grad_enabled()
        self.autocast0 = _autocast()
        for i, a in enumerate(flat):
            if isinstance(a, Tensor):
                self.inputs[self._new(a)] = i
                _met(self, a)
        for i, t in enumerate(state_tensors):
            if self._known(t) is None:
                self.state[self._new(t)] = i
                _met(self, t)

    def takes_nested(self) -> bool:
        """Whether a remat call starting now inside this call's forward pass can be recorded as one of its calls
        (NOTE [nested programs]): at the call's own level, nothing else running."""
        if self.spoiled is not None or self.running or self.frame is None or active_context() is not self.frame:
            return False
        if not self.own_hooks():
            return False  # (inside torch.utils.checkpoint or save_on_cpu: the program gives way, as ``ProgramRecorder``)
        top = ti.peek_interpreter()
        return (top.level() if top is not None else -1) == self.level and _autocast() == self.autocast0

    def own_hooks(self) -> bool:
        """Whether the saved-tensor hooks on top are the call's own (not the function's: torch's checkpoint inside)."""
        hooks = ti.top_saved_tensors_hooks()
        return hooks is not None and hooks[0] == self.frame.pack

    def spoil(self, why: str) -> None:
        if self.spoiled is None:
            self.spoiled = why
            self.calls = []
            self.outside = {}

    def finish(self, out: Any = None) -> None:
        """The forward pass ended: no more slots to look up; note when each value is read last (and, for a nested
        call's program, where its result comes from: NOTE [nested programs])."""
        if self.nested and self.spoiled is None:
            leaves, self.out_spec = optree.tree_flatten(out, none_is_leaf=True)
            self.out_leaves = [None if isinstance(t, Tensor) else t for t in leaves]
            for i, t in enumerate(leaves):
                if isinstance(t, Tensor):
                    s = self._known(t)
                    if s is None:
                        self.spoil("it returns a tensor that no torch function of the call made")
                        break
                    self.out_refs.append((i, s))
        if self._nograd and self.spoiled is None:
            # a value made with grad off that an autograd.Function returned (as the call's result: no call read it)
            for ref, _, _ in list(self._slot_of.values()):
                t = ref()
                if t is not None:
                    self._known(t)
        self._slot_of = {}
        self._storages, self._fresh = {}, {}
        self.frame = None
        if self.spoiled is not None:
            return
        last: dict[int, int] = {}
        for k, c in enumerate(self.calls):
            for _, s in c.refs:
                last[s] = k
        frees: list[list[int]] = [[] for _ in self.calls]
        held = set(self.inputs) | set(self.state) | set(self.outside) | {s for _, s in self.out_refs}
        for s, k in last.items():
            if s not in held:
                frees[k].append(s)
        self.last_use = frees
        self.versions = {s: ti.unwrap_all(t)._version for s, t in self.outside.items() if ti.has_history(t)}

    def _new(self, t: Tensor) -> int:
        s = self.n
        self.n = s + 1
        self._slot_of[id(t)] = (weakref.ref(t), s, id(self._node(t)))
        return s

    def _node(self, t: Tensor) -> Any:
        try:
            return t.grad_fn
        except RuntimeError:  # ("A view was created in no_grad mode and ... modified inplace": torch refuses its node)
            self.spoil("it writes in place a view made under no_grad")
            return None

    def _known(self, t: Tensor) -> int | None:
        e = self._slot_of.get(id(t))
        if e is None or e[0]() is not t:
            return None
        if e[1] in self._nograd:
            node = self._node(t)
            if id(node) != e[2] and isinstance(node, torch.autograd.function.BackwardCFunction) and (
                    (type(t) is not Tensor and type(t) is not torch.nn.Parameter)
                    or type(node).__name__ != "BackwardHookFunctionBackward"):
                # a call inside an autograd.Function's forward (grad off there) made it, and the Function returned
                # it as its own output (a module's full backward hook does so for a wrapper subclass, through
                # BackwardHookFunction's view_as): the replay would make it without the Function's node, and the
                # ops after it would save less (for plain tensors the hook's Function returns its arguments, which
                # the replay's ops read as the forward's did: tests/test_user_modes.py); any other custom Function
                # returning what a call inside it made (Bloom's GeLUFunction) saved what the replay cannot rebuild
                self.spoil("an autograd.Function returned a tensor that a call inside it made (a custom "
                           "autograd.Function, a module's full backward hook)")
            elif id(node) != e[2] and type(node).__name__ == "BackwardHookFunctionBackward":
                # (a plain tensor through a submodule's full backward hook, made by the view_as autograd runs inside
                # the hook's Function: replayed with grad mode on, it needs a gradient as the Function's output did,
                # and the ops after it save what they saved; the hook itself has nothing to do in a recompute)
                self._nograd.discard(e[1])
                for c in reversed(self.calls):
                    if e[1] in c.outs:
                        c.grad = True
                        break
        return e[1]

    def read(self, t: Tensor) -> int:
        s = self._known(t)
        if s is not None:
            return s
        if (node := self._node(t)) is not None and ti.autograd_order(node) >= self.order0:
            # a value with history made inside the call where no recorded call made it (a custom autograd.Function's
            # output): what made it would not run again. (One made before the call began, the enclosing function's
            # key cache or closure, is read as it is: held, as any outside tensor.)
            self.spoil("it reads a tensor with history that no torch function of the call made")
        made = _unseen_alias(self, t) if self.spoiled is None else None
        if made is not None:  # NOTE [unseen aliases]: made again, from the replay's value of the storage it shares
            alias, s = Call(Alias(t), None, [], [(0, made)], torch.is_grad_enabled(), settings(), None), self._new(t)
            alias.outs.append(s)
            self.calls.append(alias)  # (to a list spoil emptied, if _new spoiled the program: nothing replays it)
            return s
        _met(self, t)
        s = self._new(t)
        # held, as the ATen trace holds its outside tensors (NOTE [the trace]): the replay reads the tensor the
        # forward pass read, whatever happens to the name it was read through (a global rebound, a queue popped);
        # held weakly, one that died made the Python run again, its side effects twice (a review, the
        # twenty-seventh session)
        if self.spoiled is None:  # (a spoiled program replays nothing: holding what spoiled it kept it alive)
            self.outside[s] = t
        return s

    # ---- replay ----------------------------------------------------------------------
    def replay(self, vals: list[Any], state_vals: list[Any]) -> bool:
        """Run the program on the rebuilt stack's inputs and state (``_engine/recompute.py``); False, before
        running anything, if the program is not finished (the Python runs again instead)."""
        return self._run(vals, state_vals) is not None

    def result(self, vals: list[Any], state_vals: list[Any]) -> Any:
        """A nested call's program run on ``vals``: its result, or ``GAVE_WAY`` (as ``replay``'s False)."""
        v = self._run(vals, state_vals)
        if v is None:
            return GAVE_WAY
        leaves = list(self.out_leaves)
        for i, s in self.out_refs:
            leaves[i] = v[s]
        return optree.tree_unflatten(self.out_spec, leaves)

    def record_nested(self, func: Any, flat: list[Any], state: list[Tensor], forward: Any) -> Any:
        """NOTE [nested programs]: run ``forward`` (a remat call inside this call's forward pass, on ``flat``, reading
        the module state and closed-over tensors ``state``) and record it as one call of ``func``, which the replay
        runs in its place on the values of both then (a closure over a value of this call: the replay's value)."""
        flat = [*flat, *state]
        refs = [(i, self.read(a)) for i, a in enumerate(flat) if isinstance(a, Tensor)]
        leaves: list[Any]
        leaves, spec = optree.tree_flatten((tuple(flat), {}), none_is_leaf=True)  # type: ignore[arg-type]
        call = Call(func, spec, [None if isinstance(a, Tensor) else a for a in leaves], refs,
                    torch.is_grad_enabled(), settings(), PENDING_NAME.get())
        self.running = True  # (its torch calls are its own program's, and noting its result is none of the call's)
        try:
            out = forward()
            if self.spoiled is None:
                call.outs = [_made(self, t, fresh=False) if isinstance(t, Tensor) else -1
                             for t in optree.tree_leaves(out, none_is_leaf=True)]
                if not call.grad:
                    self._nograd.update(s for s in call.outs if s >= 0)
                self.calls.append(call)
        finally:
            self.running = False
        return out

    def _run(self, vals: list[Any], state_vals: list[Any]) -> dict[int, Any] | None:
        _refuse_written(self)
        v: dict[int, Any] = {s: _alive_layers(t) for s, t in self.outside.items()}
        for s, i in self.inputs.items():
            v[s] = vals[i]
        for s, i in self.state.items():
            v[s] = state_vals[i]
        frees = self.last_use
        if frees is None:
            # a backward pass inside the forward pass (``torch.autograd.grad`` in the function, a gradient penalty):
            # the program is not finished, and its recorder still listens; the Python runs instead
            return None
        settings0 = settings()
        grad0 = torch.is_grad_enabled()
        try:
            for k, c in enumerate(self.calls):
                if c.spec is None:  # (an unseen alias: NOTE [unseen aliases])
                    v[c.outs[0]] = c.func(v[c.refs[0][1]])
                    continue
                leaves = list(c.leaves)
                for i, s in c.refs:
                    leaves[i] = v[s]
                args, kwargs = optree.tree_unflatten(c.spec, leaves)
                put_settings(c.settings)
                grad = grad0 if c.grad == self.grad0 else c.grad  # (a no_grad block of the function)
                was = PENDING_NAME.get()
                try:
                    if c.name is not None:
                        PENDING_NAME.set(c.name)
                    with torch.set_grad_enabled(grad):
                        if c.inference:
                            with torch.inference_mode():
                                out = c.func(*args, **kwargs)
                        else:
                            out = c.func(*args, **kwargs)
                finally:
                    PENDING_NAME.set(was)
                if c.outs:
                    if len(c.outs) == 1 and isinstance(out, Tensor):
                        v[c.outs[0]] = out
                    else:
                        for s, t in zip(c.outs, optree.tree_leaves(out, none_is_leaf=True)):
                            if s >= 0:
                                v[s] = t
                for s in frees[k]:
                    v.pop(s, None)
        finally:
            put_settings(settings0)
        return v


def _refuse_written(p: Program) -> None:
    """An outside tensor with history (read as held: its graph is the replay's) of a transform that ended since,
    written since the forward pass ended: the replay would read it without its ended layers, and the write
    (``_alive_layers``)."""
    for s, v0 in p.versions.items():
        t = p.outside[s]
        if ti.is_wrapped(t) and ti.is_dead_wrapper(t) and (u := ti.unwrap_all(t))._version != v0:
            raise outside_written_before_backward(p.fn_name, None, u, v0)


def _alive_layers(t: Any) -> Any:
    """An outside tensor without the wrappers of the transforms that ended since the forward pass read it (one made
    inside an inner transform of ``jacrev(jacrev(f))``, read from a global: functorch's own reading of such a wrapper,
    which an op at the rebuilt levels asserts on instead); its live layers, history and all, stay. (History it had at
    an ended level is gone: the recompute saves less than the forward pass did, and raises.)"""
    while isinstance(t, Tensor) and ti.is_wrapped(t) and ti.is_dead_wrapper(t):
        t = ti.unwrap_one(t)
    return t


def _made(p: Program, t: Tensor, fresh: bool = True) -> int:
    """The slot of an output of a call of ``p``, noted on its storage if a call made that storage: one met first
    here, from a call that can make one (``fresh``: not a getter, not a nested call) (NOTE [unseen aliases])."""
    s = p._new(t)
    st = _storage(t)
    if st is not None:
        if not _met(p, t, st):
            if not fresh:
                return s
            p._fresh[st[0]] = []
        entries = p._fresh.get(st[0])
        if entries is not None:
            entries.append((p._slot_of[id(t)][0], s, t.dtype, ox.view_geometry(t)))
    return s


def _met(p: Program, t: Tensor, st: Any = None) -> bool:
    """Whether ``t``'s storage was met before; noted as met now (a new one at an address: the old one's gone)."""
    st = _storage(t) if st is None else st
    if st is None:
        return True
    ref = p._storages.get(st[0])
    if ref is not None and ref() is st[1]:
        return True
    p._storages[st[0]] = weakref.ref(st[1])
    p._fresh.pop(st[0], None)
    return False


def _unseen_alias(p: Program, t: Tensor) -> int | None:
    """NOTE [unseen aliases]: the slot of a tensor program ``p``'s calls made on the storage ``t`` shares, if a call
    made that storage, of the size of ``t``'s dtype: of its dtype and geometry if one is (no view then), alive if one
    is; else None."""
    st = _storage(t)
    if st is None:
        return None
    ref = p._storages.get(st[0])
    entries = p._fresh.get(st[0]) if ref is not None and ref() is st[1] else None
    if not entries:
        return None
    geometry = ox.view_geometry(t)
    best = max((e for e in entries if e[2].itemsize == t.dtype.itemsize), default=None,
               key=lambda e: (e[2] == t.dtype, e[3] == geometry, e[0]() is not None, e[1]))
    return None if best is None else best[1]


def _storage(t: Tensor) -> tuple[int, Any] | None:
    """The address and Python object of the storage below ``t``'s functorch wrappers, or None (none: a subclass, a
    fake tensor). torch keeps one Python object per live storage: the same storage is the same object."""
    u = ti.unwrap_all(t)
    if type(u) is not Tensor and type(u) is not torch.nn.Parameter and not plain_subclass(type(u)):
        return None  # (a subclass that overrides torch's handling: its queries are ops its own dispatch would see)
    try:
        st = u.untyped_storage()
        addr = st.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (addr, st) if addr else None


def _autocast() -> tuple[Any, ...]:
    """Autocast's state on each device: off (None) or its dtype (an inner region of another dtype switches it)."""
    cpu, cuda = torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")
    if not cpu and not cuda:
        return _OFF
    return (torch.get_autocast_dtype("cpu") if cpu else None, torch.get_autocast_dtype("cuda") if cuda else None)


_OFF = (None, None)


# Torch functions that register autograd hooks (``x.register_hook(scale)`` inside the function): a side effect of
# the forward pass, never part of a recompute (replayed or re-run, a hook on an input or parameter would run twice,
# and stay registered after the call)
HOOK_REGISTRATIONS = frozenset({Tensor.register_hook, Tensor.register_post_accumulate_grad_hook, Tensor.retain_grad})


class NoHookRegistration(TorchFunctionMode):
    """Around a recompute that runs the function's Python again: its hook registrations do nothing (a handle whose
    ``remove`` does nothing), as a replay's (``HOOK_REGISTRATIONS``)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        t = args[0] if args else None
        # (one torch refuses, on a tensor that needs no gradient or a non-leaf's post-accumulate hook: it raises, as
        # in the forward pass, whose Python may have caught it)
        if func in HOOK_REGISTRATIONS and isinstance(t, Tensor) and t.requires_grad and not (
                func is Tensor.register_post_accumulate_grad_hook and t.grad_fn is not None):
            return None if func is Tensor.retain_grad else torch.utils.hooks.RemovableHandle(collections.OrderedDict())
        return func(*args, **(kwargs or {}))


class ProgramRecorder(TorchFunctionMode):
    """The forward pass's torch-function mode: record each call of the function's own level (NOTE [program
    replay])."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        p = self.program
        if p.spoiled is not None or INTERNAL.get() or p.running or func in HOOK_REGISTRATIONS:
            return func(*args, **kwargs)  # (a hook registered: once, in the forward pass, as in plain autograd)
        if active_context() is not p.frame:
            p.spoil("another remat call ran inside it")
            return func(*args, **kwargs)
        top = ti.peek_interpreter()
        if (top.level() if top is not None else -1) != p.level:
            p.spoil("it calls torch functions under a torch.func level of its own (a vmap inside the function)")
            return func(*args, **kwargs)
        if _autocast() != p.autocast0:
            p.spoil("it switches autocast inside")
            return func(*args, **kwargs)
        if not p.own_hooks():
            # (torch.utils.checkpoint or save_on_cpu inside the function: what its ops save goes to those hooks, and
            # a replay of the ops alone would save it through the recompute's)
            p.spoil("it runs torch functions under saved-tensor hooks of its own")
            return func(*args, **kwargs)
        leaves: list[Any]
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)  # type: ignore[arg-type]
        refs = []
        for i, a in enumerate(leaves):
            if isinstance(a, Tensor):
                refs.append((i, p.read(a)))
                leaves[i] = None
        call = Call(func, spec, leaves, refs, torch.is_grad_enabled(), settings(), PENDING_NAME.get())
        p.running = True
        try:
            out = func(*args, **kwargs)
        finally:
            p.running = False
        if p.spoiled is not None:
            return out
        if isinstance(out, Tensor):
            call.outs.append(_made(p, out, fresh=getattr(func, "__name__", None) != "__get__"))
            if not call.grad:
                p._nograd.add(call.outs[0])
        elif isinstance(out, collections.abc.Iterator):
            p.spoil("a torch function returned an iterator, whose tensors no recorded call makes")
            return out
        elif out is not None:
            try:
                outs = optree.tree_leaves(out, none_is_leaf=True)
            except Exception:  # noqa: BLE001 (an output optree cannot take apart: a leaf)
                outs = [out]
            call.outs = [_made(p, t) if isinstance(t, Tensor) else -1 for t in outs]
            if not call.grad:
                p._nograd.update(s for s in call.outs if s >= 0)
            if all(s < 0 for s in call.outs):
                call.outs = []
        p.calls.append(call)
        return out
