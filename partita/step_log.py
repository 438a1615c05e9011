"""What the engine reports about training: the ``steps_per_print`` line, the monitors'
scalars, the ``wall_clock_breakdown`` timers and the flops profiler's step.

Every ``steps_per_print`` optimizer steps rank 0 logs one line and writes the same values
to the enabled monitors (TensorBoard, CSV, W&B):

    step, loss (mean over the step's micro-batches and all ranks), lr, global grad norm,
    loss scale, skipped steps, samples/s, tokens/s, achieved TFLOP/s per device, MFU,
    memory allocated and peak (the maximum over ranks), and with wall_clock_breakdown the
    mean forward / backward / gradient-reduction / optimizer-step time per step.

Cost: between print steps nothing is synchronised or communicated (losses stay on the
device, timers are CUDA events). At a print step the device is synchronised once and one
small all-gather of (loss, tokens, memory) per rank runs through
:mod:`partita.distributed.collectives` — one collective instead of two all-reduces (a sum
for the loss and a max for the memory). Every rank must therefore reach the print step,
which every rank does, since all ranks count the same optimizer steps.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from partita.autotune.trial_env import TrialReporter
from partita.distributed import collectives
from partita.monitor.comm_advice import compression_note
from partita.monitor.comms_logger import COMMS_LOGGER
from partita.monitor.flops_profiler import FlopsProfile, ModuleProfiler
from partita.monitor.memory import memory_bytes
from partita.monitor.mfu import achieved_tflops_per_device, device_peak_tflops, model_flops_utilization
from partita.monitor.monitors import build_monitors
from partita.monitor.throughput import Span, ThroughputMeter, count_tokens
from partita.monitor.timers import PhaseTimers
from partita.moe.monitor import RoutingMonitor

logger = logging.getLogger("partita")

_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_GIB = float(2**30)
# Per rank in the print-step all-gather: loss sum, micro-batches, window tokens, total tokens, memory now, memory peak.
_FIELDS = 6


class StepLogger:
    """The engine's reporting: built by the engine, fed from forward/backward/step."""

    def __init__(self, *, engine: Any) -> None:
        from partita.config import PartitaConfig

        config = engine.config if engine.config is not None else PartitaConfig()
        self._engine = engine
        self._config = config
        self._every = config.steps_per_print
        self._device = engine.device
        self._is_rank0 = engine.topology.rank == 0
        # Tensor and sequence ranks are given the same samples (sequence parallelism cuts them inside
        # the model): count them on one, or tokens/s is tensor x sequence size times too high.
        self._counts_tokens = engine.topology.tensor_rank == 0 and engine.topology.sequence_rank == 0
        self._layout = engine.topology.describe() if engine.topology.is_model_parallel() else None
        self._compression_checked = False  # the first print step says if compression would not pay
        self._timers = PhaseTimers(device=self._device, enabled=config.wall_clock_breakdown)
        self._meter = ThroughputMeter(warmup_steps=config.throughput.warmup_steps, sync=self._sync)
        self._losses: list[torch.Tensor] = []
        self._seq_len: int | None = None
        self._flops_per_token: float | None = config.throughput.flops_per_token
        self._tokens_per_sample: int | None = config.throughput.tokens_per_sample
        self._module_flops_cache: dict[int | None, float | None] = {}
        self._measured_flops_per_token: float | None = None
        precision = _PRECISION.get(engine.compute_dtype, "fp32")
        self.peak_tflops = config.throughput.peak_tflops or device_peak_tflops(self._device, precision)
        if config.fp8.enabled and config.throughput.peak_tflops is None:
            # FP8 and bf16 matmuls mixed have no single peak: no MFU, as torchtitan (docs/guides/fp8.md).
            self.peak_tflops = None
        self._monitors = build_monitors(config, is_writing_rank=self._is_rank0)
        if self._monitors.enabled:
            atexit.register(self._monitors.close)
        self._profiler: ModuleProfiler | None = None
        self._profile_stage = ""  # "forward" -> "backward" -> "" while profiling one step
        self._profile_tokens = 0
        self._profile_begin = 0.0
        self._profile_step_s: float | None = None
        self._profiled_step_open = False  # every rank: the profiled step is running
        self._profiled = False
        self.flops_profile: FlopsProfile | None = None
        self.last_line: str | None = None
        self.last_metrics: dict[str, float] = {}
        self._totals: dict[str, float] = {}
        # `partita tune` trials only (environment variables): report after N steps and exit.
        self._trial = TrialReporter.from_env()
        # MoE layers: tokens per expert, dropped fraction, aux loss (partita/moe/monitor.py).
        self._routing = RoutingMonitor(engine.module, device=self._device)
        # A strategy's own metrics, read at each print step and logged after the standard ones
        # (the pipeline engine's idle time per stage, partita/pipe/bubble.py).
        self.extra_metrics: Callable[[], dict[str, float]] | None = None

    # ------------------------------------------------------------------ helpers
    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def set_flops_per_token(self, flops: float, *, tokens_per_sample: int | None = None) -> None:
        """Training FLOPs per token for TFLOP/s and MFU (overrides config and model method)."""
        if not flops > 0:
            raise ValueError(f"flops per token must be > 0, got {flops!r}; pass e.g. 6 * n_params + 12 * L * d * T")
        if tokens_per_sample is not None and tokens_per_sample < 1:
            raise ValueError(f"tokens_per_sample must be >= 1, got {tokens_per_sample!r}")
        self._flops_per_token = float(flops)
        if tokens_per_sample is not None:
            self._tokens_per_sample = tokens_per_sample

    def flops_per_token(self) -> float | None:
        """Explicit value, else the model's ``flops_per_token(seq_len=...)``, else the profiler's."""
        if self._flops_per_token is not None:
            return self._flops_per_token
        seq = self._tokens_per_sample or self._seq_len
        if seq not in self._module_flops_cache:
            self._module_flops_cache[seq] = _module_flops_per_token(self._engine.module, seq)
        value = self._module_flops_cache[seq]
        return value if value is not None else self._measured_flops_per_token

    def _starts_profiled_step(self) -> bool:
        # Every rank knows the profiled step (rank 0 profiles it) so that every rank leaves
        # it out of its throughput: the profiler's synchronisation slows all ranks.
        cfg = self._config.flops_profiler
        return (
            cfg.enabled
            and not self._profiled
            and not self._profiled_step_open
            and self._engine.global_steps == cfg.profile_step
        )

    # ------------------------------------------------------------------ engine hooks
    @contextlib.contextmanager
    def forward_scope(self, args: tuple, kwargs: dict) -> Iterator[None]:
        """Around the module's forward: time it, count its tokens, profile it at profile_step."""
        training = self._engine.module.training and torch.is_grad_enabled()
        tokens = 0
        if training:
            tokens, seq = count_tokens(args, kwargs)
            if seq is not None:
                self._seq_len = seq
            self._meter.on_forward(local_tokens=tokens, global_samples=self._engine.global_samples)
        with self._timers.phase("forward"):
            if training and self._starts_profiled_step():
                self._profiled_step_open = True
                self._sync()
                self._profile_begin = time.perf_counter()
            if training and self._is_rank0 and self._profiled_step_open and self._profiler is None:
                self._profiler = ModuleProfiler(self._engine.module, device=self._device)
                self._profile_tokens = tokens
                with self._profiler.forward():
                    yield
                self._profile_stage = "backward"
            else:
                yield

    @contextlib.contextmanager
    def backward_scope(self) -> Iterator[None]:
        """Around the whole backward (autograd and the gradient reduction that finishes it)."""
        with self._timers.phase("backward"):
            if self._profiler is not None and self._profile_stage == "backward":
                self._profile_stage = ""
                with self._profiler.backward():
                    yield
            else:
                yield

    @contextlib.contextmanager
    def timer(self, phase: str) -> Iterator[None]:
        """Time a phase for wall_clock_breakdown ("backward_inner", "backward_allreduce", "step")."""
        with self._timers.phase(phase):
            if phase == "step" and self._profiler is not None:
                self._sync()
                begin = time.perf_counter()
                yield
                self._sync()
                self._profile_step_s = time.perf_counter() - begin
            else:
                yield

    def observe_batch(self, args: tuple) -> None:
        """A training batch run outside :meth:`forward_scope` (a pipeline's ``train_batch``): count
        its tokens (``args``: this rank's inputs, empty past the first stage, so only the first
        stage counts them) and start the throughput clock as a forward would."""
        tokens, seq = count_tokens(args, {})
        if seq is not None:
            self._seq_len = seq
        self._meter.on_forward(local_tokens=tokens, global_samples=self._engine.global_samples)

    def observe_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def end_step(self, engine: Any) -> None:
        """After each optimizer step: finish a profile, and log every ``steps_per_print`` steps."""
        if self._profiled_step_open:
            self._sync()
            seconds = time.perf_counter() - self._profile_begin
            self._profiled_step_open, self._profiled = False, True
            self._meter.exclude_step(seconds=seconds, samples=engine.train_batch_size())
            if self._profiler is not None:
                self._finish_profile(engine, seconds)
        self._meter.on_step_end(global_samples=engine.global_samples)
        if engine.global_steps % self._every == 0:
            self._print_step(engine)
        self._losses.clear()
        if self._trial is not None:
            self._trial.after_step(engine, self.last_metrics)

    # ------------------------------------------------------------------ flops profiler
    def _finish_profile(self, engine: Any, seconds: float) -> None:
        cfg = self._config.flops_profiler
        profile = self._profiler.result(
            step_latency_s=self._profile_step_s,
            iteration_latency_s=seconds,
            global_step=engine.global_steps - 1,
        )
        self._profiler = None
        self._profile_stage = ""
        self.flops_profile = profile
        tokens = self._tokens_per_sample * engine.train_micro_batch_size_per_gpu() if self._tokens_per_sample else self._profile_tokens
        if tokens and profile.train_flops:
            self._measured_flops_per_token = profile.train_flops / tokens
        report = profile.format(module_depth=cfg.module_depth, top_modules=cfg.top_modules, detailed=cfg.detailed)
        if cfg.output_file:
            with open(cfg.output_file, "w") as f:
                f.write(report + "\n")
        else:
            logger.info("%s", report)

    # ------------------------------------------------------------------ print steps
    def _gather(self, window: Span | None, total: Span | None) -> list[list[float]]:
        """Every rank's (loss sum, micro-batches, window tokens, total tokens, memory now, peak)."""
        if self._losses:
            loss_sum = torch.stack([l.reshape(()) for l in self._losses]).double().sum().reshape(1)
        else:
            loss_sum = torch.zeros(1, dtype=torch.float64, device=self._device)
        current, peak = memory_bytes(self._device)
        rest = [
            float(len(self._losses)),
            float(window.local_tokens if window and self._counts_tokens else 0),
            float(total.local_tokens if total and self._counts_tokens else 0),
            current,
            peak,
        ]
        local = torch.cat([loss_sum.to(self._device), torch.tensor(rest, dtype=torch.float64, device=self._device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            world = dist.get_world_size()
            gathered = torch.empty(world * _FIELDS, dtype=torch.float64, device=self._device)
            collectives.all_gather_into_tensor(
                gathered, local, group=None, purpose="step log metrics (loss, tokens, memory)"
            )
            local = gathered
        values = local.tolist()
        return [values[i : i + _FIELDS] for i in range(0, len(values), _FIELDS)]

    def _rates(self, span: Span | None, rank_tokens: float) -> tuple[float | None, float | None]:
        """(samples/s, tokens/s) of a span; tokens/s None when tokens are unknown."""
        if span is None or span.seconds <= 0:
            return None, None
        tokens = span.samples * self._tokens_per_sample if self._tokens_per_sample else rank_tokens
        return span.samples / span.seconds, (tokens / span.seconds if tokens > 0 else None)

    def _print_step(self, engine: Any) -> None:
        self._sync()
        now = time.perf_counter()
        window, total = self._meter.take(now=now, global_samples=engine.global_samples)
        rows = self._gather(window, total)
        micro_batches = sum(r[1] for r in rows)
        samples_s, tokens_s = self._rates(window, sum(r[2] for r in rows))
        avg_samples_s, avg_tokens_s = self._rates(total, sum(r[3] for r in rows))
        world = dist.get_world_size() if dist.is_initialized() else 1
        flops_per_token = self.flops_per_token()
        tflops = mfu = None
        if tokens_s is not None and flops_per_token is not None:
            tflops = achieved_tflops_per_device(
                flops_per_token=flops_per_token, tokens_per_second=tokens_s, num_devices=world
            )
            if self.peak_tflops:
                mfu = model_flops_utilization(achieved_tflops=tflops, peak_tflops=self.peak_tflops)
        grad_norm = engine.get_global_grad_norm()
        steps_in_window = self._every
        phases = {name: seconds / steps_in_window for name, seconds in sorted(self._timers.take().items())}
        metrics: dict[str, float | None] = {
            "step": float(engine.global_steps),
            "train_loss": sum(r[0] for r in rows) / micro_batches if micro_batches else None,
            "lr": float(engine.get_lr()[0]),
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "loss_scale": float(engine.get_loss_scale()),
            "skipped_steps": float(engine.skipped_steps),
            "samples_per_sec": samples_s,
            "tokens_per_sec": tokens_s,
            "tflops_per_device": tflops,
            "mfu": mfu,
            "avg_samples_per_sec": avg_samples_s,
            "avg_tokens_per_sec": avg_tokens_s,
            "memory_allocated_gib": max(r[4] for r in rows) / _GIB,
            "memory_peak_gib": max(r[5] for r in rows) / _GIB,
            **{f"elapsed_time_ms_{name}": 1000.0 * seconds for name, seconds in phases.items()},
        }
        routing = self._routing.collect()  # collective (an all-reduce) when the model has MoE layers
        metrics.update(routing)
        extra = self.extra_metrics() if self.extra_metrics is not None else {}
        swapper = getattr(getattr(engine, "optimizer", None), "swapper", None)
        if swapper is not None:  # NVMe optimizer states: the window's disk traffic per step (offload/swap_stats.py)
            extra = {**extra, **swapper.window_metrics()}
        metrics.update(extra)
        self.last_metrics = {k: v for k, v in metrics.items() if v is not None}
        self._totals = {k: v for k, v in metrics.items() if k.startswith("avg_") and v is not None}
        self.last_line = (_format_line(engine, metrics, phases) + self._routing.format(routing)
                          + "".join(f" {k}={v:.3f}" for k, v in extra.items()))
        if self._is_rank0:
            if self._layout is not None:  # the first print step says how the model is laid out
                logger.info("layout: %s", self._layout)
                self._layout = None
            if not self._compression_checked:  # modelled (partita/monitor/comm_advice.py), once
                self._compression_checked = True
                note = compression_note(engine)
                if note is not None:
                    logger.warning("%s", note)
            logger.info(self.last_line)
            self._monitors.write_events(
                [(f"Train/Samples/{name}", value, engine.global_samples) for name, value in self.last_metrics.items()]
            )

    # ------------------------------------------------------------------ summaries
    def summary(self) -> str:
        """Run averages since warm-up (as of the last print step) and the communication summary."""
        lines = []
        if self._totals:
            lines.append(
                "throughput since warm-up: "
                + " ".join(f"{k.removeprefix('avg_')}={v:,.1f}" for k, v in self._totals.items())
            )
        if COMMS_LOGGER.enabled:
            lines.append(COMMS_LOGGER.summary().format())
        return "\n".join(lines)

    def close(self) -> None:
        self._monitors.close()


def _module_flops_per_token(module: torch.nn.Module, seq_len: int | None) -> float | None:
    """The model's own ``flops_per_token`` method (the reference GPT has one), if any."""
    method = getattr(module, "flops_per_token", None)
    if not callable(method):
        return None
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        params = {}
    if "seq_len" in params:
        if seq_len is None:
            return None  # the sequence length is not known yet
        return float(method(seq_len=seq_len))
    return float(method())


def _format_line(engine: Any, metrics: dict[str, float | None], phases: dict[str, float]) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    parts = [
        f"step={engine.global_steps}",
        f"loss={fmt(metrics['train_loss'], '.4f')}",
        "lr=" + ",".join(f"{lr:.3e}" for lr in engine.get_lr()),
        f"grad_norm={fmt(metrics['grad_norm'], '.4f')}",
        f"loss_scale={metrics['loss_scale']:g}",
        f"skipped={engine.skipped_steps}",
        f"samples/s={fmt(metrics['samples_per_sec'], ',.1f')}",
    ]
    if metrics["tokens_per_sec"] is not None:
        parts.append(f"tokens/s={metrics['tokens_per_sec']:,.0f}")
    if metrics["tflops_per_device"] is not None:
        parts.append(f"TFLOP/s={metrics['tflops_per_device']:.3g}")
    if metrics["mfu"] is not None:
        parts.append(f"MFU={100 * metrics['mfu']:.1f}%")
    parts.append(f"mem={metrics['memory_allocated_gib']:.2f}GiB peak={metrics['memory_peak_gib']:.2f}GiB")
    if phases:
        parts.append("time(ms/step) " + " ".join(f"{k}={1000 * v:.1f}" for k, v in phases.items()))
    return " ".join(parts)
