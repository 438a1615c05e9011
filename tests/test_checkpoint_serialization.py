"""Checkpoint encoding, in the pytest process: the JSON codec's round trip and what it refuses,
every generator's RNG state (CUDA included) round trip, and that partita never unpickles."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from partita.checkpoint.errors import CheckpointError
from partita.checkpoint.jsoncodec import decode, encode
from partita.checkpoint.rng import capture_rng, restore_rng, rng_metadata


def test_json_codec_round_trip_and_refusal() -> None:
    sink: dict[str, torch.Tensor] = {}
    value = {"a": (1, 2.5, float("inf")), 3: [None, True, "x"], "t": torch.ones(2), "__tuple__": 1}
    encoded = json.loads(json.dumps(encode(value, path="v", sink=sink)))
    back = decode(encoded, tensor=sink.__getitem__)
    assert back.keys() == value.keys() and back["a"] == (1, 2.5, float("inf")) and back[3] == [None, True, "x"]
    assert torch.equal(back["t"], value["t"]) and back["__tuple__"] == 1
    lookalike = {"__tensor__": "not a tensor"}  # a user dict that looks like a marker stays a dict
    assert decode(json.loads(json.dumps(encode(lookalike, path="v", sink={}))), tensor=sink.__getitem__) == lookalike
    with pytest.raises(CheckpointError, match=r"v\['x'\]\[1\] is a numpy.int64"):
        encode({"x": [1, np.int64(2)]}, path="v", sink={})
    # Tensors safetensors cannot store are refused when encoded (before any rank writes).
    with pytest.raises(CheckpointError, match=r"v\['s'\] is a tensor with layout torch.sparse_coo"):
        encode({"s": torch.eye(2).to_sparse()}, path="v", sink={})
    with pytest.raises(CheckpointError, match=r"v\['c'\] is a tensor of dtype torch.complex64.*view_as_real"):
        encode({"c": torch.ones(2, dtype=torch.complex64)}, path="v", sink={})


def test_rng_states_of_every_generator_cuda_included_round_trip(monkeypatch) -> None:
    """python, numpy and torch CPU for real; CUDA through stand-ins (no GPU here): one state per
    device is captured, and restored onto the devices this machine has."""
    cuda_states = [torch.full((16,), 1, dtype=torch.uint8), torch.full((16,), 2, dtype=torch.uint8)]
    restored: list[tuple[int, torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [t.clone() for t in cuda_states])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((device, state)))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    json_state, tensors = capture_rng()
    want = (random.random(), float(np.random.rand()), torch.rand(3))
    assert sorted(tensors) == ["rng/cuda/0", "rng/cuda/1", "rng/torch_cpu"]
    json_state = json.loads(rng_metadata(json_state))  # stored as safetensors metadata text
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    restore_rng(json_state, tensors)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])
    assert len(restored) == 1 and restored[0][0] == 0 and torch.equal(restored[0][1], cuda_states[0])


def test_partita_never_unpickles() -> None:
    """No pickle loads anywhere in the package, and any torch.load passes weights_only=True."""
    package = Path(__file__).resolve().parents[1] / "partita"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            where = f"{path.relative_to(package.parent)}:{node.lineno}"
            if owner == "pickle" and node.func.attr in ("load", "loads", "Unpickler"):
                offenders.append(f"{where} pickle.{node.func.attr}")
            if owner == "torch" and node.func.attr == "load":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    offenders.append(f"{where} torch.load without weights_only=True")
    assert not offenders, offenders
