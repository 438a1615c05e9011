"""What the multi-rank examples share: the data, the tiny model, the single-process reference and
the printed verdict. Each example (``partita run --nproc 2 examples/<name>.py``) trains a tiny
model for a few steps with one parallelism and then checks its losses against plain PyTorch in
one process (the same initial weights, the same global batches, ``torch.optim.AdamW``).

Not an example itself (the leading underscore); the examples import it from their own folder,
which Python puts on ``sys.path`` when it runs a script.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partita.data import load_corpus
from partita.models import GPT, GPTConfig

SEQ = 32
LR = 3e-3
CLIP = 1.0  # the global gradient norm is clipped to 1 (partita's default, as DeepSpeed's examples set it)
# fp32 everywhere; what is left is the order of floating-point sums (a sharded reduction adds the
# ranks' halves, one process adds the whole), a few 1e-7 per step, growing slowly with the steps.
TOLERANCE = 1e-5
# The first MiB of the standard library's sources: the same bytes on every rank, read in well
# under a second (the whole corpus is ~30 MB and is not needed for a few steps).
CORPUS_BYTES = 1 << 20


def parse_args(doc: str, argv: Sequence[str] | None, *, steps: int = 8,
               more: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The options every example takes; ``more`` adds an example's own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="sequences per optimizer step, over all ranks")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the single-process PyTorch run the losses are compared with")
    if more is not None:
        more(parser)
    return parser.parse_args(argv)


def corpus_batches(steps: int, batch: int, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    """``steps`` global batches of byte windows from the stdlib corpus, ``[steps, batch, seq + 1]``
    (inputs are ``[..., :-1]``, next-byte targets ``[..., 1:]``). Drawn from a seeded generator,
    so every rank holds the same batches and takes its own rows of them."""
    tokens = torch.from_numpy(load_corpus(max_bytes=CORPUS_BYTES)[:].astype("int64"))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq - 1, (steps, batch), generator=g)
    return tokens[starts[..., None] + torch.arange(seq + 1)]


def tiny_gpt(seed: int = 0, **config) -> GPT:
    """A 2-block GPT over bytes (~30k parameters), built under ``seed``: every rank the same weights."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, **config))


def adamw_config(train_batch_size: int, **more) -> dict:
    """The DeepSpeed-style config the examples share: fp32, AdamW without weight decay, clipping at 1."""
    return {"train_batch_size": train_batch_size, "steps_per_print": 10_000, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}, **more}


def snapshot(model: nn.Module) -> nn.Module:
    """A copy of the model as built, taken before ``initialize`` shards or splits it."""
    return copy.deepcopy(model)


def reference_losses(model: nn.Module, batches: torch.Tensor, device: torch.device,
                     loss_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> list[float]:
    """Plain PyTorch in this process on the engine's device (the same kernels): the whole global
    batch per step, the gradient norm clipped, ``torch.optim.AdamW``."""
    loss_of = loss_of or (lambda m, x, y: m(x, y)[1])
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for batch in batches.to(device):
        loss = loss_of(model, batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses


def mean_over(value: torch.Tensor, group) -> float:
    """The mean of a scalar over ``group`` (the data-parallel ranks, each with its own rows)."""
    value = value.detach().clone().float()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return value.item()


def report(name: str, losses: list[float], reference: list[float] | None, *, is_main: bool) -> dict:
    """Print the losses and the verdict on rank 0; return them (the tests read this)."""
    diff = None if reference is None else max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    if is_main:
        print(f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps", flush=True)
        if diff is not None:
            verdict = "equal" if diff <= TOLERANCE else "DIFFER FROM"
            print(f"{name}: losses {verdict} a single-process PyTorch run (max relative difference {diff:.1e}, "
                  f"tolerance {TOLERANCE:.0e})", flush=True)
    return {"losses": losses, "reference": reference, "max_relative_difference": diff}


def exit_code(summary: dict) -> int:
    """0 when the run matched its reference (or had none), 1 otherwise: a script's checkable result."""
    diff = summary["max_relative_difference"]
    return 0 if diff is None or diff <= TOLERANCE else 1
