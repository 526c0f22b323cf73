"""remat under torch.distributed on CPU (gloo, two processes): collectives per step, memory per rank, time per step.

For each setting (FSDP2 with its hooks outside the remat'd region and inside it,
tensor parallel, pipeline parallel with GPipe, a Hugging Face GPT-2 under FSDP2
with ``remat_modules(model, "auto")``, FSDP2 and tensor parallel on a 2-D mesh of
four processes), runs the same float32 model
without remat, with remat (save-nothing, save-matmuls) and with
``torch.utils.checkpoint`` (the peer), and prints one table:

* collectives per step, counted by ``CommDebugMode`` around a step (all-gathers,
  reduce-scatters, all-reduces): remat must not gather parameters more often
  than the run without it, or than torch's checkpoint;
* MiB the forward pass's ops allocated that are still alive when it ends
  (retained for the backward pass), and the peak during the step, per rank (the
  larger of the two ranks), counted from outside by a dispatch mode around the
  step (``LiveCensus``); a pipeline's forward and backward passes interleave, so
  only its peak is shown;
* milliseconds per step (median of the timed steps; two processes share the
  machine's cores).

Usage::

    python benchmarks/distributed.py            # about a minute on 2 cores
    python benchmarks/distributed.py --steps 5 --batch 64
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import remat
from remat import policies
from remat.bench.measure import LiveCensus

VARIANTS = ["no remat", "remat save-nothing", "remat save-matmuls", "torch checkpoint"]
# (setting, processes): the 2-D mesh needs four
SETTINGS = [("FSDP2, hooks outside", 2), ("FSDP2, hooks inside", 2), ("tensor parallel", 2), ("pipeline (GPipe)", 2),
            ("Hugging Face GPT-2 + FSDP2", 2), ("FSDP2 + tensor parallel (2-D)", 4)]
POLICY = {"remat save-nothing": "save-nothing", "remat save-matmuls": policies.dots_saveable}


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)), approximate="tanh"))


class Net(nn.Module):
    def __init__(self, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(blocks))
        self.wrap: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x) if self.wrap is None else self.wrap(b, x)
        return x


def _step(fn: Any, comm: bool) -> tuple[dict[str, int], int, int, float]:
    """Run one step (``fn`` returns the loss, or None when it ran its own backward pass); its collectives, MiB
    retained after the forward pass, peak bytes, seconds."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode() if comm else None
    t0 = time.perf_counter()
    if mode is not None:
        mode.__enter__()
    try:
        with LiveCensus() as census:
            loss = fn()
            retained = census.live
            if loss is not None:
                loss.backward()
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    seconds = time.perf_counter() - t0
    counts = {}
    if mode is not None:
        for k, v in mode.get_comm_counts().items():
            key = str(k).lower()
            name = ("all_gather" if "gather" in key else "reduce_scatter" if "scatter" in key
                    else "all_reduce" if "reduce" in key else key)
            counts[name] = counts.get(name, 0) + v
    return counts, retained, census.peak, seconds


def run_setting(setting: str, variant: str, rank: int, args: argparse.Namespace, group: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    torch.manual_seed(0)
    world = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    x = torch.randn(args.batch, args.seq, args.dim, generator=torch.Generator().manual_seed(1 + rank))
    policy = POLICY.get(variant)
    if setting.startswith("Hugging Face"):
        import transformers
        from torch.distributed.fsdp import fully_shard

        cfg = transformers.GPT2Config(n_layer=args.blocks, n_embd=args.dim, n_head=4, vocab_size=1024,
                                      n_positions=args.seq, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg).train()
        for layer in model.transformer.h:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if policy is not None:
            remat.remat_modules(model, "auto", policy=policy)
        elif variant == "torch checkpoint":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(1 + rank))

        def fn() -> Any:
            return model(input_ids=ids, labels=ids).loss
    elif setting == "pipeline (GPipe)":
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        net = Net(args.dim, args.hidden, args.blocks)
        per = args.blocks // world
        stage_mod = nn.Sequential(*list(net.blocks)[rank * per:(rank + 1) * per])
        if policy is not None:
            for b in stage_mod:
                remat.remat_module(b, policy=policy)
        elif variant == "torch checkpoint":
            stage_mod = nn.Sequential(*[_TorchCheckpointed(b) for b in stage_mod])
        stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"), group=group)
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, y: out.pow(2).mean())
        xs = torch.randn(args.batch * 4, args.seq, args.dim)

        def fn() -> None:
            if rank == 0:
                schedule.step(xs)
            else:
                schedule.step(target=xs)
            return None
    else:
        net = Net(args.dim, args.hidden, args.blocks)
        if setting == "tensor parallel":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            for b in net.blocks:
                parallelize_module(b, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        elif setting.startswith("FSDP2 + tensor parallel"):
            from torch.distributed.device_mesh import DeviceMesh as Mesh
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh2 = Mesh("cpu", torch.arange(world).view(2, world // 2), mesh_dim_names=("dp", "tp"))
            for b in net.blocks:
                parallelize_module(b, mesh2["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
                fully_shard(b, mesh=mesh2["dp"])
            fully_shard(net, mesh=mesh2["dp"])
        else:
            from torch.distributed.fsdp import fully_shard

            for b in net.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(net, mesh=mesh)
        if policy is not None:
            if setting == "FSDP2, hooks inside":
                net.wrap = lambda b, x: remat.remat(lambda y: b(y), policy=policy)(x)
            else:
                for b in net.blocks:
                    remat.remat_module(b, policy=policy)
        elif variant == "torch checkpoint":
            if setting == "FSDP2, hooks outside":
                net.wrap = _call_forward_checkpointed
            else:
                net.wrap = lambda b, x: torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)

        def fn() -> torch.Tensor:
            return net(x).pow(2).mean()

    # (the first step: warm-up, and the one whose collectives are counted; a pipeline's stages send to each other
    # point to point, which CommDebugMode does not count)
    results = [_step(fn, comm=not setting.startswith("pipeline"))]
    results += [_step(fn, comm=False) for _ in range(args.steps)]
    return {"collectives": results[0][0], "retained": max(r[1] for r in results[1:]),
            "peak": max(r[2] for r in results[1:]), "ms": 1000 * statistics.median(r[3] for r in results[1:])}


class _TorchCheckpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _call_forward_checkpointed(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """torch's checkpoint of the block's forward only, FSDP2's hooks outside it (what Hugging Face's layers do): the
    module's hooks run around the call."""
    forward = block.forward
    block.forward = lambda y: torch.utils.checkpoint.checkpoint(forward, y, use_reentrant=False)  # type: ignore
    try:
        return block(x)
    finally:
        del block.forward


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        for setting, n in SETTINGS:
            if n != world:
                continue
            for variant in VARIANTS:
                group = dist.new_group(backend="gloo")
                t0 = time.perf_counter()
                try:
                    results[(setting, variant)] = run_setting(setting, variant, rank, args, group)
                except Exception as e:  # a row that fails says so; the others still run
                    results[(setting, variant)] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                if rank == 0:
                    print(f"  {setting}, {variant}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    by_world: dict[int, list[dict[Any, Any]]] = {}
    for world in sorted({n for _, n in SETTINGS}):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(worker, args=(world, port, args, out_dir), nprocs=world)
            by_world[world] = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    print(f"torch {torch.__version__}, gloo on the CPU, 2 processes (4 for the 2-D mesh), float32, {args.blocks} "
          f"blocks, dim {args.dim}, hidden {args.hidden}, batch {args.batch} x seq {args.seq} per rank (pipeline: 4 "
          f"microbatches of it; GPT-2: width dim, 4 heads, vocabulary 1024); {args.steps} timed steps")
    print()
    print("| setting | variant | all-gathers | reduce-scatters | all-reduces | retained MiB (max rank) | "
          "peak MiB (max rank) | ms/step | vs no remat |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
    for setting, world in SETTINGS:
        base = None
        ranks = by_world[world]
        for variant in VARIANTS:
            rows = [r[(setting, variant)] for r in ranks]
            err = next((r["error"] for r in rows if "error" in r), None)
            if err is not None:
                print(f"| {setting} | {variant} | {err} | | | | | | |")
                continue
            c = rows[0]["collectives"]
            ms = max(r["ms"] for r in rows)
            base = ms if variant == "no remat" else base
            retained = "–" if setting.startswith("pipeline") else f"{max(r['retained'] for r in rows) / 2**20:.2f}"
            ratio = f"{ms / base:.2f}x" if base else "–"
            print(f"| {setting} | {variant} | {c.get('all_gather', 0)} | {c.get('reduce_scatter', 0)} | "
                  f"{c.get('all_reduce', 0)} | {retained} | {max(r['peak'] for r in rows) / 2**20:.2f} | {ms:.1f} | "
                  f"{ratio} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
