"""The ``init_inference`` config: DeepSpeed's ``DeepSpeedInferenceConfig`` keys, validated strictly.

``init_inference(model, config=None, **kwargs)`` takes a dict or a JSON path and keyword
arguments; as in DeepSpeed a key given both ways must have the same value (else ValueError,
DeepSpeed's message), and the two are merged. Unlike DeepSpeed (whose pydantic model ignores
nothing but also accepts settings it never reads), every key is checked: an unknown key is a
:class:`ConfigError` naming it and listing the valid keys, and a DeepSpeed setting partita does
not implement is refused with what to do instead, so no setting is silently ignored.

Aliases are DeepSpeed's: ``tp`` (tensor_parallel), ``kernel_inject``, ``tm``
(triangular_masking), ``max_tokens``, ``min_tokens``, ``injection_dict``, ``ckpt_config``,
``args``; the deprecated ``mp_size`` sets ``tensor_parallel.tp_size`` (both together refused, as
DeepSpeed refuses a deprecated key beside its replacement).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, Field, ValidationError

from partita.config.base import ConfigError, JsonInt, Problem, StrictSection, describe_field
from partita.config.suggest import did_you_mean

__all__ = ["DTYPES", "InferenceConfig", "default_inference_config", "describe", "merge_config_and_kwargs",
           "parse_inference_config"]

# DeepSpeed's DtypeEnum spellings (deepspeed/inference/config.py), each mapped to its torch dtype.
DTYPES: dict[str, torch.dtype] = {
    **dict.fromkeys(("torch.float16", "fp16", "float16", "half"), torch.float16),
    **dict.fromkeys(("torch.float32", "fp32", "float32", "float"), torch.float32),
    **dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16", "bfloat"), torch.bfloat16),
    **dict.fromkeys(("torch.int8", "int8"), torch.int8),
}
_DTYPE_NAMES = {torch.float16: "fp16", torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}


class TensorParallelSection(StrictSection):
    """DeepSpeed's ``DeepSpeedTPConfig``."""

    enabled: bool = Field(True, description="false runs the model whole on every rank (tp_size is ignored).")
    tp_size: JsonInt = Field(1, ge=1, description="Ranks each layer is split across (AutoTP plans).")
    tp_grain_size: JsonInt = Field(
        64, ge=1, description="DeepSpeed's granularity of uneven MLP splits; partita splits evenly by heads, so no effect."
    )
    mpu: Any = Field(None, description="Only null: partita builds the tensor group from its topology.")
    tp_group: Any = Field(None, description="Only null: partita builds the tensor group from its topology.")

    @property
    def size(self) -> int:
        return self.tp_size if self.enabled else 1


class OffloadParamSection(StrictSection):
    device: Literal["none", "cpu", "nvme"] = Field("none", description="Where the weights live between uses.")
    pin_memory: bool = Field(True, description="Page-locked host copies (faster, asynchronous transfers).")
    prefetch: JsonInt = Field(1, ge=0, description="partita only: blocks copied ahead of the one running.")


class ZeroSection(StrictSection):
    """DeepSpeed's inference ``zero`` section: stage 3 + ``offload_param`` is ZeRO-Inference."""

    stage: JsonInt = Field(0, ge=0, le=3, description="3 with offload_param streams the weights from host memory.")
    offload_param: OffloadParamSection | None = Field(None, description="{\"device\": \"cpu\", \"pin_memory\": true}")


class WeightQuantSection(StrictSection):
    enabled: bool = True
    num_bits: JsonInt = Field(8, description="8 or 4: weight-only int8 / int4 (torchao).")
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: JsonInt = Field(1, ge=1, description="Only 1 (one scale per output row); use group_size for groups.")
    group_size: JsonInt | None = Field(None, ge=1, description="partita only: input features sharing one scale.")
    quantized_initialization: dict = Field(default_factory=dict)
    post_init_quant: dict = Field(default_factory=dict)


class ActivationQuantSection(StrictSection):
    enabled: bool = Field(False, description="Only false: partita quantizes weights only.")
    num_bits: JsonInt = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: JsonInt = 1


class QKVQuantSection(StrictSection):
    enabled: bool = True


class QuantSection(StrictSection):
    """DeepSpeed's ``QuantizationConfig``; used when ``dtype`` is int8 (as in DeepSpeed)."""

    enabled: bool = True
    activation: ActivationQuantSection = Field(default_factory=ActivationQuantSection)
    weight: WeightQuantSection = Field(default_factory=WeightQuantSection)
    qkv: QKVQuantSection = Field(default_factory=QKVQuantSection)


class MoESection(StrictSection):
    enabled: bool = True
    ep_size: JsonInt = Field(1, ge=1, description="Only 1: experts run where the model holds them.")
    moe_experts: list[JsonInt] = Field(default_factory=lambda: [1])
    type: Literal["standard", "residual"] = "standard"
    ep_mp_group: Any = None
    ep_group: Any = None

    key_aliases: ClassVar[Mapping[str, str]] = {"num_experts": "moe_experts", "expert_group": "ep_group"}


class CheckpointConfigSection(StrictSection):
    checkpoint_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    base_dir: str | None = None


class InferenceConfig(StrictSection):
    """A validated ``init_inference`` config (DeepSpeed's DeepSpeedInferenceConfig keys)."""

    key_aliases: ClassVar[Mapping[str, str]] = {
        "kernel_inject": "replace_with_kernel_inject", "tp": "tensor_parallel", "tm": "triangular_masking",
        "ckpt_config": "checkpoint_config", "injection_dict": "injection_policy", "args": "config",
        "max_tokens": "max_out_tokens", "min_tokens": "min_out_tokens", "expert_group": "ep_group",
        "expert_mp_group": "ep_mp_group",
    }

    replace_with_kernel_inject: bool = Field(
        False, description="Accepted: partita runs the model's own modules (AutoTP layers; compiled with enable_cuda_graph)."
    )
    dtype: str = Field("fp16", description="fp16 (DeepSpeed's default), bf16, fp32 or int8 (weight-only, see quant).")
    tensor_parallel: TensorParallelSection = Field(default_factory=TensorParallelSection)
    enable_cuda_graph: bool = Field(False, description="Decode under torch.compile with CUDA graphs and a static KV cache.")
    use_triton: bool = Field(False, description="Only false: no Triton kernels are injected.")
    triton_autotune: bool = Field(False, description="Only false.")
    zero: ZeroSection = Field(default_factory=ZeroSection)
    triangular_masking: bool = Field(True, description="Only true: the model's own causal masking runs.")
    moe: bool | MoESection = Field(default_factory=MoESection)
    keep_module_on_host: bool = Field(False, description="Leave the module where it is instead of moving it to the GPU.")
    quant: QuantSection = Field(default_factory=QuantSection)
    checkpoint: str | dict | None = Field(None, description="A partita checkpoint or a safetensors weights directory.")
    base_dir: str = Field("", description="Directory a relative checkpoint path is read from.")
    set_empty_params: bool = Field(False, description="Only false.")
    save_mp_checkpoint_path: str | None = Field(None, description="Only null: partita reshards on load instead.")
    checkpoint_config: CheckpointConfigSection = Field(default_factory=CheckpointConfigSection)
    return_tuple: bool = Field(True, description="Accepted: only DeepSpeed's injected layers read it.")
    training_mp_size: JsonInt = Field(1, ge=1, description="The checkpoint's tensor size; partita reads it from the checkpoint.")
    replace_method: str = Field("auto", description="Deprecated by DeepSpeed; no effect.")
    injection_policy: Any = Field(
        None, description="{layer class or name: its row-parallel linear names}: a user-given tensor-parallel split.")
    injection_policy_tuple: Any = Field(None, description="Only null.")
    config: dict | None = Field(None, description="Accepted: DeepSpeed's injected kernels read the model config from it.")
    max_out_tokens: JsonInt = Field(1024, gt=0, description="Most tokens (prompt + generated) one generate may hold.")
    min_out_tokens: JsonInt = Field(1, gt=0, description="Accepted: sizes DeepSpeed's kernel workspace only.")
    transposed_mode: bool = Field(False, description="Only false.")
    mp_size: JsonInt = Field(1, ge=1, description="Deprecated: tensor_parallel.tp_size.")
    mpu: Any = Field(None, description="Only null.")
    ep_size: JsonInt = Field(1, ge=1, description="Deprecated: moe.ep_size; only 1.")
    ep_group: Any = None
    ep_mp_group: Any = None
    moe_experts: list[JsonInt] = Field(default_factory=lambda: [1], description="Deprecated: moe.moe_experts.")
    moe_type: Literal["standard", "residual"] = Field("standard", description="Deprecated: moe.type.")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel.size

    @property
    def quant_bits(self) -> int | None:
        """Weight-only quantization bits (8 or 4), or None when weights keep a float dtype."""
        if self.torch_dtype is not torch.int8 or not self.quant.enabled or not self.quant.weight.enabled:
            return None
        return self.quant.weight.num_bits

    @property
    def streams_weights(self) -> bool:
        """ZeRO-Inference: weights live in host memory and stream to the device block by block."""
        offload = self.zero.offload_param
        return self.zero.stage == 3 and offload is not None and offload.device == "cpu"


# ------------------------------------------------------------------------------------ parsing


def merge_config_and_kwargs(config: Mapping[str, Any] | str | os.PathLike | None, kwargs: Mapping[str, Any]) -> dict:
    """DeepSpeed's merge: the config (a dict or a JSON file), then kwargs; a key in both must agree."""
    if config is None:
        raw: dict = {}
    elif isinstance(config, (str, os.PathLike)):
        raw = _read_json(Path(config))
    elif isinstance(config, Mapping):
        raw = dict(config)
    else:
        raise ValueError(f"'config' argument expected string or dictionary, got {type(config)}")
    for key in set(raw) & set(kwargs):
        if raw[key] != kwargs[key]:
            raise ValueError(f"Conflicting argument '{key}' in 'config':{raw[key]} and kwargs:{kwargs[key]}")
    return {**raw, **kwargs}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"init_inference config file not found: {path} (pass a dict or the path of a .json file)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read init_inference config {path}: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"init_inference config {path} must hold a JSON object {{...}}")
    return data


def parse_inference_config(raw: Mapping[str, Any]) -> InferenceConfig:
    """Validate the merged dict; one ConfigError lists every problem (key path, value, fix)."""
    problems: list[Problem] = []
    cleaned = _walk(raw, InferenceConfig, (), problems)
    _deprecated_mp_size(cleaned, problems)
    if "dtype" in cleaned:
        cleaned["dtype"] = _dtype_name(cleaned["dtype"], problems)
    if isinstance(cleaned.get("checkpoint"), os.PathLike):
        cleaned["checkpoint"] = os.fspath(cleaned["checkpoint"])
    config = None
    if not problems:
        try:
            config = InferenceConfig.model_validate(cleaned)
        except ValidationError as error:
            seen: set[str] = set()
            for item in error.errors():
                problem = _from_pydantic(item)
                if problem.path not in seen:  # a union (moe: bool | {...}) reports once per member
                    seen.add(problem.path)
                    problems.append(problem)
    if config is not None:
        problems.extend(_refusals(config))
    if problems:
        raise ConfigError.from_problems(problems, source="init_inference")
    if config.replace_method != "auto":
        warnings.warn("init_inference: replace_method is deprecated by DeepSpeed and has no effect; remove it", stacklevel=3)
    return config


def _walk(raw: Mapping[str, Any], model: type[BaseModel], section: tuple[str, ...], problems: list[Problem]) -> dict:
    """Aliases resolved, unknown keys reported (with the valid keys), nested sections walked."""
    fields = model.model_fields
    aliases: Mapping[str, str] = getattr(model, "key_aliases", {})
    out: dict = {}
    given: dict[str, str] = {}  # field -> the spelling the user wrote first
    for key, value in raw.items():
        path = ".".join((*section, str(key)))
        name = aliases.get(key, key)
        if name not in fields:
            hint = did_you_mean(str(key), [*fields, *aliases])
            where = f"in '{'.'.join(section)}'" if section else "at the top level"
            problems.append(Problem(path, f"unknown key {where}{'; ' + hint if hint else '.'} Valid keys: {', '.join(fields)}", value))
            continue
        if name in out:
            alias = key if key != name else given[name]
            problems.append(Problem(path, f"'{alias}' is DeepSpeed's other name for '{name}', and both are given; keep one", value))
            continue
        given[name] = key
        nested = _section_model(fields[name].annotation)
        if nested is not None and isinstance(value, Mapping):
            value = _walk(value, nested, (*section, name), problems)
        out[name] = value
    return out


def _section_model(annotation: Any) -> type[BaseModel] | None:
    from typing import get_args

    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _deprecated_mp_size(cleaned: dict, problems: list[Problem]) -> None:
    if "mp_size" not in cleaned:
        return
    tp = cleaned.setdefault("tensor_parallel", {})
    if not isinstance(tp, dict):
        return
    if "tp_size" in tp:
        problems.append(Problem("mp_size", "Cannot provide deprecated parameter 'mp_size' and replacing parameter "
                                           "'tensor_parallel.tp_size' together; keep tensor_parallel.tp_size", cleaned["mp_size"]))
        return
    warnings.warn("init_inference: mp_size is deprecated (DeepSpeed); use tensor_parallel={'tp_size': k}", stacklevel=4)
    tp["tp_size"] = cleaned["mp_size"]


def _dtype_name(value: Any, problems: list[Problem]) -> Any:
    if isinstance(value, torch.dtype):
        if value in _DTYPE_NAMES:
            return _DTYPE_NAMES[value]
        problems.append(Problem("dtype", f"{value} is not supported; use torch.float16, torch.bfloat16, torch.float32 or torch.int8"))
        return value
    if isinstance(value, str) and value in DTYPES:
        return _DTYPE_NAMES[DTYPES[value]]
    problems.append(Problem("dtype", "not a dtype partita runs inference in; use torch.float16 / torch.bfloat16 / "
                                     f"torch.float32 / torch.int8 or one of the strings {', '.join(DTYPES)}", value))
    return value


def _from_pydantic(error: Mapping[str, Any]) -> Problem:
    loc = [str(p) for p in error["loc"] if not str(p).startswith(("function-", "json-or-python"))]
    # Union members (moe: bool | MoESection) put the member's name into loc: keep the user's keys only.
    loc = [p for p in loc if p not in ("bool", "MoESection", "str", "dict", "int")]
    field = _field_at(loc)
    allowed = describe_field(field) if field is not None else error["msg"]
    path = ".".join(loc) or "(top level)"
    return Problem(path, f"{error['msg'].lower()}; allowed: {allowed}", error.get("input"))


def _field_at(loc: list[str]):
    model: type[BaseModel] | None = InferenceConfig
    field = None
    for part in loc:
        if model is None or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = _section_model(field.annotation)
    return field


def _refusals(cfg: InferenceConfig) -> list[Problem]:
    """DeepSpeed settings partita does not do, each with the way out (only non-default values)."""
    out: list[Problem] = []

    def refuse(path: str, value: Any, message: str) -> None:
        out.append(Problem(path, message, value))

    tp = cfg.tensor_parallel
    if tp.mpu is not None or cfg.mpu is not None:
        refuse("tensor_parallel.mpu", "<object>", "an mpu object is not used by partita: give tensor_parallel.tp_size "
               "and launch tp_size (x replicas) processes; partita builds the tensor group")
    if tp.tp_group is not None:
        refuse("tensor_parallel.tp_group", "<object>", "a process group is not taken: partita builds the tensor group from "
               "its topology (consecutive ranks); give tensor_parallel.tp_size")
    if cfg.use_triton or cfg.triton_autotune:
        refuse("use_triton", True, "partita injects no Triton kernels; set enable_cuda_graph=True to decode under "
               "torch.compile (Inductor generates Triton kernels for the model's own modules)")
    if not cfg.triangular_masking:
        refuse("triangular_masking", False, "partita runs the model's own attention masking; remove the key")
    if cfg.set_empty_params:
        refuse("set_empty_params", True, "partita needs real parameters: build the model (on the meta device is fine "
               "only with checkpoint=) and remove the key")
    if cfg.save_mp_checkpoint_path is not None or cfg.checkpoint_config.save_mp_checkpoint_path is not None:
        refuse("save_mp_checkpoint_path", cfg.save_mp_checkpoint_path, "partita loads a checkpoint at any tp_size directly "
               "(resharding on load), so no pre-sharded copy is needed; remove the key")
    if cfg.checkpoint_config.checkpoint_dir is not None or cfg.checkpoint_config.base_dir is not None:
        refuse("checkpoint_config", cfg.checkpoint_config.model_dump(), "use checkpoint=<dir> (and base_dir) instead")
    if isinstance(cfg.checkpoint, dict):
        refuse("checkpoint", cfg.checkpoint, "DeepSpeed's JSON load policies (Megatron / ds_model checkpoint lists) are "
               "not read: give checkpoint=<partita checkpoint dir> or a directory of safetensors weights")
    if cfg.injection_policy_tuple is not None:
        refuse("injection_policy_tuple", "<tuple>", "DeepSpeed fills this in itself; give injection_policy instead")
    if cfg.injection_policy is not None:
        out.extend(_injection_policy_problems(cfg.injection_policy))
    if cfg.transposed_mode:
        refuse("transposed_mode", True, "only DeepSpeed's injected kernels have a transposed mode; remove the key")
    moe = cfg.moe if isinstance(cfg.moe, MoESection) else None
    if cfg.ep_size > 1 or (moe is not None and moe.ep_size > 1):
        refuse("moe.ep_size", max(cfg.ep_size, moe.ep_size if moe else 1), "expert parallelism at inference is not "
               "implemented: every rank runs all experts of its model; set ep_size to 1")
    weight, act = cfg.quant.weight, cfg.quant.activation
    if weight.num_bits not in (4, 8):
        refuse("quant.weight.num_bits", weight.num_bits, "weight-only quantization is int8 or int4: 8 or 4")
    if weight.q_type != "symmetric":
        refuse("quant.weight.q_type", weight.q_type, "torchao's weight-only int8/int4 is symmetric; use \"symmetric\"")
    if weight.q_groups != 1:
        refuse("quant.weight.q_groups", weight.q_groups, "give quant.weight.group_size (input features per scale) instead "
               "of a group count")
    if act.enabled:
        refuse("quant.activation.enabled", True, "partita quantizes weights only (activations stay in floating point); "
               "set it to false")
    if cfg.zero.stage == 3 and cfg.zero.offload_param is not None and cfg.zero.offload_param.device == "nvme":
        refuse("zero.offload_param.device", "nvme", "inference streams weights from host memory only; use \"cpu\"")
    if cfg.zero.stage in (1, 2):
        refuse("zero.stage", cfg.zero.stage, "inference has no optimizer state or gradients to partition: use 0 "
               "(weights resident) or 3 with offload_param {\"device\": \"cpu\"} (ZeRO-Inference)")
    return out


def _injection_policy_problems(policy: Any) -> list[Problem]:
    """DeepSpeed's user-specified tensor parallelism: {layer class (or its name): the names, inside
    that layer, of the linear layers whose outputs are summed over the tensor ranks}."""
    shape = ("injection_policy must map a layer class (or its name) to the name or tuple of names of its row-parallel "
             "linear layers, e.g. {LlamaDecoderLayer: ('self_attn.o_proj', 'mlp.down_proj')}")
    if not isinstance(policy, Mapping) or not policy:
        return [Problem("injection_policy", shape, "<value>")]
    for layer, names in policy.items():
        named = names if isinstance(names, (tuple, list)) else (names,)
        if not (isinstance(layer, (type, str)) and named and all(isinstance(n, str) and n for n in named)):
            return [Problem("injection_policy", shape, "<value>")]
    return []


def default_inference_config() -> dict:
    """DeepSpeed's ``deepspeed.default_inference_config()``: every key with its default (dtype as a torch dtype)."""
    defaults = InferenceConfig().model_dump()
    defaults["dtype"] = DTYPES[defaults["dtype"]]
    return defaults


def describe(cfg: InferenceConfig) -> str:
    """One line for the log."""
    extra = [f"tp {cfg.tp_size}", f"dtype {cfg.dtype}"]
    if cfg.quant_bits:
        extra.append(f"int{cfg.quant_bits} weights")
    if cfg.streams_weights:
        extra.append("weights streamed from host")
    if cfg.enable_cuda_graph:
        extra.append("compiled decoding")
    return ", ".join(extra)

