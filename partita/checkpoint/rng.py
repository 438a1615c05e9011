"""Capture and restore a process's random number generators (python, numpy, torch CPU, CUDA).

Each rank has its own generator states (dropout masks differ per rank), so every rank saves
its own. The byte states of torch go into the rank's safetensors file; python's and numpy's
states are integers and go into JSON (the file's metadata), so nothing is pickled.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch

TORCH_CPU_KEY = "rng/torch_cpu"
CUDA_KEY_PREFIX = "rng/cuda/"


def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return ``(json_state, tensors)`` describing every generator of this process."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    json_state = {
        "python": [version, list(internal), gauss],
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    tensors = {TORCH_CPU_KEY: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{CUDA_KEY_PREFIX}{index}"] = state
    return json_state, tensors


def restore_rng(json_state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Set every generator to a state captured by :func:`capture_rng`.

    CUDA states are restored for the devices both runs have (a run resumed on a machine with
    fewer GPUs per process keeps the first ones).
    """
    version, internal, gauss = json_state["python"]
    random.setstate((version, tuple(internal), gauss))
    state = json_state["numpy"]
    np.random.set_state(
        (state["kind"], np.asarray(state["keys"], dtype=np.uint32), state["pos"], state["has_gauss"], state["cached_gaussian"])
    )
    torch.set_rng_state(tensors[TORCH_CPU_KEY].to(torch.uint8).cpu())
    cuda = sorted((int(k[len(CUDA_KEY_PREFIX):]), v) for k, v in tensors.items() if k.startswith(CUDA_KEY_PREFIX))
    if cuda and torch.cuda.is_available():
        for index, value in cuda[: torch.cuda.device_count()]:
            torch.cuda.set_rng_state(value.to(torch.uint8).cpu(), device=index)


def rng_metadata(json_state: dict[str, Any]) -> str:
    """The JSON part as one string, for a safetensors ``__metadata__`` entry."""
    return json.dumps(json_state, separators=(",", ":"))
