"""``CompiledForward``: a block's torch.compile'd forward, with its recompiles made visible.

Why the block's *forward* and not ``nn.Module.compile()``: ``module.compile()`` compiles the
module's ``_call_impl``, so TorchDynamo traces the module's forward hooks as well. ZeRO-3's
hooks all-gather parameters, resize their storage and keep Python dicts keyed by parameters;
traced, they break the graph at every call, and with torch 2.13 building a guard on those
dicts reads a freed parameter and crashes the process (tested: segmentation fault at the first
forward). An instance attribute ``forward`` holding the compiled function instead keeps
``_call_impl`` and every hook in eager Python, around the compiled region; the block keeps its
identity, its class and its ``state_dict`` keys (the same trick as activation checkpointing).

Visibility: TorchDynamo caches compiled graphs per code object, shared by every block of one
class, and recompiles silently when a guard fails (a new input shape, a changed attribute),
up to ``torch._dynamo.config.recompile_limit`` graphs, after which it runs the code eagerly
(logging one warning). Each call here compares TorchDynamo's count of graphs built before and
after; a graph built for a block that already compiled once in the same grad mode and
train/eval mode is a recompile and is logged with torch's reason, and graph breaks are logged
once per block, so a run that lost its compiled speed says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Callable

import torch

logger = logging.getLogger("partita")


@dataclass(frozen=True)
class CompileSettings:
    """What a block was compiled with: torch.compile's backend and keyword arguments."""

    backend: Any
    kwargs: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        backend = self.backend
        if not isinstance(backend, str):
            backend = getattr(backend, "__name__", repr(backend))
        extra = "".join(f", {k}={v!r}" for k, v in sorted(self.kwargs.items()))
        return f"backend={backend!r}{extra}"


@dataclass
class CompileStats:
    """Per block: graphs TorchDynamo built during its calls, how many were recompiles, graph breaks."""

    graphs: int = 0
    recompiles: int = 0
    graph_breaks: int = 0


def _graphs_cached(code: CodeType | None) -> int | None:
    """Graphs TorchDynamo holds for ``code`` (the recompile limit counts these), None if unknown."""
    if code is None:
        return None
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # private, present since torch 2.1

        return len(_debug_get_cache_entry_list(code))
    except (ImportError, AttributeError, TypeError):
        return None


def _dynamo_counters() -> Any:
    from torch._dynamo.utils import counters  # private but present in every torch 2.x

    return counters


class CompiledForward:
    """The instance-level ``forward`` of a compiled block (or the inner function of a
    checkpointed one): calls the compiled function and watches for recompiles."""

    def __init__(self, original: Callable[..., Any], *, name: str, settings: CompileSettings) -> None:
        self.original = original
        self.name = name
        self.settings = settings
        self.compiled = torch.compile(original, backend=settings.backend, **settings.kwargs)
        self.stats = CompileStats()
        self._contexts: set[tuple[bool, bool]] = set()  # (grad enabled, training) seen so far
        self._warned_breaks = False
        self._code: CodeType | None = getattr(getattr(original, "__func__", original), "__code__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        counters = _dynamo_counters()
        graphs_before = counters["stats"]["unique_graphs"]
        breaks_before = dict(counters["graph_break"])  # usually empty: a cheap copy
        out = self.compiled(*args, **kwargs)
        built = counters["stats"]["unique_graphs"] - graphs_before
        if built:
            new_breaks = {r: n - breaks_before.get(r, 0) for r, n in counters["graph_break"].items()}
            self._account(built, {r: n for r, n in new_breaks.items() if n > 0})
        return out

    def _account(self, built: int, breaks: dict[str, int]) -> None:
        owner = getattr(self.original, "__self__", None)
        context = (torch.is_grad_enabled(), bool(getattr(owner, "training", True)))
        self.stats.graphs += built
        # The first call in a new (grad mode, train/eval) context compiles by design (a graph
        # break makes that several graphs); any graph built later in a known context is a recompile.
        expected = 0 if context in self._contexts else built
        self._contexts.add(context)
        if breaks:
            self.stats.graph_breaks += sum(breaks.values())
            if not self._warned_breaks:
                self._warned_breaks = True
                reasons = [r.strip().splitlines()[0] for r in breaks]
                logger.warning(
                    "compile: block %s has %d graph break(s), so it runs as several graphs with Python in "
                    "between (slower); set compile.fullgraph to true to turn them into errors. Reasons: %s",
                    self.name, sum(breaks.values()), "; ".join(reasons),
                )
        if built > expected:
            self.stats.recompiles += built - expected
            self._warn_recompile(built)

    def _warn_recompile(self, built: int) -> None:
        """Log the recompile with TorchDynamo's reasons: one per graph it already had for this code."""
        from torch._dynamo import config as dynamo_config

        limit = getattr(dynamo_config, "recompile_limit", None) or getattr(dynamo_config, "cache_size_limit", 8)
        cached = _graphs_cached(self._code)
        graphs = cached if cached is not None else self.stats.graphs
        previous = max(graphs - built, 0)
        reasons = ""
        try:
            from torch._dynamo.utils import guard_failures

            failures = guard_failures.get(self._code, []) if self._code is not None and previous else []
            if failures:
                shown = [str(f).strip().splitlines()[0] for f in failures[-previous:]][:3]
                reasons = " Guard failures: " + "; ".join(shown) + "."
        except ImportError:  # older torch: no reasons; the warning still says what happened
            pass
        code = self._code
        where = self.name
        if code is not None:
            where = f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{code.co_firstlineno})"
        if graphs >= limit:
            outlook = (f"That is torch._dynamo.config.recompile_limit ({limit}): inputs that match none of these "
                       "graphs now run eagerly, uncompiled.")
        else:
            outlook = (f"At torch._dynamo.config.recompile_limit ({limit}) graphs torch stops compiling it and runs "
                       "new cases eagerly.")
        logger.warning(
            "compile: torch.compile recompiled block %s (recompile %d of this block; %s now has %d compiled "
            "graphs, shared by every block running that code).%s %s TORCH_LOGS=recompiles shows every "
            "recompile; input shapes that vary need compile.dynamic true.",
            self.name, self.stats.recompiles, where, graphs, reasons, outlook,
        )
