"""The ``optimizer`` and ``scheduler`` sections of the config.

Both sections keep DeepSpeed's shape, ``{"type": ..., "params": {...}}``, and DeepSpeed's
parameter names and defaults, so an existing DeepSpeed config means the same training here.
Unlike DeepSpeed, ``params`` is validated per ``type`` by a typed model: a misspelt or
out-of-range hyperparameter fails at ``initialize`` instead of reaching the optimizer (or
being ignored).

No key here takes ``"auto"``: it stands for a Hugging Face Trainer argument (its lr, its
warmup) that partita cannot know, and DeepSpeed's fallback to its own default would
silently train with a different lr; the loader reports each one instead.

``type`` is matched case-insensitively and stored in its canonical spelling ("adamw" ->
"AdamW"). Errors are raised as pydantic ``ValidationError``s whose ``loc`` is the key path
inside the section (``("type",)``, ``("params", "lr")``); the config loader turns them into
:class:`~partita.config.base.ConfigError` with the full path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BeforeValidator,
    Field,
    SerializeAsAny,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pydantic import BaseModel

from partita.config.base import JsonInt, StrictSection
from partita.config.suggest import did_you_mean

__all__ = [
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
    "AdamParams",
    "AdamWParams",
    "SGDParams",
    "LionParams",
    "AdamW8bitParams",
    "Adam8bitParams",
    "OneBitAdamParams",
    "ZeroOneAdamParams",
    "OneBitLambParams",
    "OptimizerConfig",
    "WarmupLRParams",
    "WarmupDecayLRParams",
    "WarmupCosineLRParams",
    "OneCycleParams",
    "SchedulerConfig",
]


# ----------------------------------------------------------------------------- field types


def _as_tuple(value: Any) -> Any:
    # JSON has no tuples; strict mode would refuse the list json.load gives us.
    return tuple(value) if isinstance(value, list) else value


NonNegInt = Annotated[JsonInt, Field(ge=0)]
PosInt = Annotated[JsonInt, Field(ge=1)]
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Ratio = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Beta = Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]
Betas = Annotated[tuple[Beta, Beta], BeforeValidator(_as_tuple)]


def _lookup_type(value: Any, supported: tuple[str, ...]) -> str | None:
    """The canonical spelling of ``value`` (case-insensitive), or None."""
    if not isinstance(value, str):
        return None
    return {name.lower(): name for name in supported}.get(value.lower())


def _canonical_type(
    value: Any, *, supported: tuple[str, ...], known_elsewhere: tuple[str, ...], what: str
) -> str:
    """Map ``value`` case-insensitively onto one of ``supported`` or raise ValueError."""
    if not isinstance(value, str):
        raise ValueError(f"{what} type must be a string, got {value!r}")
    canonical = _lookup_type(value, supported)
    if canonical is not None:
        return canonical
    listed = ", ".join(supported)
    pending = {name.lower(): name for name in known_elsewhere}
    if value.lower() in pending:
        raise ValueError(
            f"{what} type {value!r}: DeepSpeed's {pending[value.lower()]} is not implemented "
            f"in partita yet. Supported: {listed}."
        )
    suggestion = did_you_mean(value, supported)
    sentence = f"unknown {what} type {value!r}" + (f"; {suggestion}" if suggestion else ".")
    raise ValueError(
        f"{sentence} Supported: {listed}. Other DeepSpeed {what}s "
        f"({', '.join(known_elsewhere)}) are not implemented yet."
    )


# ----------------------------------------------------------------------------- optimizers


class _OptimizerParams(StrictSection):
    """Common base so ``OptimizerConfig.params`` has one declared type."""

    # DeepSpeed refuses this key as well; say where clipping is configured. The config
    # loader reports it from this table; the validator below covers direct validation.
    misplaced_keys: ClassVar[Mapping[str, str]] = {
        "max_grad_norm": (
            "max_grad_norm is not an optimizer parameter: remove it and set the "
            'top-level "gradient_clipping" key instead (0 disables clipping)'
        ),
    }

    @model_validator(mode="before")
    @classmethod
    def _explain_misplaced_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, message in cls.misplaced_keys.items():
                if key in data:
                    raise ValueError(message)
        return data


class AdamParams(_OptimizerParams):
    """DeepSpeed ``"Adam"``: decoupled weight decay (AdamW) unless ``adam_w_mode`` is false.

    DeepSpeed 0.19.8 builds its FusedAdam for this type (on CPU, the same C++ kernel as its CPU
    Adam): bias-corrected, ``p -= lr * wd * p`` then ``p -= lr / (1 - b1^t) * m / (sqrt(v) /
    sqrt(1 - b2^t) + eps)``. torch's AdamW is that update; the two kernels round differently
    (about 1e-7 relative per step), nothing else.
    """

    lr: NonNegFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: NonNegFloat = 1e-8
    weight_decay: NonNegFloat = 0.0
    amsgrad: bool = False
    # DeepSpeed's default: its "Adam" is AdamW. False gives classic Adam (L2 added to the grad).
    adam_w_mode: bool = True
    # Accepted so DeepSpeed configs load; no effect, partita always uses torch's Adam/AdamW.
    torch_adam: bool = False
    # None: torch's fused kernel where it has one for the device, else its default
    # (multi-tensor foreach where supported).
    fused: bool | None = None


class AdamWParams(AdamParams):
    """DeepSpeed ``"AdamW"``: always decoupled weight decay."""

    @field_validator("adam_w_mode")
    @classmethod
    def _always_w_mode(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                'adam_w_mode=false contradicts type "AdamW", which always decouples weight '
                'decay; use type "Adam" with adam_w_mode=false for L2-style weight decay'
            )
        return value


class SGDParams(_OptimizerParams):
    lr: NonNegFloat  # required: no default lr is a safe guess for SGD
    momentum: NonNegFloat = 0.0
    dampening: NonNegFloat = 0.0
    weight_decay: NonNegFloat = 0.0
    nesterov: bool = False

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        if self.nesterov and (self.momentum <= 0.0 or self.dampening != 0.0):
            raise ValueError(
                f"nesterov=true needs momentum > 0 and dampening = 0, got momentum="
                f"{self.momentum} and dampening={self.dampening}; set momentum (e.g. 0.9) "
                "and dampening 0, or nesterov false"
            )
        return self


class LionParams(_OptimizerParams):
    """Defaults are DeepSpeed's FusedLion defaults, not the paper's (lr 1e-4, betas 0.9/0.99)."""

    lr: NonNegFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    weight_decay: NonNegFloat = 0.0


class AdamW8bitParams(_OptimizerParams):
    """bitsandbytes' 8-bit AdamW (partita's defaults, not bitsandbytes' weight_decay 0.01)."""

    lr: NonNegFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: NonNegFloat = 1e-8
    weight_decay: NonNegFloat = 0.0


class Adam8bitParams(AdamW8bitParams):
    """bitsandbytes' 8-bit Adam, whose kernel always decouples weight decay (as AdamW)."""

    adam_w_mode: bool = True

    @model_validator(mode="after")
    def _decoupled_only(self) -> Adam8bitParams:
        # Without weight decay both modes are the same update; with it, refuse rather than
        # silently run AdamW when L2-style decay was asked for.
        if not self.adam_w_mode and self.weight_decay > 0:
            raise ValueError(
                f"adam_w_mode=false with weight_decay={self.weight_decay}: bitsandbytes' 8-bit Adam "
                "only has decoupled (AdamW) weight decay; remove adam_w_mode or use type \"Adam\""
            )
        return self


class _OneBitCommon(_OptimizerParams):
    """What the 1-bit optimizers share. ``cuda_aware`` and ``comm_backend_name`` are accepted so
    DeepSpeed configs load: partita always compresses through torch.distributed (gloo or NCCL,
    whichever the job runs on); the MPI backend is refused."""

    lr: NonNegFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: NonNegFloat = 1e-8
    weight_decay: NonNegFloat = 0.0
    bias_correction: bool = True
    eps_inside_sqrt: bool = False
    amsgrad: bool = False
    cuda_aware: bool = False
    comm_backend_name: str = "nccl"

    @field_validator("comm_backend_name")
    @classmethod
    def _torch_backends(cls, value: str) -> str:
        if value not in ("nccl", "gloo", "hccl", "compressed"):
            raise ValueError(
                f"comm_backend_name {value!r}: partita compresses through torch.distributed collectives on the job's "
                "own backend (no MPI, no cupy); use \"nccl\" (any of nccl, gloo, hccl, compressed means the same here)"
            )
        return value


class OneBitAdamParams(_OneBitCommon):
    """DeepSpeed ``"OneBitAdam"`` (partita/optim/onebit.py): AdamW for ``freeze_step`` steps, then
    frozen variance and 1-bit compressed momentum. Weight decay is decoupled (as DeepSpeed's
    OnebitAdam adds ``weight_decay * p`` to the update)."""

    freeze_step: PosInt = 100000

    @field_validator("bias_correction", "eps_inside_sqrt", "amsgrad")
    @classmethod
    def _only_defaults(cls, value: bool, info: ValidationInfo) -> bool:
        wanted = {"bias_correction": True, "eps_inside_sqrt": False, "amsgrad": False}[info.field_name]
        if value != wanted:
            raise ValueError(
                f"{info.field_name}={str(value).lower()} is not supported by OneBitAdam (its warm-up is torch's AdamW: "
                "bias-corrected, eps outside the square root, no AMSGrad; DeepSpeed's OnebitAdam refuses amsgrad too); "
                f"remove {info.field_name}"
            )
        return value


class _OneBitFamilyParams(_OneBitCommon):
    """What 0/1 Adam and 1-bit LAMB share. DeepSpeed's 0/1 Adam and 1-bit LAMB read
    ``bias_correction`` but never apply it (their updates are uncorrected); it is accepted with that
    meaning here, either value."""

    _kind: ClassVar[str] = ""

    @field_validator("eps_inside_sqrt", "amsgrad")
    @classmethod
    def _only_defaults(cls, value: bool, info: ValidationInfo) -> bool:
        if value:
            raise ValueError(
                f"{info.field_name}=true is not supported by {cls._kind} (as in DeepSpeed's {cls._kind}: eps outside "
                f"the square root, no AMSGrad); remove {info.field_name}"
            )
        return value


class ZeroOneAdamParams(_OneBitFamilyParams):
    """DeepSpeed ``"ZeroOneAdam"`` (0/1 Adam, partita/optim/zero_one_adam.py): the variance refreshed at
    exponentially spaced steps up to ``var_freeze_step``, 1-bit compressed gradients in between, then
    frozen variance and local steps synchronised as 1-bit compressed momentum. DeepSpeed's defaults."""

    _kind: ClassVar[str] = "ZeroOneAdam"
    var_freeze_step: PosInt = 100000
    var_update_scaler: PosInt = 16
    local_step_scaler: PosInt = 32678
    local_step_clipper: PosInt = 16


class OneBitLambParams(_OneBitFamilyParams):
    """DeepSpeed ``"OneBitLamb"`` (1-bit LAMB, partita/optim/onebit_lamb.py): LAMB until
    ``freeze_step``, then 1-bit compressed momentum with the frozen per-parameter LAMB coefficients,
    rescaled by a factor clamped to ``[factor_min, factor_max]`` that moves at most
    ``factor_threshold`` per step. DeepSpeed's defaults."""

    _kind: ClassVar[str] = "OneBitLamb"
    freeze_step: Annotated[JsonInt, Field(ge=2)] = 100000
    max_coeff: NonNegFloat = 10.0
    min_coeff: NonNegFloat = 0.01
    coeff_beta: Beta = 0.9
    factor_max: NonNegFloat = 4.0
    factor_min: NonNegFloat = 0.5
    factor_threshold: Beta = 0.1

    @model_validator(mode="after")
    def _ordered_bounds(self) -> OneBitLambParams:
        for low, high in (("min_coeff", "max_coeff"), ("factor_min", "factor_max")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"{low} ({getattr(self, low)}) is greater than {high} ({getattr(self, high)}): LAMB clamps into "
                    f"[{low}, {high}]; set {low} <= {high}"
                )
        return self


_OPTIMIZER_PARAMS: dict[str, type[_OptimizerParams]] = {
    "Adam": AdamParams,
    "AdamW": AdamWParams,
    "SGD": SGDParams,
    "Lion": LionParams,
    # 8-bit states through bitsandbytes (partita.optim.eight_bit); "Paged": states in CUDA
    # unified memory that page out to the host under pressure (plain 8-bit on CPU).
    "AdamW8bit": AdamW8bitParams,
    "Adam8bit": Adam8bitParams,
    "Lion8bit": LionParams,
    "PagedAdamW8bit": AdamW8bitParams,
    "PagedAdam8bit": Adam8bitParams,
    "PagedLion8bit": LionParams,
    "OneBitAdam": OneBitAdamParams,
    "ZeroOneAdam": ZeroOneAdamParams,
    "OneBitLamb": OneBitLambParams,
}
OPTIMIZER_TYPES: tuple[str, ...] = tuple(_OPTIMIZER_PARAMS)
# DeepSpeed config types partita knows about but does not implement.
_PENDING_OPTIMIZERS = ("Lamb", "Adagrad", "Muon")
_FOUR_BIT = ("AdamW4bit", "Adam4bit")


def _refuse_four_bit(value: Any) -> None:
    if isinstance(value, str) and value.lower() in {name.lower() for name in _FOUR_BIT}:
        raise ValueError(
            f"optimizer type {value!r} is not implemented: partita's low-bit optimizers come from "
            "bitsandbytes, which has no 4-bit optimizer (torchao's 4-bit states are tensor "
            "subclasses partita cannot shard or checkpoint yet); use \"AdamW8bit\""
        )


def _validate_params(
    value: Any,
    info: ValidationInfo,
    models: dict[str, type[StrictSection]],
    base: type[StrictSection],
) -> Any:
    kind = info.data.get("type")
    if kind is None:
        # ``type`` already failed and is being reported; skip params so the one real
        # error is not buried under a list of "unexpected key" errors.
        return base()
    model = models[kind]
    if isinstance(value, model):
        return value
    # A ValidationError raised here is re-rooted under ("params", ...) by pydantic.
    return model.model_validate({} if value is None else value)


class OptimizerConfig(StrictSection):
    """``{"type": "AdamW", "params": {...}}``; ``params`` is the per-type model."""

    type: Literal[
        "Adam", "AdamW", "SGD", "Lion", "AdamW8bit", "Adam8bit", "Lion8bit", "PagedAdamW8bit", "PagedAdam8bit", "PagedLion8bit",
        "OneBitAdam", "ZeroOneAdam", "OneBitLamb",
    ]
    params: SerializeAsAny[_OptimizerParams] = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _canonical(cls, value: Any) -> str:
        _refuse_four_bit(value)
        return _canonical_type(
            value, supported=OPTIMIZER_TYPES, known_elsewhere=_PENDING_OPTIMIZERS, what="optimizer"
        )

    @field_validator("params", mode="before")
    @classmethod
    def _typed_params(cls, value: Any, info: ValidationInfo) -> Any:
        return _validate_params(value, info, _OPTIMIZER_PARAMS, _OptimizerParams)

    @classmethod
    def nested_section(cls, key: str, raw: Mapping[str, Any]) -> type[BaseModel] | None:
        """The params model for the raw section's ``type``, so the loader can name its keys."""
        if key != "params":
            return super().nested_section(key, raw)
        kind = _lookup_type(raw.get("type"), OPTIMIZER_TYPES)
        return None if kind is None else _OPTIMIZER_PARAMS[kind]


# ----------------------------------------------------------------------------- schedulers


class _SchedulerParams(StrictSection):
    """Common base so ``SchedulerConfig.params`` has one declared type."""


class WarmupLRParams(_SchedulerParams):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold.

    ``warmup_max_lr`` None (DeepSpeed 0.19's default) means each param group's own lr.
    ``warmup_num_steps`` must be >= 1 (DeepSpeed refuses 0 too); it is clamped to >= 2.
    Stepped on DeepSpeed's counter (partita/optim/schedulers.py): the first two optimizer
    steps both run at ``warmup_min_lr``, as on DeepSpeed.
    """

    warmup_min_lr: NonNegFloat = 0.0
    warmup_max_lr: NonNegFloat | None = None
    warmup_num_steps: PosInt = 1000
    warmup_type: Literal["log", "linear"] = "log"


def _check_total(total: int, info: ValidationInfo) -> int:
    warmup = info.data.get("warmup_num_steps")
    if warmup is not None and total <= warmup:
        raise ValueError(
            f"total_num_steps ({total}) must be greater than warmup_num_steps ({warmup}): "
            "the decay runs from the end of warmup to total_num_steps; raise total_num_steps "
            "to the number of optimizer steps you will train for"
        )
    return total


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupLR followed by a linear decay to 0 at ``total_num_steps``.

    DeepSpeed defaults ``warmup_max_lr`` to 0.001 here (while WarmupLR inherits the
    optimizer's lr); partita inherits the optimizer's lr in both, so an omitted value
    never silently overrides the optimizer's lr.
    """

    total_num_steps: PosInt  # declared after warmup_num_steps: its check reads that value

    @field_validator("total_num_steps")
    @classmethod
    def _total_after_warmup(cls, value: int, info: ValidationInfo) -> int:
        return _check_total(value, info)


class WarmupCosineLRParams(_SchedulerParams):
    """Ratios of each param group's base lr: warm up, then cosine decay to ``cos_min_ratio``."""

    warmup_min_ratio: Ratio = 0.0
    warmup_num_steps: PosInt = 1000
    cos_min_ratio: Ratio = 0.0001
    warmup_type: Literal["log", "linear"] = "log"
    total_num_steps: PosInt  # declared after warmup_num_steps: its check reads that value

    @field_validator("total_num_steps")
    @classmethod
    def _total_after_warmup(cls, value: int, info: ValidationInfo) -> int:
        return _check_total(value, info)


class OneCycleParams(_SchedulerParams):
    """1Cycle (Smith 2018): lr up then down over one cycle, then optional decay."""

    cycle_min_lr: NonNegFloat
    cycle_max_lr: NonNegFloat
    decay_lr_rate: NonNegFloat = 0.0
    cycle_first_step_size: PosInt = 2000
    cycle_second_step_size: PosInt | None = None
    cycle_first_stair_count: NonNegInt = 0
    cycle_second_stair_count: NonNegInt | None = None
    decay_step_size: NonNegInt = 0
    cycle_momentum: bool = True
    cycle_min_mom: Beta = 0.8
    cycle_max_mom: Beta = 0.9
    decay_mom_rate: NonNegFloat = 0.0


_SCHEDULER_PARAMS: dict[str, type[_SchedulerParams]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
}
SCHEDULER_TYPES: tuple[str, ...] = tuple(_SCHEDULER_PARAMS)
_PENDING_SCHEDULERS = ("LRRangeTest",)


class SchedulerConfig(StrictSection):
    """``{"type": "WarmupLR", "params": {...}}``; ``params`` is the per-type model."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"]
    params: SerializeAsAny[_SchedulerParams] = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _canonical(cls, value: Any) -> str:
        return _canonical_type(
            value, supported=SCHEDULER_TYPES, known_elsewhere=_PENDING_SCHEDULERS, what="scheduler"
        )

    @field_validator("params", mode="before")
    @classmethod
    def _typed_params(cls, value: Any, info: ValidationInfo) -> Any:
        return _validate_params(value, info, _SCHEDULER_PARAMS, _SchedulerParams)

    @classmethod
    def nested_section(cls, key: str, raw: Mapping[str, Any]) -> type[BaseModel] | None:
        """The params model for the raw section's ``type``, so the loader can name its keys."""
        if key != "params":
            return super().nested_section(key, raw)
        kind = _lookup_type(raw.get("type"), SCHEDULER_TYPES)
        return None if kind is None else _SCHEDULER_PARAMS[kind]
