"""Generation sessions: ``generate`` from a training engine at every ZeRO stage.

[Note: generating under ZeRO-3]
Decoding runs one forward per token. Left to the unit hooks, ZeRO-3 gathers every unit before
each of those forwards and frees it after (one collective per unit per token), and because
every gather is a collective, all ranks must run the same number of forwards. A *generation
session* brackets one ``generate`` call (``engine.generate(...)`` or ``engine.module.generate(...)``)
and picks one of two ways:

- ``gather_once``: every unit is gathered once at the start (one all-gather per unit, in the
  same order on every rank) and held (partita/zero/holds.py) until the call returns. The forwards
  in between run no collective at all: ranks may generate different numbers of tokens (different
  prompts, EOS at different steps) without waiting for each other. Costs the whole model's
  bytes, on top of the shards, for the duration of the call.
- ``stream``: units are gathered per forward as in any eval forward, with the next units'
  gathers (and host-to-device copies of offloaded shards) started while the current one runs
  (partita/zero/eval_prefetch.py). Costs only ``stage3_prefetch_bucket_size`` elements of extra
  memory, but every rank must run every forward: at world size > 1 a Hugging Face model's (or the
  reference GPT's) ``generate`` gets ``synced_gpus=True`` unless the caller set it.

``zero_optimization.stage3_generation`` picks: "gather_once", "stream", or "auto" (the default):
gather once when the bytes still to gather, plus a reserve for the KV cache and activations,
fit in this rank's free memory (the accelerator's free bytes, ``torch.cuda.mem_get_info`` plus
what torch's allocator caches unused; on a CPU run the host's MemAvailable split between the
node's ranks), on *every* rank (one small all-reduce of the least spare bytes per call, so all
ranks choose alike). Otherwise "auto" streams, but first holds for the call as many units as
fit (in unit order, the same on every rank) beside the streaming window (the prefetched
elements, at most what streams, plus twice the largest unit: the one being gathered and its
transient buffer): those are gathered once, only the rest are gathered per token. A forced
"stream" holds none.
The reserve is the KV cache the call can grow to, computed from the model's config when it has
one (layers x 2 x batch x (prompt + new tokens) x kv heads x head dim x element size), plus a
margin of 10% of the model's gathered bytes and at least 256 MiB for activations and logits.
The choice is logged on rank 0 when it changes ("ZeRO-3 generate: gathered once (X GiB)" or
"ZeRO-3 generate: streaming ...").

Stages 0-2 and tensor parallelism need no gathering: the weights (or this rank's tensor shard of
them) are whole already; ``generate`` runs the module's as it is. The session still runs
generation under ``torch.no_grad()`` (a training forward with autograd would take the training
paths: per-forward rank checks, gradient hooks) and, when the model's own forwards run
collectives (tensor or sequence parallelism, experts spread over ranks) at world size > 1,
passes ``synced_gpus=True`` to Hugging Face models and the reference GPT at every stage: every
rank of those groups must run every forward.

[Note: the module's generate attribute]
``engine.module.generate(...)`` is the call TRL, OpenRLHF and most RLHF loops make. A method of
the model's class cannot be overridden for one model without changing its class (which breaks
pickling of the model and ``isinstance`` checks by exact type), so the engine sets one
*instance* attribute, ``module.generate``, to a :class:`SessionGenerate`: it runs the class's
own ``generate`` inside a session. It is no parameter, buffer or submodule, so ``state_dict`` is
unchanged; pickled or deep-copied, it comes back as a plain pass-through to the class's
``generate`` (it holds its engine only by weak reference and pickles without it); and
``engine.destroy()`` removes it (restoring an instance attribute that was there before).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

from partita.distributed import collectives
from partita.offload.capacity import host_available_bytes, local_ranks
from partita.zero.holds import HeldParameters

logger = logging.getLogger("partita")

GIB = 2**30
_MIN_RESERVE = 256 * 2**20
GATHER_ONCE, STREAM = "gather_once", "stream"

__all__ = ["GATHER_ONCE", "STREAM", "GenerationSessions", "SessionGenerate", "install_generate", "uninstall_generate"]


class GenerationSessions:
    """One engine's generation sessions (see [Note: generating under ZeRO-3])."""

    def __init__(self, *, module: nn.Module, zero, topology, mode: str = "auto", static_decoding=None) -> None:
        self._module = module
        # generation.cuda_graph: partita/inference/rollouts.py's RolloutDecoding (given by the engine, which
        # sits above both packages), used for calls whose forwards run no collective.
        self._static_decoding = static_decoding
        self._zero = zero
        self._topology = topology
        self._mode = mode
        self._depth = 0  # engine.generate calls the wrapped module.generate: one session, not two
        self.last_mode: str | None = None  # what the last ZeRO-3 session did (tests, observability)
        self.held_units = 0  # units the last ZeRO-3 session held for the whole call
        self._logged: tuple | None = None

    def run(self, generate: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``generate(*args, **kwargs)`` inside a session (every rank calls it)."""
        if self._depth:
            return generate(*args, **kwargs)
        self._depth += 1
        try:
            with torch.no_grad(), self._session(args, kwargs) as (kwargs, quiet):
                decode = self._static_decoding.prepare(args, kwargs) if quiet and self._static_decoding else None
                if decode is None:
                    return generate(*args, **kwargs)
                with _inert_hooks(self._zero.gatherer):
                    return decode()
        finally:
            self._depth -= 1

    @contextlib.contextmanager
    def _session(self, args: tuple, kwargs: dict) -> Iterator[dict]:
        gatherer = self._zero.gatherer
        multi = self._topology.world_size > 1
        # Collectives inside every forward (tensor or sequence parallelism, expert all-to-alls): every
        # rank must run every forward, whatever ZeRO does.
        lockstep = multi and (self._topology.tensor_size > 1 or self._topology.sequence_size > 1
                              or _has_expert_parallelism(self._module))
        syncable = _takes_synced_gpus(self._module)
        # Yields the call's kwargs and whether its forwards run no collective (the static-cache loop
        # may serve it: it runs one forward per token on this rank alone).
        if gatherer is None:
            yield ({"synced_gpus": True, **kwargs} if syncable and lockstep else kwargs), not lockstep
            return
        mode, held = self._choose(gatherer, args, kwargs)
        self.last_mode, self.held_units = mode, len(held)
        hold = HeldParameters(gatherer, [p for params in held for p in params])
        hold.start()  # one all-gather per unit: a unit's transient buffer, not the model's
        try:
            if mode == STREAM:  # the units not held are gathered by every forward: a collective
                yield ({"synced_gpus": True, **kwargs} if syncable and multi else kwargs), False
            else:  # no collective per token from ZeRO: ranks may finish apart (unless the model's own forwards sync)
                yield ({"synced_gpus": lockstep, **kwargs} if syncable else kwargs), not lockstep
        finally:
            hold.end()

    def _choose(self, gatherer, args: tuple, kwargs: dict) -> tuple[str, list[list[nn.Parameter]]]:
        """The mode, and the units (their parameters) held for the call: all of them gathered once;
        streaming: none when forced, else as many as fit beside the streaming window."""
        units = [params for params in gatherer.unit_params().values() if params]
        missing = _bytes_to_gather(gatherer)
        if self._mode != "auto":
            self._log(self._mode, missing, None, None, forced=True, held=0, units=len(units))
            return self._mode, units if self._mode == GATHER_ONCE else []
        device = gatherer.storage.device
        free = _free_bytes(device)
        reserve = _reserve_bytes(self._module, args, kwargs, missing)
        spare = torch.tensor([float(free - reserve)], dtype=torch.float64, device=device)
        if self._topology.world_size > 1:  # every rank must choose alike (gathers are collectives): the least spare
            collectives.all_reduce(spare, group=None, op=torch.distributed.ReduceOp.MIN,
                                   purpose="ZeRO-3 generate: gather once or stream")
        budget = int(spare.item())
        elsewhere = missing + reserve <= free
        if missing <= budget:
            self._log(GATHER_ONCE, missing, free, reserve, forced=False, held=len(units), units=len(units))
            return GATHER_ONCE, units
        held = _units_beside_window(gatherer, units, budget)
        self._log(STREAM, missing, free, reserve, forced=False, elsewhere=elsewhere, held=len(held), units=len(units))
        return STREAM, held

    def _log(self, mode: str, missing: int, free: int | None, reserve: int | None, *, forced: bool, held: int,
             units: int, elsewhere: bool = False) -> None:
        key = (mode, forced, held)
        if key == self._logged or self._topology.rank != 0:
            return
        self._logged = key
        why = ("zero_optimization.stage3_generation" if forced else
               f"{_size(free)} free, {_size(reserve)} reserved for KV cache and activations"
               + ("; it fits here but not on another rank" if elsewhere else ""))
        if mode == GATHER_ONCE:
            logger.info("ZeRO-3 generate: gathered once (%s) and held for the whole call (%s)", _size(missing), why)
        else:
            logger.info("ZeRO-3 generate: streaming %d of %d units with prefetch, %d held for the whole call (the whole "
                        "model, %s, is not gathered: %s)", units - held, units, held, _size(missing), why)


def _units_beside_window(gatherer, units: list[list[nn.Parameter]], budget: int) -> list[list[nn.Parameter]]:
    """Units (in the gatherer's order, the same on every rank) to hold while the rest stream: as
    many as fit in ``budget`` bytes next to the streaming window (the prefetched elements, at most
    what streams, plus the largest unit being gathered with its transient buffer)."""
    sizes = [sum(_missing_bytes(gatherer, p) for p in params) for params in units]
    element = max((p.element_size() for params in units for p in params), default=1)
    window = min(gatherer.prefetch_numel * element, sum(sizes)) + 2 * max(sizes, default=0)
    held, used = [], 0
    for params, size in zip(units, sizes):
        if used + size + window > budget:
            break
        held.append(params)
        used += size
    return held


def _bytes_to_gather(gatherer) -> int:
    """Bytes of the sharded parameters not whole now (a gather makes them whole)."""
    return sum(_missing_bytes(gatherer, p) for params in gatherer.unit_params().values() for p in params)


def _missing_bytes(gatherer, param: nn.Parameter) -> int:
    return 0 if gatherer.is_gathered(param) else param.numel() * param.element_size()


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return host_available_bytes() // local_ranks()  # a CPU run: host memory is the device's


def _reserve_bytes(module: nn.Module, args: tuple, kwargs: dict, model_bytes: int) -> int:
    """KV cache the call can grow to (from the model's config, when it has one) plus a margin."""
    margin = max(_MIN_RESERVE, model_bytes // 10)
    config = getattr(module, "config", None)
    ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args and isinstance(args[0], torch.Tensor) else None))
    if config is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return margin
    layers = _first_int(config, "num_hidden_layers", "n_layer")
    heads = _first_int(config, "num_attention_heads", "n_head")
    kv_heads = _first_int(config, "num_key_value_heads") or heads
    hidden = _first_int(config, "hidden_size", "n_embd")
    head_dim = _first_int(config, "head_dim") or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim):
        return margin
    generation = kwargs.get("generation_config") or getattr(module, "generation_config", None)
    new = kwargs.get("max_new_tokens") or getattr(generation, "max_new_tokens", None)
    length = ids.shape[1] + new if new else kwargs.get("max_length") or getattr(generation, "max_length", 0) or 0
    length = max(length, ids.shape[1])
    element = next(module.parameters()).element_size()
    return 2 * layers * ids.shape[0] * length * kv_heads * head_dim * element + margin


@contextlib.contextmanager
def _inert_hooks(gatherer) -> Iterator[None]:
    """Every unit is held: the gatherer's hooks have nothing to do while the static-cache loop runs,
    and a compiled decode step must not trace them (they read autograd state dynamo cannot)."""
    if gatherer is None:
        yield
        return
    gatherer.hooks_inert = True
    try:
        yield
    finally:
        gatherer.hooks_inert = False


def _first_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _has_expert_parallelism(module: nn.Module) -> bool:
    """A partita MoE layer with experts spread over ranks: its forward runs all-to-alls."""
    moe = getattr(sys.modules.get("partita.moe.layer"), "MoE", None)
    return moe is not None and any(isinstance(m, moe) and m.ep_size > 1 for m in module.modules())


def _takes_synced_gpus(module: nn.Module) -> bool:
    """Hugging Face's GenerationMixin and the reference GPT (partita/models/gpt_generate.py) take
    ``synced_gpus``; only those are passed it (looked up without importing either)."""
    for module_name, class_name in (("transformers", "GenerationMixin"), ("partita.models.gpt", "GPT")):
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and isinstance(module, cls):
            return True
    return False


# ---------------------------------------------------------------------- module.generate
class SessionGenerate:
    """The ``generate`` instance attribute of an engine's module (see [Note: the module's
    generate attribute]): the class's ``generate`` (or the attribute it replaced), in a session."""

    def __init__(self, module: nn.Module, sessions: GenerationSessions | None, replaced: Any = None) -> None:
        self._module = module
        self._sessions = weakref.ref(sessions) if sessions is not None else None
        self._replaced = replaced  # an instance attribute ``generate`` set before the engine's

    def _plain(self) -> Callable[..., Any]:
        if self._replaced is not None:
            return self._replaced
        return type(self._module).generate.__get__(self._module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sessions = self._sessions() if self._sessions is not None else None
        if sessions is None:
            return self._plain()(*args, **kwargs)
        return sessions.run(self._plain(), args, kwargs)

    def __reduce__(self):
        # Pickled or deep-copied with its module: a pass-through without the engine (which holds
        # process groups and cannot travel), so the copy generates as a plain model.
        return SessionGenerate, (self._module, None, self._replaced)

    def __repr__(self) -> str:
        return f"<partita generation session around {type(self._module).__name__}.generate>"


def install_generate(module: nn.Module, sessions: GenerationSessions) -> SessionGenerate | None:
    """Set ``module.generate`` to a :class:`SessionGenerate` (None when the module has none)."""
    if not callable(getattr(module, "generate", None)):
        return None
    replaced = module.__dict__.get("generate")
    if isinstance(replaced, SessionGenerate):  # a second engine over the same module: replace the first's
        replaced = replaced._replaced
    wrapper = SessionGenerate(module, sessions, replaced)
    module.__dict__["generate"] = wrapper
    return wrapper


def uninstall_generate(module: nn.Module, wrapper: SessionGenerate | None) -> None:
    """Undo :func:`install_generate` (engine.destroy); a later replacement is left alone."""
    if wrapper is None or module.__dict__.get("generate") is not wrapper:
        return
    if wrapper._replaced is not None:
        module.__dict__["generate"] = wrapper._replaced
    else:
        del module.__dict__["generate"]
