"""Engine names of the throughput suite (benchmarks/gpu_throughput.py) and which peer each
engine is compared with.

A name is ``<family>[<stage>][c][-off|-offd|-offo|-offdo][16]``:

- family ``torch`` (plain torch; DDP on several ranks), ``fsdp2`` (``fully_shard`` per block),
  ``partita<stage>`` or ``deepspeed<stage>`` with a ZeRO stage 0-3;
- a trailing ``c`` compiles each transformer block with ``torch.compile`` (not for DeepSpeed:
  the suite has no compiled DeepSpeed variant);
- ``-off`` offloads the optimizer to CPU memory (partita and DeepSpeed), ``-offd`` adds
  partita's one-step-delayed update, ``-offo`` partita's exact step overlapped with the next
  forward (``overlap_step_with_forward``), ``-offdo`` the delayed update landing beside the next
  forward (both keys; all three partita only);
- a trailing ``16`` on an offload suffix (``-off16``, ``-offdo16``, ...; partita only) adds
  ``offload_optimizer.host_step_16bit_grads``: the gradient partition stays bf16 in host memory
  and the host AdamW reads it directly (issue 33 item 5).

Kept apart from the worker so that the naming and peer rules can be tested without a GPU and
without launching anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FAMILIES = ("torch", "fsdp2", "partita", "deepspeed")
STAGED = ("partita", "deepspeed")

# family, optional stage digit, optional "c", optional "-off"/"-offd".
_NAME = re.compile(r"^(?P<family>torch|fsdp2|partita|deepspeed)(?P<stage>\d)?(?P<compiled>c)?(?P<offload>-off\w*)?$")


class EngineNameError(ValueError):
    """An engine name the suite does not know; the message names the value and the fix."""


@dataclass(frozen=True)
class EngineSpec:
    """What one engine name asks for."""

    name: str
    family: str
    stage: int | None
    compiled: bool
    offload: str | None  # None, "cpu" ("-off"), "delayed" ("-offd"), "overlap" ("-offo"), "delayed-overlap" ("-offdo")
    host_16bit_grads: bool = False  # the offload suffix ends in "16": offload_optimizer.host_step_16bit_grads


def parse_engine(name: str) -> EngineSpec:
    """Split an engine name into its parts; raise :class:`EngineNameError` for anything the
    worker could not run, before any process is launched."""
    hint = ("use torch, fsdp2, partita0..partita3 or deepspeed0..deepspeed3, with an optional 'c' "
            "(torch.compile per block; not deepspeed) and, for partita/deepspeed, '-off' "
            "(optimizer offload to CPU; partita also '-offd', delayed update, '-offo', step overlapped with the forward, "
            "'-offdo' both, and a trailing '16' on any of them: the host step reads 16-bit gradients)")
    match = _NAME.match(name)
    if match is None:
        raise EngineNameError(f"unknown engine {name!r}: {hint}")
    family, stage_text = match["family"], match["stage"]
    compiled, offload_text = match["compiled"] is not None, match["offload"]
    host_16bit_grads = offload_text is not None and offload_text.endswith("16")
    if host_16bit_grads:
        offload_text = offload_text[: -len("16")]
    if family in STAGED:
        if stage_text is None or int(stage_text) > 3:
            raise EngineNameError(f"engine {name!r} needs a ZeRO stage 0-3 after {family!r}, e.g. {family}2")
    elif stage_text is not None:
        raise EngineNameError(f"engine {name!r}: {family} takes no ZeRO stage; {hint}")
    offload = {None: None, "-off": "cpu", "-offd": "delayed", "-offo": "overlap", "-offdo": "delayed-overlap"}.get(
        offload_text, "bad")
    if offload == "bad":
        raise EngineNameError(f"engine {name!r}: unknown offload suffix {offload_text!r} (use -off, -offd, -offo or -offdo)")
    if offload is not None and family not in STAGED:
        raise EngineNameError(f"engine {name!r}: only partita and deepspeed engines offload; drop {offload_text!r}")
    if family == "deepspeed" and compiled:
        raise EngineNameError(f"engine {name!r}: the suite has no compiled DeepSpeed variant; use deepspeed{stage_text}")
    if family == "deepspeed" and offload in ("delayed", "overlap", "delayed-overlap"):
        raise EngineNameError(f"engine {name!r}: {offload_text!r} is partita's; use deepspeed{stage_text}-off")
    if family == "deepspeed" and host_16bit_grads:
        raise EngineNameError(f"engine {name!r}: the '16' suffix (host_step_16bit_grads) is partita's; "
                              f"use deepspeed{stage_text}-off")
    return EngineSpec(name=name, family=family, stage=None if stage_text is None else int(stage_text),
                      compiled=compiled, offload=offload, host_16bit_grads=host_16bit_grads)


def suite_engines(*, offload: bool) -> list[str]:
    """The issue's full side-by-side list: plain torch and FSDP2 (eager and compiled), partita at
    every ZeRO stage (eager and compiled), DeepSpeed at every stage; with ``offload`` also the
    optimizer-offload engines at stage 2."""
    names = ["torch", "torchc", "fsdp2", "fsdp2c"]
    names += [f"partita{s}" for s in range(4)] + [f"partita{s}c" for s in range(4)]
    names += [f"deepspeed{s}" for s in range(4)]
    if offload:
        names += ["partita2-off", "partita2-offd", "deepspeed2-off"]
    return names


# The ratio columns of the table, in order: column key -> what it compares against.
PEER_COLUMNS = ("fsdp2", "deepspeed", "torch")


def peer_of(spec: EngineSpec, column: str) -> str | None:
    """The engine a row is compared with in one ratio column, or None when the comparison does
    not apply (a row is never compared with itself or with its own family).

    Like is compared with like: a compiled engine with the compiled peer (``partita2c`` with
    ``fsdp2c`` / ``torchc``); an offload engine with DeepSpeed's offload at the same stage. There
    is no compiled DeepSpeed here, so compiled rows have no DeepSpeed ratio rather than one that
    mixes compiled and eager code.
    """
    if column not in PEER_COLUMNS:
        raise ValueError(f"unknown peer column {column!r}; the columns are {PEER_COLUMNS}")
    if spec.family == column:
        return None
    if column == "deepspeed":
        if spec.stage is None or spec.compiled:
            return None
        return f"deepspeed{spec.stage}" + ("-off" if spec.offload else "")
    return column + ("c" if spec.compiled else "")
