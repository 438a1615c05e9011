"""Reading a freed parameter in every way a user can (partita/zero/freed.py).

ZeRO-3, ``zero.Init`` before ``initialize`` and one-process weight freeing (stages 0-2) free a
parameter's storage in place while it keeps its shape. Reading one used to read unallocated
memory (a segfault on CPU). Now each read either gives the real values (the parameter is whole:
inside ``GatheredParameters``, a persistent parameter, a unit between its forward and backward),
or raises ``ParameterNotGatheredError``; metadata always answers with the whole parameter's.

Every parameter is read through every access path (``parameters()``, ``named_parameters()``,
``state_dict(keep_vars=True)``, the module attribute: one object, checked; and ``state_dict()``'s
entries) in every way of ``READS``, at each point of a run: inside the ``zero.Init`` context,
after it, after ``initialize``, between a forward and its backward, after a step; outside and
inside ``GatheredParameters``. All reads happen in ranks started by ``run_distributed``, so a
crash fails the test ("ranks [0] died (exit codes [-11])") instead of killing pytest. Training
with all those reads is bitwise the training without them, and matches single-process torch.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.tiny_models import WIDTH, build_block_model, make_batches, param_groups, reference_train_model

LR, CLIP, STEPS, GLOBAL_BATCH = 1e-2, 0.5, 2, 8


def _config(stage: int, *, bf16: bool = False, one_rank_free_weights: bool = True) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "gradient_clipping": CLIP,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": WIDTH,  # norms stay whole
                              "one_rank_free_weights": one_rank_free_weights},
        "steps_per_print": 1000,
    }


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# Every way of reading values; each gives a tensor (compared exactly with the same read of a plain copy).
READS = {
    "sum": lambda p: p.sum(),
    "norm": lambda p: p.float().norm(),
    "data": lambda p: p.data.clone(),
    "data_sum": lambda p: p.data.sum(),
    "detach": lambda p: p.detach().clone(),
    "detach_add": lambda p: p.detach() + 1,
    "clone": lambda p: p.clone(),
    "cpu": lambda p: p.cpu().clone(),
    "float": lambda p: p.float() * 1,
    "to_float64": lambda p: p.to(torch.float64),
    "to_copy": lambda p: p.to("cpu", copy=True),
    "contiguous": lambda p: p.contiguous() + 0,
    "flatten": lambda p: p.flatten().clone(),
    "view": lambda p: p.view(-1).clone(),
    "index": lambda p: p[0].clone(),
    "iterate": lambda p: torch.stack(list(p)),
    "tolist": lambda p: torch.tensor(p.tolist(), dtype=p.dtype),
    "numpy": lambda p: torch.from_numpy(p.detach().float().numpy().copy()),
    "add": lambda p: p + 0,
    "mul_scalar": lambda p: 2 * p,
    "eq": lambda p: p == p.detach().clone(),
    "abs_max": lambda p: p.abs().max(),
    "linear": lambda p: F.linear(torch.ones(3, p.shape[-1], dtype=p.dtype), p),
    "parameters_to_vector": lambda p: torch.nn.utils.parameters_to_vector([p]).clone(),
    "torch.save": lambda p: _roundtrip(p).detach(),
    "pickle": lambda p: pickle.loads(pickle.dumps(p)).detach(),
    "deepcopy": lambda p: copy.deepcopy(p).detach(),
}
# Metadata: always the whole parameter's, freed or not.
META = {
    "shape": lambda p: tuple(p.shape),
    "size": lambda p: tuple(p.size()),
    "numel": lambda p: p.numel(),
    "dim": lambda p: p.dim(),
    "len": lambda p: len(p),
    "dtype": lambda p: str(p.dtype),
    "device": lambda p: str(p.device),
    "requires_grad": lambda p: p.requires_grad,
    "stride": lambda p: tuple(p.stride()),
    "data.shape": lambda p: tuple(p.data.shape),
    "detach.numel": lambda p: p.detach().numel(),
    "is_floating_point": lambda p: p.is_floating_point(),
}


def _outcome(fn, p):
    try:
        value = fn(p)
    except Exception as e:  # noqa: BLE001 - the test compares the type and message
        return ("raised", type(e).__name__, str(e))
    return ("value", value)


def _read_all(model) -> dict:
    """{key: {"same": identity across access paths, "param": {read: outcome}, "entry": {...}, "meta": ..., "repr"}}.
    The parameters are read before ``state_dict()`` is called: one-rank freeing refills every
    block for a state dict (one_rank_weights.py), which would leave nothing freed to read."""
    named = dict(model.named_parameters(remove_duplicate=False))
    listed = list(model.parameters())
    out = {}
    for key, param in named.items():
        module_name, _, attr = key.rpartition(".")
        out[key] = {
            "same": getattr(model.get_submodule(module_name), attr) is param and any(q is param for q in listed),
            "param": {name: _outcome(fn, param) for name, fn in READS.items()},
            "meta": {name: fn(param) for name, fn in META.items()},
            "repr": repr(param),
            "print": str(param),
        }
    kept = model.state_dict(keep_vars=True)
    plain = model.state_dict()
    for key, param in named.items():
        entry = plain[key]
        out[key]["same"] &= kept[key] is param
        out[key]["entry"] = {name: _outcome(fn, entry) for name, fn in READS.items() if name not in ("data", "data_sum")}
        out[key]["entry_meta"] = {name: fn(entry) for name, fn in META.items() if not name.startswith("data")}
    return out


def _state(model) -> dict[str, torch.Tensor]:
    from partita.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {k: p.detach().clone() for k, p in model.named_parameters()}


def _train(*, under_init: bool, reads: bool, stage: int = 3, bf16: bool = False,
           one_rank_free_weights: bool = True) -> dict:
    """Train ``STEPS`` steps; with ``reads``, read everything at every point (outside and inside
    GatheredParameters). Returns the reads, the final whole weights and the losses."""
    import torch.distributed as dist

    import partita
    from partita.zero import GatheredParameters

    config = _config(stage, bf16=bf16, one_rank_free_weights=one_rank_free_weights)
    out: dict = {}
    if under_init:
        with partita.zero.Init(config_dict_or_path=config):
            model = build_block_model()
            if reads:
                out["init_inside"] = _read_all(model)  # the context's ops see whole values
        if reads:
            out["init_after"] = _read_all(model)
    else:
        model = build_block_model()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=config)
    rank = dist.get_rank()
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    micro = engine.train_micro_batch_size_per_gpu()

    def read(point: str) -> None:
        if reads:
            out[point] = _read_all(engine.module)
            with GatheredParameters(list(engine.module.parameters())):
                out[point + "_gathered"] = _read_all(engine.module)
                with GatheredParameters([engine.module.blocks[0].up.weight]):  # nested: leaves it whole
                    pass
                out[point + "_after_nested"] = _outcome(READS["sum"], engine.module.blocks[0].up.weight)

    read("initialized")
    losses = []
    for step in range(STEPS):
        lo = rank * micro
        loss = engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro])
        if step == 0:
            read("mid_step")  # between the forward and its backward
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    read("trained")
    out["final"] = _state(engine.module)
    out["losses"] = losses
    freed_by = getattr(engine.zero.gatherer, "is_sharded_param", None)
    out["sharded"] = sorted(k for k, p in engine.module.named_parameters(remove_duplicate=False)
                            if freed_by is not None and freed_by(p))
    return out


def _zero3_body() -> dict:
    return {
        "init_reads": _train(under_init=True, reads=True),
        "init_quiet": _train(under_init=True, reads=False),
        "plain_reads": _train(under_init=False, reads=True),
        "plain_quiet": _train(under_init=False, reads=False),
    }


def _one_rank_body() -> dict:
    """Stages 0-2 on one process, bf16: blocks' weights freed between forward and backward."""
    return {
        "reads": _train(under_init=False, reads=True, stage=2, bf16=True),
        "quiet": _train(under_init=False, reads=False, stage=2, bf16=True),
        "kept_reads": _train(under_init=False, reads=True, stage=2, bf16=True, one_rank_free_weights=False),
    }


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def zero3(request) -> list[dict]:
    return run_distributed(_zero3_body, request.param, timeout=600)


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return run_distributed(_one_rank_body, 1, timeout=600)[0]


# ------------------------------------------------------------------------------ the checks
def _reference(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    model = build_block_model().to(dtype)
    return {k: p.detach().clone() for k, p in model.named_parameters(remove_duplicate=False)}


def _check_point(reads: dict, truth: dict[str, torch.Tensor], *, freed: set[str], why: str, where: str,
                 freed_entries: set[str] | None = None) -> None:
    """Freed parameters (state_dict entries: ``freed_entries``, default the same): every value read
    raises ParameterNotGatheredError naming it; whole ones: every read gives exactly what the same
    read of the true value gives. Metadata: always the whole parameter's."""
    freed_entries = freed if freed_entries is None else freed_entries
    model = build_block_model()
    requires_grad = {k: p.requires_grad for k, p in model.named_parameters(remove_duplicate=False)}
    assert set(reads) == set(truth), where
    for key, got in reads.items():
        value = truth[key]
        reference = torch.nn.Parameter(value.clone(), requires_grad=requires_grad[key])
        assert got["same"], (where, key)  # parameters(), named_parameters(), keep_vars, attribute: one object
        assert got["meta"] == {name: fn(reference) for name, fn in META.items()}, (where, key)
        assert got["entry_meta"] == {name: fn(reference.detach()) for name, fn in META.items()
                                     if not name.startswith("data")}, (where, key)
        shape = f"(shape {list(value.shape)}, {value.dtype})"
        for kind in ("param", "entry"):
            for name, outcome in got[kind].items():
                if key in (freed if kind == "param" else freed_entries):
                    assert outcome[0] == "raised" and outcome[1] == "ParameterNotGatheredError", (where, key, kind,
                                                                                                  name, outcome)
                    message = outcome[2]
                    assert shape in message, (where, key, name, message)
                    assert "GatheredParameters" in message, message
                    if kind == "entry":
                        assert f"state_dict entry {key!r}" in message, message
                    if why == "zero3":
                        assert "a ZeRO-3 parameter that this rank holds only as a shard" in message, message
                    elif why == "init":
                        assert "built under partita.zero.Init" in message and "until partita.initialize" in message
                    else:
                        assert "one_rank_free_weights" in message and "engine.backward()" in message, message
                else:
                    assert outcome[0] == "value", (where, key, kind, name, outcome)
                    expected = READS[name](reference)
                    assert outcome[1].dtype == expected.dtype and torch.equal(outcome[1], expected), (where, key, name)
        if key in freed:
            assert "freed, not gathered on this rank" in got["repr"] and str(tuple(value.shape)) in got["repr"]
            assert got["print"] == got["repr"]
        else:
            assert got["repr"].startswith("Parameter containing:\ntensor("), (where, key, got["repr"])


def _freed_keys(reads: dict) -> set[str]:
    """Independent of partita's own predicate: a parameter with a whole shape and no storage bytes."""
    return {k for k, got in reads.items() if got["param"]["sum"][0] == "raised"}


def _all_keys() -> set[str]:
    return set(_reference())


def test_zero3_every_read_of_a_freed_parameter_raises_and_every_other_read_is_exact(zero3) -> None:
    initial = _reference()
    for out in zero3:
        for run in ("init_reads", "plain_reads"):
            result = out[run]
            sharded = set(result["sharded"])
            assert {"blocks.0.up.weight", "blocks.2.down.weight", "embed.weight", "head.weight"} <= sharded
            assert "blocks.0.norm.weight" not in sharded  # at most WIDTH elements: persistent, always whole
            if run == "init_reads":
                assert "blocks.1.up.weight" in sharded  # frozen, built under zero.Init: sharded as well
                _check_point(result["init_inside"], initial, freed=set(), why="init", where="init_inside")
                _check_point(result["init_after"], initial, freed=_all_keys(), why="init", where="init_after")
            else:
                assert "blocks.1.up.weight" not in sharded  # frozen, built whole: whole on every rank
            final = result["final"]
            final = {k: final[k if k != "head.weight" else "embed.weight"] for k in initial}
            for point, truth in (("initialized", initial), ("mid_step", initial), ("trained", final)):
                freed = sharded if point != "mid_step" else _freed_keys(result[point])
                _check_point(result[point], truth, freed=freed, why="zero3", where=f"{run}/{point}")
                _check_point(result[point + "_gathered"], truth, freed=set(), why="zero3", where=f"{run}/{point}+G")
                kind, value = result[point + "_after_nested"]
                assert kind == "value" and torch.equal(value, truth["blocks.0.up.weight"].sum()), point
            # Between the forward and its backward: the root unit (embedding, tied head) is whole,
            # the blocks (at world size 1 freed at their forward's end) are not, or are kept whole.
            mid = _freed_keys(result["mid_step"])
            assert not mid & {"embed.weight", "head.weight"} and mid <= sharded
            if len(zero3) == 1:
                assert mid == sharded - {"embed.weight", "head.weight"}


def test_zero3_training_with_every_read_is_bitwise_training_without(zero3) -> None:
    trained, _ = reference_train_model(build_block_model, num_steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR, clip=CLIP)
    for out in zero3:
        for reads, quiet in (("init_reads", "init_quiet"), ("plain_reads", "plain_quiet")):
            assert out[reads]["losses"] == out[quiet]["losses"]
            for k, v in out[quiet]["final"].items():
                assert torch.equal(out[reads]["final"][k], v), (reads, k)
                assert (v - trained[k]).norm() / trained[k].norm() < 1e-5, (quiet, k)  # single-process torch
    for other in zero3[1:]:
        for k, v in zero3[0]["plain_reads"]["final"].items():
            assert torch.equal(other["plain_reads"]["final"][k], v), k


def test_one_rank_weights_between_forward_and_backward(one_rank) -> None:
    initial = _reference(torch.bfloat16)
    result = one_rank["reads"]
    blocks = {k for k in initial if k.startswith("blocks.")
              and k not in ("blocks.1.up.weight", "blocks.1.up.bias", "blocks.2.unused.weight", "blocks.2.unused.bias")}
    final = {k: result["final"][k if k != "head.weight" else "embed.weight"] for k in initial}
    _check_point(result["initialized"], initial, freed=set(), why="one_rank", where="initialized")
    # Freed at the end of each block's training forward: the frozen layer and the never-used
    # Linear too (one_rank_weights frees whole units; refilled before the unit's backward).
    assert _freed_keys(result["mid_step"]) >= {k for k in blocks if "unused" not in k}
    # state_dict() refills every block (one_rank_weights.py): its entries are whole.
    _check_point(result["mid_step"], initial, freed=_freed_keys(result["mid_step"]), why="one_rank", where="mid_step",
                 freed_entries=set())
    _check_point(result["mid_step_gathered"], initial, freed=set(), why="one_rank", where="mid_step+G")
    _check_point(result["trained"], final, freed=set(), why="one_rank", where="trained")
    # GatheredParameters between forward and backward refilled the blocks: the step is bitwise the same.
    assert result["losses"] == one_rank["quiet"]["losses"]
    for k, v in one_rank["quiet"]["final"].items():
        assert torch.equal(result["final"][k], v), k
    kept = one_rank["kept_reads"]  # one_rank_free_weights false: nothing is ever freed
    _check_point(kept["mid_step"], initial, freed=set(), why="one_rank", where="kept/mid_step")
    for k, v in one_rank["quiet"]["final"].items():
        assert torch.equal(kept["final"][k], v), k


def _transformers_body() -> dict:
    """What transformers' own code reads from a ZeRO-3 model outside GatheredParameters."""
    import partita
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.trainer_pt_utils import get_model_param_count

    def build():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=61, n_positions=16))

    plain = build()
    model = build()
    config = {**_config(3), "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = partita.initialize(model=model, config=config)
    sd = model.state_dict()
    return {
        "num_parameters": (model.num_parameters(), plain.num_parameters()),
        "trainable": (model.num_parameters(only_trainable=True), plain.num_parameters(only_trainable=True)),
        "param_count": (get_model_param_count(model), get_model_param_count(plain)),
        "embedding_shape": (tuple(model.get_input_embeddings().weight.shape),
                            tuple(plain.get_input_embeddings().weight.shape)),
        "dtype": (str(model.dtype), str(plain.dtype)),
        "freed": sum(p.untyped_storage().nbytes() == 0 for p in model.parameters()),
        "repr_ok": "GPT2LMHeadModel" in repr(model),
        "save": _outcome(lambda _: torch.save(sd, io.BytesIO()), None)[:2],
    }


def test_transformers_counts_a_zero3_model_outside_gathered_parameters() -> None:
    out = run_distributed(_transformers_body, 1, timeout=300)[0]
    assert out["freed"] > 10  # every parameter but none: threshold 0
    for key in ("num_parameters", "trainable", "param_count", "embedding_shape", "dtype"):
        ours, plain = out[key]
        assert ours == plain, (key, ours, plain)  # DeepSpeed's freed parameters count 0 in num_parameters()
    assert out["repr_ok"]
    assert out["save"] == ("raised", "ParameterNotGatheredError")  # never an empty model written silently
