"""Reading a DeepSpeed checkpoint safely: which files, which tag, and unpickling without code.

DeepSpeed saves with ``torch.save`` (pickle). Unpickling can run any code the file names, so
partita never unpickles freely: every file goes through ``torch.load(weights_only=True)``,
which rebuilds only tensors and plain containers, plus an allow-list of the few DeepSpeed
classes its checkpoints hold (found by reading the checkpoints DeepSpeed 0.19.8 writes at every
ZeRO stage). DeepSpeed need not be installed: each allowed class is replaced by a small
stand-in defined here that only stores the pickled attributes, so no DeepSpeed code runs
either. A file naming any other global is refused with the name.

Layout of a DeepSpeed save directory (runtime/engine.py ``save_checkpoint``)::

    DIR/latest                                          the newest tag (text)
    DIR/<tag>/mp_rank_00_model_states.pt                ZeRO 0-2: module, counters, scheduler,
                                                        param_shapes, client_state (rank 0)
    DIR/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   ZeRO 3: the same, one per rank
    DIR/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   ZeRO 1-3: rank r's optimizer state
    DIR/<tag>/bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt   the same in bf16 (same layout)
"""

from __future__ import annotations

import enum
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["DeepSpeedFiles", "DeepSpeedImportError", "ALLOWED_GLOBALS", "find_files", "safe_load"]


class DeepSpeedImportError(ValueError):
    """A DeepSpeed checkpoint that cannot be imported as given (the message says why and what to do)."""


# ---------------------------------------------------------------------------- stand-ins


class _Attributes:
    """An object rebuilt from its pickled attributes only (no methods of the original run)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)})"


class LossScaler(_Attributes):
    """Stands in for deepspeed.runtime.fp16.loss_scaler.LossScaler (static scale: ``cur_scale``)."""


class DynamicLossScaler(_Attributes):
    """Stands in for deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler (``cur_scale``,
    ``cur_iter``, ``last_overflow_iter``, ``scale_factor``, ``scale_window``, ...)."""


class ZeroStageEnum(enum.IntEnum):
    """Stands in for deepspeed.runtime.zero.config.ZeroStageEnum (the optimizer files' ``zero_stage``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclass
class FragmentAddress:
    """Stands in for deepspeed.utils.tensor_fragment.fragment_address: where a parameter's
    piece lies in a rank's flat partition (ZeRO 1-2 ``param_slice_mappings``)."""

    numel: int = 0
    start: int = 0


# The globals DeepSpeed 0.19.8's checkpoints name beyond torch's own tensor rebuilders
# (pickletools over files written at ZeRO 0-3, fp32/fp16/bf16), each with its stand-in.
ALLOWED_GLOBALS: dict[str, Any] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}

# torch names the refused global as "GLOBAL module.name" (or, for a call, "unrecognized function ...").
_GLOBAL_NAME = re.compile(r"GLOBAL ([\w.]+)|unrecognized function ([^\s]+)")


def safe_load(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` with DeepSpeed's classes allowed as stand-ins.

    Raises DeepSpeedImportError naming the global when the file holds anything else.
    """
    allowed = [(stand_in, name) for name, stand_in in ALLOWED_GLOBALS.items()]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        text = str(error)
        match = _GLOBAL_NAME.search(text)
        name = next((g for g in match.groups() if g), "?") if match else "?"
        raise DeepSpeedImportError(
            f"{path} holds the pickled global {name}, which partita does not unpickle: the importer rebuilds only "
            f"tensors, plain containers and DeepSpeed's {', '.join(n.rsplit('.', 1)[1] for n in ALLOWED_GLOBALS)}, "
            "so a file cannot run code. Save that object in a plain form (numbers, strings, lists, dicts, "
            "tensors), e.g. in the client_state passed to save_checkpoint, and save again"
        ) from None


# ---------------------------------------------------------------------------- files


_MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass
class DeepSpeedFiles:
    """The files of one DeepSpeed tag, in data-parallel rank order."""

    tag_dir: Path
    model_states: list[Path]  # one (ZeRO 0-2) or one per rank (ZeRO 3)
    optim_states: list[Path] = field(default_factory=list)  # one per data-parallel rank (ZeRO 1-3)


def _looks_like_tag(path: Path) -> bool:
    return path.is_dir() and any(_MODEL_STATES.match(p.name) for p in path.iterdir())


def resolve_tag_dir(ds_dir: Path, tag: str | None) -> Path:
    """The tag directory to import: ``--tag``, else ``latest``, else DIR itself when it is a tag."""
    if not ds_dir.is_dir():
        raise DeepSpeedImportError(f"{ds_dir} does not exist or is not a directory; pass DeepSpeed's save_dir")
    if tag is not None:
        if "/" in tag or "\\" in tag or tag in ("", ".", ".."):
            raise DeepSpeedImportError(f"--tag {tag!r} must be one directory name inside {ds_dir}")
        tag_dir = ds_dir / tag
        if not tag_dir.is_dir():
            present = sorted(p.name for p in ds_dir.iterdir() if _looks_like_tag(p))
            raise DeepSpeedImportError(
                f"{ds_dir} has no tag {tag!r} (tags there: {', '.join(present) or 'none'}); pass one of them with --tag"
            )
        return tag_dir
    if _looks_like_tag(ds_dir):
        return ds_dir
    latest = ds_dir / "latest"
    if not latest.is_file():
        present = sorted(p.name for p in ds_dir.iterdir() if _looks_like_tag(p))
        raise DeepSpeedImportError(
            f"{ds_dir} has no 'latest' file and is not a tag directory; pass --tag "
            f"({', '.join(present) or 'no tag directories found there'})"
        )
    name = latest.read_text(encoding="utf-8").strip()
    if not name or "/" in name or not (ds_dir / name).is_dir():
        raise DeepSpeedImportError(
            f"{latest} names tag {name!r}, which is not a directory in {ds_dir}; pass an existing tag with --tag"
        )
    return ds_dir / name


def find_files(tag_dir: Path) -> DeepSpeedFiles:
    """Sort a tag directory's files; refuse layouts the importer does not read (named)."""
    models: dict[tuple[int, int], Path] = {}
    optims: dict[tuple[int, int], Path] = {}
    others = []
    for path in sorted(tag_dir.iterdir()):
        if m := _MODEL_STATES.match(path.name):
            models[(int(m.group(2)), int(m.group(1) or 0))] = path
        elif m := _OPTIM_STATES.match(path.name):
            optims[(int(m.group(3)), int(m.group(2)))] = path
        elif path.name.startswith(("layer_", "expp_rank_")) or path.name.endswith("_expert_states.pt") or "expert" in path.name:
            others.append(path.name)
    if others:
        kind = "pipeline-parallel (layer_*)" if any(n.startswith("layer_") for n in others) else "MoE expert"
        raise NotImplementedError(
            f"{tag_dir} is a {kind} DeepSpeed checkpoint ({others[0]}, ...); the importer reads data-parallel ZeRO "
            "0-3 checkpoints of one model-parallel rank. Convert it with DeepSpeed's zero_to_fp32.py into whole "
            "weights and load those with load_module_only, or train it again under partita"
        )
    if not models:
        raise DeepSpeedImportError(
            f"{tag_dir} holds no DeepSpeed model file (mp_rank_00_model_states.pt or "
            "zero_pp_rank_0_mp_rank_00_model_states.pt); pass a DeepSpeed save_dir or one of its tag directories"
        )
    mp_ranks = sorted({mp for mp, _ in models} | {mp for mp, _ in optims})
    if mp_ranks != [0]:
        raise NotImplementedError(
            f"{tag_dir} is a tensor/model-parallel DeepSpeed checkpoint (model-parallel ranks {mp_ranks}); the importer "
            "reads checkpoints with one model-parallel rank (mp_rank_00) only. Convert it with DeepSpeed's "
            "ds_to_universal.py or zero_to_fp32.py into whole weights first"
        )
    model_list = [models[k] for k in sorted(models)]
    optim_list = [optims[k] for k in sorted(optims)]
    return DeepSpeedFiles(tag_dir=tag_dir, model_states=model_list, optim_states=optim_list)


def deepspeed_hint(load_dir: Path, tag: str | None) -> str | None:
    """Why ``load_checkpoint(load_dir, tag=tag)`` should convert first, when it points at a
    DeepSpeed checkpoint (tag directories of DeepSpeed's files and no partita manifest); else None."""
    if tag is not None:
        tag_dir = load_dir / tag
    elif (load_dir / "latest").is_file():
        try:
            tag_dir = load_dir / (load_dir / "latest").read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
    else:
        tag_dir = load_dir
    try:
        is_deepspeed = _looks_like_tag(tag_dir) and not (tag_dir / "manifest.json").exists()
    except OSError:
        return None
    if not is_deepspeed:
        return None
    return (
        f"{tag_dir} is a DeepSpeed checkpoint, not a partita one; convert it once with "
        f"`partita checkpoint import-deepspeed {load_dir} OUT` and load OUT (it resumes at any world size and ZeRO stage)"
    )
