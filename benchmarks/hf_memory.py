"""Memory retained between forward and backward by ``remat_modules`` on a Hugging Face GPT-2, and step time.

Workload: ``GPT2LMHeadModel`` with random weights (4 layers, n_embd 256, 4 heads, seq 128, batch 4,
vocabulary 1024, float32, eager attention, ``use_cache=False``, dropout 0), loss = the LM loss.
Configurations: no remat; ``remat.remat_modules(model, where=GPT2Block, policy=...)`` with save-nothing
and save-matmuls (``dots_saveable``); HF's own ``activation_checkpointing_enable()`` (formerly
``gradient_checkpointing_enable``: ``torch.utils.checkpoint``, non-reentrant) on the same blocks; and HF's method
called inside ``remat.route_torch_checkpoint(policy=...)``, which makes the layers checkpoint with remat.

* Retained: ``remat.bench.measure.live_bytes_after`` around the forward pass: the bytes of the storages
  that ops allocated in the forward pass and that are still alive when it ends (what is held for the
  backward pass), the loss excluded. A census from outside the library: it never asks remat what it holds.
* Time: forward + ``loss.backward()``, every configuration once per round (interleaved, so drift of a
  shared machine hits all alike), median over the rounds.
* Gradients: each configuration's parameter gradients compared bitwise with no remat's.

Usage::

    python benchmarks/hf_memory.py [--rounds 7] [--threads 2] [--layers 4 --embd 256 --heads 4 --seq 128 --batch 4]
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import remat
from remat import policies
from remat.bench.measure import MiB, live_bytes_after


def build(args: argparse.Namespace) -> tuple[dict[str, torch.nn.Module], torch.Tensor]:
    cfg = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.embd, n_head=args.heads, vocab_size=args.vocab, n_positions=args.seq,
        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).train()
    models: dict[str, torch.nn.Module] = {"no remat": base}
    for label, policy in [("remat_modules, save-nothing", policies.nothing_saveable),
                          ("remat_modules, save-matmuls", policies.dots_saveable)]:
        m = copy.deepcopy(base)
        remat.remat_modules(m, where=GPT2Block, policy=policy)
        models[label] = m
    hf = copy.deepcopy(base)
    hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    models["HF activation_checkpointing_enable (torch.utils.checkpoint)"] = hf
    for label, policy in [("HF's method routed to remat, save-nothing", policies.nothing_saveable),
                          ("HF's method routed to remat, save-matmuls", policies.dots_saveable)]:
        routed = copy.deepcopy(base)
        with remat.route_torch_checkpoint(policy=policy):  # the layers keep remat's checkpoint after the block
            routed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        models[label] = routed
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return models, ids


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: model(input_ids=ids, labels=ids).loss


def grads(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn(model, ids)().backward()
    return [p.grad.clone() for p in model.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    models, ids = build(args)

    want = grads(models["no remat"], ids)  # also the warm-up
    exact = {}
    for label, m in models.items():
        got = grads(m, ids)
        exact[label] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    retained = {}
    for label, m in models.items():
        m.zero_grad(set_to_none=True)
        gc.collect()
        loss, retained[label] = live_bytes_after(loss_fn(m, ids))
        loss.backward()
        del loss
    times: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(args.rounds):
        for label, m in models.items():
            m.zero_grad(set_to_none=True)
            gc.collect()
            t0 = time.perf_counter()
            loss_fn(m, ids)().backward()
            times[label].append(time.perf_counter() - t0)

    base_bytes, base_t = retained["no remat"], statistics.median(times["no remat"])
    print(f"GPT-2 {args.layers} layers, n_embd {args.embd}, {args.heads} heads, seq {args.seq}, batch {args.batch}, "
          f"vocab {args.vocab}, float32, eager attention; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {torch.get_num_threads()} threads, median of {args.rounds} rounds\n")
    print("| configuration | retained MiB | vs no remat | ms/step | vs no remat | grads bitwise = no remat |")
    print("|---|---:|---:|---:|---:|---|")
    for label in models:
        t = statistics.median(times[label])
        print(f"| {label} | {retained[label] / MiB:.1f} | {retained[label] / base_bytes:.2f} | {t * 1e3:.0f} | "
              f"{t / base_t:.2f}x | {'yes' if exact[label] else 'NO'} |")


if __name__ == "__main__":
    main()
