"""The flops profiler (``flops_profiler``): parameters, FLOPs, MACs and latency per module.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode``, which counts the matmul,
convolution and attention ops at the dispatcher (2 FLOPs per multiply-add; elementwise ops,
norms and softmax are not counted) and attributes them to the module that ran them. So
MACs = FLOPs / 2. It misses the fused CPU attention kernel, which this module adds with
torch's own SDPA formulas so CPU and GPU runs count alike.

Latency per module comes from forward hooks that synchronise the device around each module;
that slows the profiled step, which is why the profiler measures one step only
(``profile_step``) and leaves every other step alone. The backward pass is counted as a
whole (measured, not assumed 2× the forward as DeepSpeed does).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode


def _cpu_sdpa_mapping() -> dict[Any, Callable[..., int]]:
    aten = torch.ops.aten
    mapping: dict[Any, Callable[..., int]] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = (
            lambda query, key, value, *args, out_shape=None, **kwargs: flop_counter.sdpa_flop_count(
                query, key, value
            )
        )
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
            lambda grad_out, query, key, value, *args, out_shape=None, **kwargs: flop_counter.sdpa_backward_flop_count(
                grad_out, query, key, value
            )
        )
    return mapping


def flop_counter_mode() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts CPU fused attention."""
    return FlopCounterMode(display=False, custom_mapping=_cpu_sdpa_mapping())


@dataclass(frozen=True, slots=True)
class ModuleStats:
    """One module's share of the profiled forward pass."""

    name: str  # dotted path in the model; "" for the model itself
    class_name: str
    depth: int  # 0 for the model itself
    params: int
    flops: int
    latency_s: float

    @property
    def macs(self) -> int:
        return self.flops // 2


@dataclass(frozen=True)
class FlopsProfile:
    """What one profiled step measured (forward per module, backward and step as totals)."""

    modules: tuple[ModuleStats, ...]
    forward_flops: int
    backward_flops: int
    forward_latency_s: float
    backward_latency_s: float
    step_latency_s: float | None = None
    iteration_latency_s: float | None = None
    global_step: int | None = None

    @property
    def params(self) -> int:
        return self.modules[0].params if self.modules else 0

    @property
    def forward_macs(self) -> int:
        return self.forward_flops // 2

    @property
    def train_flops(self) -> int:
        """Forward + backward FLOPs of the profiled micro-batch."""
        return self.forward_flops + self.backward_flops

    def format(self, *, module_depth: int = -1, top_modules: int = 1, detailed: bool = True) -> str:
        """The report DeepSpeed's profiler prints, in partita's words."""
        root = self.modules[0] if self.modules else None
        lines = ["-" * 30 + " partita flops profiler " + "-" * 30]
        if self.global_step is not None:
            lines.append(f"{'profiled step:':<36}{self.global_step + 1} (one micro-batch's forward and backward)")
        lines += [
            f"{'params:':<36}{_num(self.params)}",
            f"{'forward FLOPs / MACs:':<36}{_num(self.forward_flops, 'FLOP')} / {_num(self.forward_macs, 'MAC')}",
            f"{'backward FLOPs:':<36}{_num(self.backward_flops, 'FLOP')}"
            + (f" ({self.backward_flops / self.forward_flops:.2f} x forward)" if self.forward_flops else ""),
            f"{'forward latency:':<36}{_ms(self.forward_latency_s)}{_rate(self.forward_flops, self.forward_latency_s)}",
            f"{'backward latency:':<36}{_ms(self.backward_latency_s)}{_rate(self.backward_flops, self.backward_latency_s)}",
        ]
        if self.step_latency_s is not None:
            lines.append(f"{'optimizer step latency:':<36}{_ms(self.step_latency_s)}")
        if self.iteration_latency_s is not None:
            lines.append(f"{'whole step latency:':<36}{_ms(self.iteration_latency_s)}")
        lines.append(
            "FLOPs: matmul, convolution and attention ops (torch.utils.flop_counter), 2 per multiply-add; "
            "elementwise ops are not counted."
        )
        shown = [m for m in self.modules if module_depth < 0 or m.depth <= module_depth]
        lines.append(f"\ntop {top_modules} module type(s) per depth by forward FLOPs:")
        by_depth: dict[int, dict[str, list[ModuleStats]]] = defaultdict(lambda: defaultdict(list))
        for stats in shown:
            by_depth[stats.depth][stats.class_name].append(stats)
        for depth in sorted(by_depth):
            ranked = sorted(by_depth[depth].items(), key=lambda kv: -sum(m.flops for m in kv[1]))[:top_modules]
            parts = [
                f"{cls} x{len(ms)}: {_num(sum(m.params for m in ms))} params, {_num(sum(m.macs for m in ms), 'MAC')}, "
                f"{_ms(sum(m.latency_s for m in ms))}"
                for cls, ms in ranked
            ]
            lines.append(f"  depth {depth}: " + "; ".join(parts))
        if detailed and root is not None:
            lines.append("\nmodule tree (forward; share of the model's params / FLOPs / latency):")
            for stats in shown:
                label = stats.name.rsplit(".", 1)[-1] if stats.name else stats.class_name
                lines.append(
                    f"{'  ' * stats.depth}{label} ({stats.class_name}): {_num(stats.params)} params "
                    f"{_pct(stats.params, root.params)}, {_num(stats.macs, 'MAC')} {_pct(stats.flops, root.flops)}, "
                    f"{_ms(stats.latency_s)} {_pct(stats.latency_s, root.latency_s)}"
                )
        lines.append("-" * 84)
        return "\n".join(lines)


def _num(n: float, unit: str = "") -> str:
    """1835008, "FLOP" -> "1.84 MFLOP"; 842500 -> "842.50 K"; 512 -> "512"."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}".rstrip()
    return f"{n:.0f} {unit}".rstrip()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _rate(flops: int, seconds: float) -> str:
    return f"  ({_num(flops / seconds, 'FLOP/s')})" if seconds > 0 and flops else ""


def _pct(part: float, whole: float) -> str:
    return f"({100.0 * part / whole:.1f}%)" if whole else "(-)"


class ModuleProfiler:
    """Measures one forward pass per module and one backward pass in total.

    Use ``with profiler.forward(): out = model(...)`` then ``with profiler.backward():
    loss.backward()``, then :meth:`result`.
    """

    def __init__(self, module: nn.Module, *, device: torch.device) -> None:
        self._module = module
        self._cuda = device.type == "cuda"
        self._forward_counts: dict[str, dict[Any, int]] = {}
        self._latency: dict[nn.Module, float] = defaultdict(float)
        self.forward_flops = 0
        self.backward_flops = 0
        self.forward_latency_s = 0.0
        self.backward_latency_s = 0.0

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        starts: dict[nn.Module, list[float]] = defaultdict(list)

        def before(mod: nn.Module, *_: Any) -> None:
            self._sync()
            starts[mod].append(time.perf_counter())

        def after(mod: nn.Module, *_: Any) -> None:
            self._sync()
            if starts[mod]:
                self._latency[mod] += time.perf_counter() - starts[mod].pop()

        handles = []
        for mod in self._module.modules():
            handles.append(mod.register_forward_pre_hook(before))
            handles.append(mod.register_forward_hook(after))
        counter = flop_counter_mode()
        self._sync()
        begin = time.perf_counter()
        try:
            with counter:
                yield
        finally:
            self._sync()
            self.forward_latency_s += time.perf_counter() - begin
            for handle in handles:
                handle.remove()
        self.forward_flops += counter.get_total_flops()
        self._forward_counts = counter.get_flop_counts()

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        counter = flop_counter_mode()
        self._sync()
        begin = time.perf_counter()
        try:
            with counter:
                yield
        finally:
            self._sync()
            self.backward_latency_s += time.perf_counter() - begin
        self.backward_flops += counter.get_total_flops()

    def result(self, **extra: Any) -> FlopsProfile:
        """The measurements as a :class:`FlopsProfile` (``extra``: its optional fields)."""
        root_name = type(self._module).__name__
        named = list(self._module.named_modules())
        flops: dict[nn.Module, int] = {}
        latency: dict[nn.Module, float] = {}
        # Children first: a container that is never called itself (nn.ModuleList) gets the
        # sum of its children, so each depth of the tree adds up.
        for name, mod in reversed(named):
            key = f"{root_name}.{name}" if name else root_name
            if key in self._forward_counts or mod in self._latency:
                flops[mod] = sum(self._forward_counts.get(key, {}).values())
                latency[mod] = self._latency.get(mod, 0.0)
            else:
                flops[mod] = sum(flops.get(child, 0) for child in mod.children())
                latency[mod] = sum(latency.get(child, 0.0) for child in mod.children())
        modules = []
        for name, mod in named:
            # parameters() yields a tied tensor once. numel() is the full count at ZeRO-3 too: partita
            # frees a sharded parameter's storage in place and never changes its shape (unlike
            # DeepSpeed, whose profiler must read ds_numel); tests/test_zero3_reuse.py checks it.
            params = sum(p.numel() for p in mod.parameters())
            depth = name.count(".") + 1 if name else 0
            modules.append(ModuleStats(name, type(mod).__name__, depth, params, flops[mod], latency[mod]))
        return FlopsProfile(
            modules=tuple(modules),
            forward_flops=self.forward_flops,
            backward_flops=self.backward_flops,
            forward_latency_s=self.forward_latency_s,
            backward_latency_s=self.backward_latency_s,
            **extra,
        )


def get_model_profile(
    model: nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> FlopsProfile:
    """Profile one forward (and, with ``loss_fn``, one backward) of ``model`` outside training.

    Args:
        model: the module to profile.
        args, kwargs: its forward inputs.
        loss_fn: turns the model's output into a scalar to run backward on (e.g.
            ``lambda out: out[1]`` for a model returning ``(logits, loss)``); None: forward only.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    profiler = ModuleProfiler(model, device=device)
    with profiler.forward():
        output = model(*args, **(kwargs or {}))
    if loss_fn is not None:
        loss = loss_fn(output)
        with profiler.backward():
            loss.backward()
    return profiler.result()
