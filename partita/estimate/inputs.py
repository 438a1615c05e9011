"""What the memory estimator is asked about: the training setup, a GPT shape, sizes and policies.

Everything a user can get wrong is checked here, once, with an :class:`EstimateError` that
names the value, what is allowed and the fix; the arithmetic modules can then trust their
inputs. :meth:`Setup.from_config` reads a partita (DeepSpeed-style) config, so the estimate
describes exactly the run that config would start.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from partita.offload.transfer import STAGING_BYTES as _OFFLOAD_STAGING_BYTES
from partita.zero.stream_eligibility import auto_streams

__all__ = [
    "DTYPE_BYTES",
    "OPTIMIZERS",
    "STAGING_BYTES",
    "Checkpointing",
    "EstimateError",
    "GPTShape",
    "Setup",
    "parse_bytes",
    "parse_checkpointing",
]

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}

STAGING_BYTES = _OFFLOAD_STAGING_BYTES
"""Bytes of one pinned CPU staging buffer of optimizer offload (``partita.offload.transfer``);
``Setup.staging_bytes`` overrides it, so the estimate can follow the offload engine if the
buffer size changes."""

# Optimizer type -> (bytes of state per partition element, per-block bytes (8-bit scales),
# constant bytes shared by the whole optimizer (8-bit code tables), scalar step tensor).
# Derived from what partita.optim.factory builds; see model_states.optimizer_state_bytes.
OPTIMIZERS: tuple[str, ...] = (
    "Adam", "AdamW", "SGD", "Lion",
    "AdamW8bit", "Adam8bit", "Lion8bit", "PagedAdamW8bit", "PagedAdam8bit", "PagedLion8bit",
)

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_OPTIMIZER_OFFLOAD_DEVICES = _OFFLOAD_DEVICES + ("auto",)  # auto: tiered placement (partita/offload/tiers.py)
_POLICIES = ("none", "every", "every_k", "selective")
_UNITS = {
    "": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


class EstimateError(ValueError):
    """A value given to the memory estimator is not allowed; the message says which and how to fix it."""


def parse_bytes(text: str | int, *, what: str = "size") -> int:
    """Bytes in ``"141GB"`` (10**9 units, as GPU vendors count), ``"80GiB"`` (2**30) or ``"1000"``."""
    if isinstance(text, bool):
        raise EstimateError(f"{what} must be a size such as 80GB or 80GiB, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        if match is None or match.group(2).upper() not in _UNITS:
            raise EstimateError(
                f"{what} {text!r} is not a size: write a number with an optional unit, B, KB, MB, GB, TB "
                "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 141GB or 80GiB"
            )
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value < 1:
        raise EstimateError(f"{what} {text!r} must be at least 1 byte")
    return value


@dataclass(frozen=True)
class Checkpointing:
    """Activation checkpointing policy (partita/activation_checkpointing): ``none``, ``every``
    block, ``every_k`` (every k-th block) or ``selective`` (matmul/attention outputs kept)."""

    policy: str = "none"
    k: int = 1

    def __post_init__(self) -> None:
        if self.policy not in _POLICIES:
            raise EstimateError(
                f"checkpointing policy {self.policy!r} is not one of {', '.join(_POLICIES)}; "
                "write every_k:K for every K-th block"
            )
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise EstimateError(f"checkpointing k must be an integer >= 1, got {self.k!r}")
        if self.k != 1 and self.policy != "every_k":
            raise EstimateError(f"k={self.k} only applies to every_k, not {self.policy!r}; write every_k:{self.k}")

    def __str__(self) -> str:
        return f"every_k:{self.k}" if self.policy == "every_k" else self.policy


def parse_checkpointing(text: str | Checkpointing) -> Checkpointing:
    """``"none"``, ``"every"``, ``"selective"`` or ``"every_k:K"`` -> :class:`Checkpointing`."""
    if isinstance(text, Checkpointing):
        return text
    value = str(text).strip()
    if value.startswith("every_k"):
        _, sep, k = value.partition(":")
        if not sep or not k.strip().isdigit() or int(k) < 1:
            raise EstimateError(
                f"checkpointing {text!r}: every_k needs the stride, e.g. every_k:2 (every 2nd block)"
            )
        return Checkpointing("every_k", int(k))
    if value not in ("none", "every", "selective"):
        raise EstimateError(
            f"checkpointing {text!r} is not one of none, every, selective, every_k:K "
            "(e.g. every_k:2 checkpoints every 2nd block)"
        )
    return Checkpointing(value)


@dataclass(frozen=True)
class GPTShape:
    """The shape of partita's reference GPT (partita/models/gpt.py): enough to build it on the
    meta device (exact parameter shapes) and to count its activations."""

    d_model: int
    n_layers: int
    n_heads: int
    vocab: int
    seq_len: int
    bias: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "vocab", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EstimateError(f"GPT {name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise EstimateError(
                f"GPT d-model {self.d_model} is not divisible by n-heads {self.n_heads}; pick n-heads among "
                "the divisors of d-model"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise EstimateError(f"GPT dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def preset(cls, name: str) -> GPTShape:
        """The shapes of ``GPTConfig``'s named constructors (tiny, gpt2-124m, gpt-1.3b)."""
        from partita.models.gpt import GPTConfig

        makers = {"tiny": GPTConfig.tiny, "gpt2-124m": GPTConfig.gpt2_124m, "gpt-1.3b": GPTConfig.gpt_1_3b}
        if name not in makers:
            raise EstimateError(f"GPT preset {name!r} is not one of {', '.join(makers)}")
        c = makers[name]()
        return cls(c.n_embd, c.n_layer, c.n_head, c.vocab_size, c.block_size, c.bias, c.dropout)


def _positive_int(name: str, value: Any, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EstimateError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class Setup:
    """One training configuration whose memory is estimated.

    Defaults: bf16, one rank, micro-batch 1, AdamW; the other fields default to partita's
    (DeepSpeed's) config defaults. ``seq_len=None`` means the GPT shape's ``seq_len``.
    """

    dtype: str = "bf16"
    stage: int = 0
    world_size: int = 1
    micro_batch: int = 1
    seq_len: int | None = None
    gradient_accumulation_steps: int = 1
    optimizer: str = "AdamW"
    sgd_momentum: float = 0.0
    amsgrad: bool = False
    checkpointing: Checkpointing = Checkpointing()
    cpu_checkpointing: bool = False
    offload_optimizer: str = "none"
    offload_ratio: float = 1.0
    offload_tiers: tuple[float, float, float] | None = None  # device auto: (accelerator, cpu, nvme) shares
    offload_param: str = "none"
    param_gather_from_master: bool = False  # offload_param.gather_from_master: no 16-bit host copy
    optimizer_buffer_count: int = 4
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    param_max_in_cpu: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    aio_block_size: int = 1_048_576
    staging_bytes: int = STAGING_BYTES
    delayed_param_update: bool = False
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    reduce_scatter: bool = True
    stage3_param_persistence_threshold: int = 100_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    communication_dtype: str | None = None
    grad_accum_dtype: str | None = None
    activation_bytes: int | None = None
    one_rank_free_weights: bool = True
    fold_gradients_at_end: bool = False  # zero_optimization.one_rank_gradient_fold "end" or "stream" (one rank, no offload)
    streamed_step: bool = False  # one_rank_gradient_fold "stream": no fp32 partition, param.grad held into the step
    loss_tile_tokens: int | None = None  # sequence_tiling: LM head + loss over tiles of tokens (partita/sequence/tiling.py)
    mlp_tile_tokens: int | None = None  # sequence_tiling: every MLP over tiles of tokens
    frozen_zero_init: bool | None = None  # frozen params built under zero.Init (None: as the module says)
    allocator: str = "expandable"  # the CUDA caching allocator predicted (partita/estimate/allocator.py)
    # The training loop keeps the previous step's logits through the next forward (``logits, loss =
    # engine(x, y)`` with no ``del``, as examples/train_gpt.py and nanoGPT do): their freed block is a hole
    # the fp32 loss gradients cannot use (partita/estimate/allocator.py). Tensor bytes are unchanged.
    logits_held_to_next_step: bool = False
    max_split_size_mb: int | None = None  # PYTORCH_CUDA_ALLOC_CONF max_split_size_mb (fixed segments only)

    def __post_init__(self) -> None:
        if isinstance(self.checkpointing, str):
            object.__setattr__(self, "checkpointing", parse_checkpointing(self.checkpointing))
        for name in ("dtype", "communication_dtype", "grad_accum_dtype"):
            value = getattr(self, name)
            if (value is not None or name == "dtype") and value not in DTYPE_BYTES:
                raise EstimateError(f"{name} {value!r} is not one of fp32, bf16, fp16")
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise EstimateError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage!r}")
        for name in ("world_size", "micro_batch", "gradient_accumulation_steps", "optimizer_buffer_count",
                     "param_buffer_count", "param_buffer_size", "sub_group_size", "aio_block_size", "staging_bytes",
                     "reduce_bucket_size", "allgather_bucket_size", "stage3_max_live_parameters"):
            _positive_int(name, getattr(self, name))
        for name in ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size", "stage3_max_reuse_distance",
                     "param_max_in_cpu"):
            _positive_int(name, getattr(self, name), minimum=0)
        if self.seq_len is not None:
            _positive_int("seq_len", self.seq_len)
        if self.activation_bytes is not None:
            _positive_int("activation_bytes", self.activation_bytes, minimum=0)
        if self.optimizer not in OPTIMIZERS:
            raise EstimateError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if not self.sgd_momentum >= 0.0:
            raise EstimateError(f"sgd_momentum must be >= 0, got {self.sgd_momentum!r}")
        for name, allowed in (("offload_optimizer", _OPTIMIZER_OFFLOAD_DEVICES), ("offload_param", _OFFLOAD_DEVICES)):
            if getattr(self, name) not in allowed:
                raise EstimateError(f"{name} {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        self._check_tiers()
        for name in ("loss_tile_tokens", "mlp_tile_tokens"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.mlp_tile_tokens is not None and self.checkpointing.policy == "selective":
            raise NotImplementedError(
                "the estimate of mlp_tile_tokens with selective checkpointing is not modelled (what selective keeps "
                "inside a tiled MLP is not counted); estimate checkpointing every or none with it")
        self.allocator_model()  # validates allocator and max_split_size_mb
        for name in ("logits_held_to_next_step",):
            if not isinstance(getattr(self, name), bool):
                raise EstimateError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not 0.0 < self.offload_ratio <= 1.0:
            raise EstimateError(f"offload_ratio must be in (0, 1], got {self.offload_ratio!r}")
        # The same rules as partita.zero.config.ZeroConfig, so an estimate never describes a
        # run that initialize() would refuse.
        if self.offload_optimizer != "none" and self.stage == 0:
            raise EstimateError(
                "offload_optimizer needs ZeRO stage 1, 2 or 3 (stage 0 keeps the whole optimizer on every "
                "rank); choose stage >= 1 or offload_optimizer none"
            )
        if self.offload_param != "none" and self.stage != 3:
            raise EstimateError("offload_param needs ZeRO stage 3; choose stage 3 or offload_param none")
        if (self.offload_optimizer == "nvme" or (self.offload_tiers or (0, 0, 0))[2] > 0) and "8bit" in self.optimizer:
            raise EstimateError(
                f"{self.optimizer} cannot swap its states to NVMe (block-quantised states; partita refuses it); "
                "use offload_optimizer cpu or an fp32-state optimizer (Adam, AdamW, SGD, Lion)"
            )
        if self.delayed_param_update and self.offload_optimizer == "none":
            raise EstimateError("delayed_param_update needs offload_optimizer cpu or nvme; set one or drop it")

    def _check_tiers(self) -> None:
        tiers = self.offload_tiers
        if tiers is None:
            return
        if self.offload_optimizer != "auto":
            raise EstimateError(f"offload_tiers {tiers!r} needs offload_optimizer auto, not {self.offload_optimizer!r}")
        if len(tiers) != 3 or any(not 0.0 <= f <= 1.0 for f in tiers) or abs(sum(tiers) - 1.0) > 1e-9:
            raise EstimateError(f"offload_tiers {tiers!r} must be three shares in [0, 1] (accelerator, cpu, nvme) "
                                "summing to 1")

    def tier_fractions(self) -> tuple[float, float, float]:
        """``OffloadOptimizerConfig.tier_fractions`` for this setup; device auto needs ``offload_tiers``
        (``partita.estimate.tiers.plan_tiers`` decides them)."""
        if self.offload_optimizer == "none":
            return (1.0, 0.0, 0.0)
        if self.offload_optimizer == "cpu":
            return (1.0 - self.offload_ratio, self.offload_ratio, 0.0)
        if self.offload_optimizer == "nvme":
            return (1.0 - self.offload_ratio, 0.0, self.offload_ratio)
        if self.offload_tiers is None:
            raise EstimateError("offload_optimizer auto needs its split per tier: decide it with "
                                "partita.estimate.tiers.plan_tiers (partita estimate does), or give offload_tiers")
        return self.offload_tiers

    def allocator_model(self):
        """The :class:`partita.estimate.allocator.AllocatorModel` this setup's reserved memory is predicted with."""
        from partita.estimate.allocator import AllocatorConfigError, AllocatorModel

        if self.max_split_size_mb is not None and self.allocator != "default":
            raise EstimateError(f"max_split_size_mb {self.max_split_size_mb} applies to allocator default (fixed "
                                f"segments), not {self.allocator!r}; drop it or set allocator default")
        try:
            return AllocatorModel(self.allocator, self.max_split_size_mb)
        except AllocatorConfigError as error:
            raise EstimateError(str(error)) from None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def num_shards(self) -> int:
        """How many pieces the optimizer state is cut into (partita.zero.policy.ZeroPolicy.num_shards)."""
        return self.world_size if self.stage >= 1 else 1

    def replace(self, **changes: Any) -> Setup:
        """A copy with ``changes``; an unknown field name is an :class:`EstimateError`."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise EstimateError(f"unknown setup option(s) {unknown}; the options are {', '.join(sorted(names))}")
        return dataclasses.replace(self, **changes)

    def streams_by_default(self) -> bool:
        """Whether ``one_rank_gradient_fold "auto"`` takes "stream" for this setup (the rule of
        ``partita.zero.fold_choice.auto_streams``, for a setup given without a config: an
        accelerator's fused Adam/AdamW assumed)."""
        from partita.zero.streamed_step import STREAMABLE_EIGHT_BIT

        fp32_sums = self.grad_accum_dtype == "fp32" and self.dtype != "fp32"
        return (self.world_size == 1 and self.offload_optimizer == "none" and self.offload_param == "none"
                and self.optimizer in ("Adam", "AdamW", *STREAMABLE_EIGHT_BIT) and not fp32_sums
                and not (self.stage >= 2 and self.gradient_accumulation_steps > 1))

    @classmethod
    def resolve(cls, setup: Setup | None, options: dict[str, Any]) -> Setup:
        """``setup`` (default: ``Setup()``) with ``options`` applied."""
        if setup is not None and not isinstance(setup, cls):
            raise EstimateError(f"setup must be a partita.estimate.Setup, got {type(setup).__name__}")
        base = setup or cls()
        return base.replace(**options) if options else base

    def describe(self) -> str:
        offload = "none"
        if self.offload_tiers is not None:
            offload = "optimizer->tiers " + "/".join(f"{t} {f:.3g}" for t, f in zip(("accelerator", "cpu", "nvme"),
                                                                                     self.offload_tiers))
        elif self.offload_optimizer != "none":
            ratio = "" if self.offload_ratio == 1.0 else f" (ratio {self.offload_ratio:g})"
            offload = f"optimizer->{self.offload_optimizer}{ratio}"
        if self.offload_param != "none":
            offload = ("" if offload == "none" else offload + ", ") + f"params->{self.offload_param}"
        gas = f" x {self.gradient_accumulation_steps} accumulation steps" if self.gradient_accumulation_steps > 1 else ""
        ckpt = str(self.checkpointing) + (" (inputs in CPU memory)" if self.cpu_checkpointing else "")
        fold = ""
        if self.world_size == 1 and self.fold_gradients_at_end:
            fold = ", one_rank_gradient_fold " + ("stream" if self.streamed_step else "end")
        tiles = [f"{what} tiled by {n}" for what, n in (("loss", self.loss_tile_tokens), ("MLP", self.mlp_tile_tokens))
                 if n is not None]
        tiles += ["logits held to the next step"] if self.logits_held_to_next_step else []
        return (
            f"{self.dtype}, ZeRO stage {self.stage}, world size {self.world_size}, micro-batch {self.micro_batch}{gas}, "
            f"{self.optimizer}, checkpointing {ckpt}, offload {offload}{fold}" + "".join(", " + t for t in tiles)
        )

    @classmethod
    def from_config(cls, config: Any, *, world_size: int = 1, **overrides: Any) -> Setup:
        """The setup a partita config (dict, path of a JSON file or ``PartitaConfig``) describes on
        ``world_size`` data-parallel ranks; ``overrides`` win over the config."""
        from partita.config import PartitaConfig, load_config, resolve_batch_sizes

        cfg = config if isinstance(config, PartitaConfig) else load_config(
            os.fspath(config) if isinstance(config, os.PathLike) else config
        )
        world = overrides.get("world_size", world_size)
        zero = cfg.zero_optimization
        values: dict[str, Any] = {
            "dtype": cfg.precision,
            "stage": zero.stage,
            "world_size": world,
            "reduce_bucket_size": zero.reduce_bucket_size,
            "allgather_bucket_size": zero.allgather_bucket_size,
            "reduce_scatter": zero.reduce_scatter,
            "stage3_param_persistence_threshold": zero.stage3_param_persistence_threshold,
            "stage3_prefetch_bucket_size": zero.stage3_prefetch_bucket_size,
            "stage3_max_live_parameters": zero.stage3_max_live_parameters,
            "sub_group_size": zero.sub_group_size,
            "aio_block_size": cfg.aio.block_size,
            "stage3_max_reuse_distance": zero.stage3_max_reuse_distance,
            "one_rank_free_weights": zero.one_rank_free_weights,
            "fold_gradients_at_end": zero.one_rank_gradient_fold in ("end", "stream"),
            "streamed_step": zero.one_rank_gradient_fold == "stream",
            "offload_optimizer": zero.offload_optimizer.device,
            "offload_ratio": zero.offload_optimizer.ratio,
            "offload_tiers": (zero.offload_optimizer.tiers.fractions.as_tuple()
                              if zero.offload_optimizer.tiers.fractions is not None else None),
            "optimizer_buffer_count": zero.offload_optimizer.buffer_count,
            "delayed_param_update": zero.offload_optimizer.delayed_param_update,
            "offload_param": zero.offload_param.device,
            "param_buffer_count": zero.offload_param.buffer_count,
            "param_buffer_size": zero.offload_param.buffer_size,
            "param_max_in_cpu": zero.offload_param.max_in_cpu,
            "param_gather_from_master": zero.offload_param.gather_from_master,
            "communication_dtype": cfg.communication_data_type,
            "grad_accum_dtype": cfg.data_types.grad_accum_dtype,
            "loss_tile_tokens": cfg.sequence_tiling.loss_tile_tokens,
            "mlp_tile_tokens": cfg.sequence_tiling.mlp_tile_tokens,
        }
        if cfg.train_batch_size is not None or cfg.train_micro_batch_size_per_gpu is not None:
            batch = resolve_batch_sizes(cfg, dp_world_size=world)
            values["micro_batch"] = batch.micro_batch_size
            values["gradient_accumulation_steps"] = batch.gradient_accumulation_steps
        if cfg.optimizer is not None:
            values["optimizer"] = cfg.optimizer.type
            params = cfg.optimizer.params
            values["sgd_momentum"] = float(getattr(params, "momentum", 0.0))
            values["amsgrad"] = bool(getattr(params, "amsgrad", False))
        ac = cfg.activation_checkpointing
        if ac.policy is not None:
            values["checkpointing"] = Checkpointing(ac.policy, ac.k)
            values["cpu_checkpointing"] = ac.cpu_checkpointing
        if zero.one_rank_gradient_fold == "auto" and not {"fold_gradients_at_end", "streamed_step"} & set(overrides):
            # What initialize decides (partita/zero/fold_choice.py) where the config alone says it; the
            # estimate-based choice between early and end is left to the caller (fold_gradients_at_end).
            if world == 1 and auto_streams(cfg, None, job_world=1, assume_fused_kernel=True,
                                           gradient_accumulation_steps=values.get("gradient_accumulation_steps", 1)):
                values.update(fold_gradients_at_end=True, streamed_step=True)
        values.update(overrides)
        return cls(**values)
