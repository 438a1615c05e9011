"""Forward containers keep their types, and zero.Init runs post-construction init code.

- ``partita.tensor_containers.map_tensors``: namedtuples, (frozen) dataclasses, dict
  subclasses (``OrderedDict``, ``defaultdict``, Hugging Face ``ModelOutput``), nesting, one
  result per distinct tensor, untouched containers returned as the same object.
- ZeRO-3 on 2 ranks: blocks returning a namedtuple and a frozen dataclass, a root returning a
  ``ModelOutput``-like ``OrderedDict`` dataclass; a parent ``__init__`` that re-initialises its
  children's parameters after they were sharded (``nn.init`` on a child, ``.data.normal_()``,
  a write through a view, a read of another parameter). Built inside ``zero.Init`` the model
  has exactly an unsharded build's weights, trains like single-process torch, and every
  output container arrives with its own type.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn

from partita.tensor_containers import map_tensors, tensors_in
from tests.harness import run_distributed


class Pair(NamedTuple):
    hidden: torch.Tensor
    aux: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    hidden: torch.Tensor
    note: str = "kept"


@dataclasses.dataclass
class DictOutput(collections.OrderedDict):
    """The shape of transformers' ModelOutput: an OrderedDict whose items mirror dataclass fields."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)


def test_map_tensors_keeps_every_container_type() -> None:
    a, b = torch.ones(2), torch.zeros(3)
    value = {
        "pair": Pair(a, b),
        "frozen": Frozen(a),
        "ordered": collections.OrderedDict(x=a),
        "default": collections.defaultdict(list, y=[b, a]),
        "out": DictOutput(loss=a, logits=b),
        "tuple": (a, "text", 3),
        "size": torch.Size([2, 3]),
    }
    calls = []

    def double(t: torch.Tensor) -> torch.Tensor:
        calls.append(t)
        return t * 2

    got = map_tensors(value, double)
    assert len(calls) == 2  # once per distinct tensor, however often it appears
    assert type(got["pair"]) is Pair and torch.equal(got["pair"].aux, b * 2)
    assert type(got["frozen"]) is Frozen and torch.equal(got["frozen"].hidden, a * 2) and got["frozen"].note == "kept"
    assert type(got["ordered"]) is collections.OrderedDict
    assert type(got["default"]) is collections.defaultdict and got["default"].default_factory is list
    assert got["default"]["y"][1] is got["pair"].hidden  # the same input maps to the same result everywhere
    out = got["out"]
    assert type(out) is DictOutput and out.loss is out["loss"] and torch.equal(out.logits, b * 2)
    assert got["tuple"][1:] == ("text", 3) and got["size"] is value["size"]
    assert value["out"].loss is a  # the input is not modified
    untouched = {"pair": Pair(a, b)}
    assert map_tensors(untouched, lambda t: t) is untouched  # nothing replaced: the very object
    assert [id(t) for t in tensors_in(value)] == [id(a), id(b)]


def test_map_tensors_names_a_container_it_cannot_rebuild() -> None:
    class Strict(tuple):
        def __new__(cls, a, b):
            return super().__new__(cls, (a, b))

    with pytest.raises(TypeError, match=r"could not rebuild a .*Strict after replacing the tensors inside it"):
        map_tensors(Strict(torch.ones(1), torch.ones(1)), lambda t: t + 1)


def test_map_tensors_with_transformers_model_output() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    loss, logits = torch.tensor(1.0), torch.ones(2, 3)
    got = map_tensors(outputs.CausalLMOutputWithPast(loss=loss, logits=logits), lambda t: t + 1)
    assert type(got) is outputs.CausalLMOutputWithPast
    assert float(got.loss) == 2.0 and got["logits"] is got.logits and torch.equal(got[1], logits + 1)
    assert list(got.keys()) == ["loss", "logits"]


# ---------------------------------------------------------------------------------- ZeRO-3, 2 ranks
D, N_BLOCKS, STEPS = 8, 2, 3


class PairBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return Pair(h, h.square().mean())


class FrozenBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return Frozen(torch.tanh(self.lin(x)) + x)


class Net(nn.Module):
    """A parent that re-initialises its sharded children the ways model code does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D, bias=False)
        self.blocks = nn.ModuleList([PairBlock(), FrozenBlock()])
        self.head = nn.Linear(D, 3)
        with torch.no_grad():
            nn.init.normal_(self.blocks[0].lin.weight, std=0.3)  # nn.init on a child
            self.blocks[1].lin.weight.data.normal_(0.0, 0.2)  # through .data
            self.head.weight[0].zero_()  # through a view
            self.head.bias.copy_(self.embed.weight[0, :3] * 2)  # reads another sharded parameter
            self.blocks[1].lin.bias.mul_(0.5)  # reads and writes

    def forward(self, x, y):
        pair = self.blocks[0](self.embed(x))
        frozen = self.blocks[1](pair.hidden)
        logits = self.head(frozen.hidden)
        return DictOutput(loss=nn.functional.cross_entropy(logits, y) + 0.1 * pair.aux, logits=logits)


def _data():
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(4, D, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(STEPS)]


def _config() -> dict:
    return {"train_batch_size": 4, "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 1000}


def _zero3_body() -> dict:
    import torch.distributed as dist

    import partita
    import partita.zero

    torch.manual_seed(0)
    with partita.zero.Init(config_dict_or_path=_config()):
        model = Net()
    engine, _, _, _ = partita.initialize(model=model, config=_config())
    with partita.zero.GatheredParameters(list(model.parameters())):
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    rank, losses, types = dist.get_rank(), [], set()
    block_types = []
    hook = model.blocks[0].register_forward_hook(lambda m, a, out: block_types.append(type(out).__name__))
    for x, y in _data():
        out = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        types.add(type(out).__name__)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
    hook.remove()
    with partita.zero.GatheredParameters(list(model.parameters())):
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"initial": initial, "trained": trained, "losses": losses, "types": sorted(types),
            "block_types": sorted(set(block_types))}


def test_zero3_keeps_output_types_and_init_runs_parent_init_code() -> None:
    torch.manual_seed(0)
    ref_model = Net()
    initial = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    optimizer = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.0)  # partita's default
    ref_losses = []
    for x, y in _data():
        loss = ref_model(x, y).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(float(loss.detach()))
    ranks = run_distributed(_zero3_body, 2)
    for r in ranks:
        assert r["types"] == ["DictOutput"] and r["block_types"] == ["Pair"]
        for name, want in initial.items():
            assert torch.equal(r["initial"][name], want), name
        for name, want in ref_model.named_parameters():
            assert float((r["trained"][name] - want).norm()) <= 1e-5 * float(want.norm()), name
    # Every term is a mean over equal-size micro-batches: the mean of the ranks' losses is torch's.
    for got, want in zip([(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])], ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert initial["head.weight"][0].abs().sum() == 0  # the view write reached the weights
