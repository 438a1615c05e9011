"""save_16bit_model's file formats, in one process (the multi-rank gathers are covered by
tests/test_zero_export.py and tests/test_hf_models.py): tied weights, buffers, frozen
parameters, and the name deciding the format."""

from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from partita.zero.export import save_16bit_model

# What save_16bit_model needs of a ZeRO state when no parameter is ZeRO-managed (nothing to gather).
NO_ZERO = types.SimpleNamespace(gatherer=None)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([2.0]))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def test_bin_holds_every_state_dict_key_and_loads_with_weights_only(tmp_path) -> None:
    model = Tied()
    path = save_16bit_model(model, NO_ZERO, tmp_path, "pytorch_model.bin")
    blob = torch.load(path, weights_only=True)
    assert list(blob) == list(model.state_dict())  # tied head.weight included, non-persistent buffer not
    assert blob["head.weight"].data_ptr() == blob["embed.weight"].data_ptr()  # stored once, shared on load
    for name, tensor in model.state_dict().items():
        assert torch.equal(blob[name], tensor), name
    fresh = Tied()
    fresh.load_state_dict(blob, strict=True)
    without_frozen = torch.load(save_16bit_model(model, NO_ZERO, tmp_path, "m.pt", exclude_frozen_parameters=True),
                                weights_only=True)
    assert set(blob) - set(without_frozen) == {"frozen.weight", "frozen.bias"}


def test_safetensors_stores_a_tied_weight_once_and_names_the_alias(tmp_path) -> None:
    model = Tied()
    path = save_16bit_model(model, NO_ZERO, tmp_path, "model.safetensors")
    stored = load_file(str(path))
    assert set(stored) == set(model.state_dict()) - {"head.weight"}
    with safe_open(str(path), "pt") as f:
        assert json.loads(f.metadata()["partita_tied"]) == {"head.weight": "embed.weight"}
    assert torch.equal(stored["scale"], torch.tensor([2.0]))
    assert not (tmp_path / "model.safetensors.tmp").exists()


def test_a_name_without_a_known_suffix_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"cannot tell the format from the file name 'weights'; end it in "
                                         r"\.safetensors \(safetensors\) or one of \.bin, \.pt, \.pth"):
        save_16bit_model(Tied(), NO_ZERO, tmp_path, "weights")
    assert list(tmp_path.iterdir()) == []
