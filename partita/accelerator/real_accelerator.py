"""``get_accelerator()``: DeepSpeed's accelerator abstraction for the two devices partita runs on.

DeepSpeed scripts write ``get_accelerator().device_name(local_rank)`` instead of
``f"cuda:{local_rank}"`` so the same code runs on CUDA, CPU and other vendors' devices.
partita trains on CUDA (NCCL) or the CPU (gloo), so :func:`get_accelerator` returns a
:class:`CudaAccelerator` when ``torch.cuda.is_available()`` and a :class:`CpuAccelerator`
otherwise; ``DS_ACCELERATOR=cpu|cuda`` overrides the choice, as in DeepSpeed.

Names, arguments and return types are DeepSpeed's (``deepspeed/accelerator/*_accelerator.py``),
each a thin call into torch. Where DeepSpeed's CPU accelerator has a quirk that would surprise
(``current_device()`` returning the ``LOCAL_RANK`` string, ``device()`` returning None) this
returns the value a user expects instead (the int, ``torch.device("cpu")``) and says so.
DeepSpeed's op-builder calls (compiled kernels) raise NotImplementedError: partita has none.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch

__all__ = [
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]

SUPPORTED = ("cuda", "cpu")

# DeepSpeed accelerator calls about its compiled-kernel builders: nothing to build in partita.
_OP_BUILDER_CALLS = ("op_builder_dir", "create_op_builder", "get_op_builder", "build_extension")


class Accelerator:
    """What both devices share; subclasses set ``_name`` and ``_communication_backend_name``."""

    _name = ""
    _communication_backend_name = ""

    def __init__(self) -> None:
        self._compile_backend = "inductor"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, backend={self._communication_backend_name!r})"

    def __getattr__(self, name: str) -> Any:
        if name in _OP_BUILDER_CALLS:
            raise NotImplementedError(
                f"get_accelerator().{name}() builds DeepSpeed's compiled kernels (op builders); partita has none: "
                "its optimizers are torch's (fused where the device has a kernel), chosen by the config's optimizer section"
            )
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # ------------------------------------------------------------------ names
    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device: "nccl" or "gloo"."""
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        return False

    # ------------------------------------------------------------------ RNG (torch's default generator)
    def random(self):
        return torch.random

    def manual_seed(self, seed: int):
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    # ------------------------------------------------------------------ misc
    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"compile backend {backend!r} is not known to torch; known: {', '.join(known)}")
        self._compile_backend = backend

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(str(i) for i in local_accelerator_ids)

    def export_envs(self) -> list[str]:
        return []


class CudaAccelerator(Accelerator):
    """NVIDIA GPUs through ``torch.cuda``."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return False

    def resolves_data_dependency(self) -> bool:
        return False

    def handles_memory_backpressure(self) -> bool:
        return False

    # ------------------------------------------------------------------ devices
    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``, or ``"cuda:<index>"`` for an index."""
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda", device_index) if device_index is not None else torch.device("cuda")

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    # ------------------------------------------------------------------ RNG
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def manual_seed(self, seed: int):
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int):
        return torch.cuda.default_generators[device_index]

    # ------------------------------------------------------------------ streams and events
    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self):  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event

    # ------------------------------------------------------------------ memory
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    # ------------------------------------------------------------------ data types and misc
    def is_bf16_supported(self) -> bool:
        return True if not torch.cuda.is_available() else torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        if not torch.cuda.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        return major >= 6  # fp16 arithmetic from Pascal on

    def amp(self):
        return torch.cuda.amp

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()


class CpuAccelerator(Accelerator):
    """The CPU: one device, memory read as the process's resident set (as DeepSpeed does)."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._max_rss = self._rss()

    def is_synchronized_device(self) -> bool:
        return True

    def use_host_timers(self) -> bool:
        return True

    def resolves_data_dependency(self) -> bool:
        return True

    def handles_memory_backpressure(self) -> bool:
        return True

    # ------------------------------------------------------------------ devices
    def device_name(self, device_index: int | None = None) -> str:
        """Always ``"cpu"``: every rank of a CPU job computes on the CPU (DeepSpeed's rule)."""
        return "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")  # DeepSpeed returns None here

    def set_device(self, device_index: int) -> None:
        """Nothing to select on a CPU."""

    def current_device(self) -> int:
        """This process's local rank (DeepSpeed returns the ``LOCAL_RANK`` string; this the int)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """``LOCAL_SIZE`` (or torchrun's ``LOCAL_WORLD_SIZE``) when set, else 1."""
        for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            value = os.environ.get(name, "")
            if value.isdigit() and int(value) > 0:
                return int(value)
        return 1

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU work is synchronous: nothing to wait for."""

    def is_available(self) -> bool:
        return True

    # ------------------------------------------------------------------ RNG
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def default_generator(self, device_index: int | None = None):
        return torch.default_generator

    # ------------------------------------------------------------------ streams and events: none on a CPU
    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's name
        return None

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None):
        return None

    def default_stream(self, device_index: int | None = None):
        return None

    @property
    def Event(self):  # noqa: N802 - DeepSpeed's name
        return None

    # ------------------------------------------------------------------ memory: the resident set size
    @staticmethod
    def _rss() -> int:
        from partita.monitor.memory import memory_bytes

        return int(memory_bytes(torch.device("cpu"))[0])

    def _sample(self) -> int:
        current = self._rss()
        self._max_rss = max(self._max_rss, current)
        return current

    def empty_cache(self) -> None:
        """No caching allocator on a CPU."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._sample()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """The largest resident set seen by this object's memory calls (DeepSpeed's bookkeeping)."""
        self._sample()
        return self._max_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._max_rss = self._rss()

    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        current = self._sample()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self._max_rss}

    def total_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # ------------------------------------------------------------------ data types and misc
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has fp16 kernels on this CPU (DeepSpeed's test)."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def amp(self):
        return torch.cpu.amp

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor  # nothing to pin for: the CPU is the device

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def range_push(self, msg: str) -> None:
        """No profiler ranges on the CPU path (DeepSpeed's CPU accelerator has none either)."""

    def range_pop(self) -> None:
        """See :meth:`range_push`."""


_current: Accelerator | None = None


def _from_environment() -> Accelerator:
    wanted = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if wanted and wanted not in SUPPORTED:
        raise ValueError(
            f"DS_ACCELERATOR={wanted!r}: partita runs on {' or '.join(SUPPORTED)}; unset DS_ACCELERATOR or set one of those"
        )
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ValueError("DS_ACCELERATOR=cuda but torch.cuda.is_available() is False; use DS_ACCELERATOR=cpu or unset it")
    if wanted == "cpu" or (not wanted and not torch.cuda.is_available()):
        return CpuAccelerator()
    return CudaAccelerator()


def get_accelerator() -> Accelerator:
    """This process's accelerator: CUDA when available, else the CPU (``DS_ACCELERATOR`` overrides)."""
    global _current
    if _current is None:
        _current = _from_environment()
    return _current


def set_accelerator(accel_obj: Accelerator) -> None:
    """Use ``accel_obj`` from now on (DeepSpeed's hook for tests and custom devices)."""
    global _current
    if not isinstance(accel_obj, Accelerator):
        raise ValueError(f"set_accelerator needs a partita.accelerator.Accelerator, got {type(accel_obj).__name__}")
    _current = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in SUPPORTED
