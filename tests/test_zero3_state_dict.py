"""ZeRO-3 ``state_dict()`` / ``load_state_dict()`` (partita/zero/state_dict_guard.py).

Freed parameters used to give state-dict entries with 0-byte storage, and reading one
segfaulted. Every read here happens inside ranks started by ``run_distributed``, so a
regression fails the test ("ranks [0] died (exit codes [-11])") instead of killing pytest.
One rank body covers everything; it runs at 1 and at 2 gloo processes.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.tiny_models import build_block_model, build_model, make_batches, param_groups, reference_train_model

LR, CLIP, STEPS, GLOBAL_BATCH = 1e-2, 0.5, 2, 8
CONFIG = {
    "train_batch_size": GLOBAL_BATCH,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
    "gradient_clipping": CLIP,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 1000,
}
BLOCK_PARAM = "blocks.0.up.weight"  # inside a unit: freed after every forward
ROOT_PARAM = "embed.weight"  # the root unit's (tied to head.weight): whole from forward to backward


def _error_of(fn) -> tuple[str, bool, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares type and message
        return type(e).__name__, isinstance(e, RuntimeError), str(e)
    return None


def _describe(sd: dict) -> dict[str, tuple]:
    return {k: (type(v).__name__, tuple(v.shape), str(v.dtype), str(v.device), v.numel()) for k, v in sd.items()}


def _values(sd: dict) -> dict[str, torch.Tensor]:
    from partita.zero.state_dict_guard import NotGatheredPlaceholder

    return {k: v.detach().clone() for k, v in sd.items() if not isinstance(v, NotGatheredPlaceholder)}


def _init_part(out: dict) -> None:
    """A model built under zero.Init, before initialize: freed parameters as well."""
    import partita

    with partita.zero.Init(config_dict_or_path=CONFIG):
        model = build_model()
        inside = model.state_dict()
        out["init_inside"] = {k: v.clone() for k, v in inside.items()}  # the context's ops see whole values
    sd = model.state_dict()
    out["init_after"] = _describe(sd)
    out["init_sum"] = _error_of(lambda: sd["fc1.weight"].sum())
    out["init_load"] = _error_of(lambda: model.load_state_dict(build_model().state_dict()))


def _rank_body() -> dict:
    import io

    import torch.distributed as dist

    import partita
    from partita.zero import GatheredParameters

    out: dict = {}
    _init_part(out)
    model = build_block_model()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=CONFIG)
    rank, world = dist.get_rank(), dist.get_world_size()
    params = list(engine.module.parameters())

    # Outside any gather: keys, shapes and dtypes; values refused with a clear error.
    sd = engine.module.state_dict()
    out["outside"] = _describe(sd)
    out["outside_values"] = _values(sd)  # buffers (never freed) are the usual entries
    w = sd[BLOCK_PARAM]
    out["repr"] = repr(w)
    out["errors"] = {
        "sum": _error_of(lambda: w.sum()),
        "norm": _error_of(lambda: w.norm()),
        "cpu": _error_of(lambda: w.cpu()),
        "clone": _error_of(lambda: w.clone()),
        "equal": _error_of(lambda: torch.equal(w, w)),
        "copy_from": _error_of(lambda: torch.zeros(w.shape).copy_(w)),
        "torch.save": _error_of(lambda: torch.save(sd, io.BytesIO())),
        "len": _error_of(lambda: len(w)),
        "hash": _error_of(lambda: {w}),
    }
    out["submodule"] = _describe(engine.module.blocks[0].state_dict())
    out["keep_vars_live"] = engine.module.state_dict(keep_vars=True)[BLOCK_PARAM] is engine.module.blocks[0].up.weight
    initial = build_block_model().state_dict()
    out["load_outside"] = _error_of(lambda: engine.module.load_state_dict(initial))
    out["load_buffers_only"] = _error_of(
        lambda: engine.module.load_state_dict({"blocks.0.gain": initial["blocks.0.gain"]}, strict=False))
    # No collective in state_dict(): one rank alone may call it.
    if rank == 0:
        engine.module.state_dict()
    if world > 1:
        dist.barrier()

    # Inside GatheredParameters: the real values; they stay readable after the block ends.
    with GatheredParameters(params):
        inside = engine.module.state_dict()
        out["inside"] = _describe(inside)
        out["inside_values"] = _values(inside)
        # (A dict of its own: torch records assign=True in the state dict's _metadata.)
        out["load_assign"] = _error_of(lambda: engine.module.load_state_dict(build_block_model().state_dict(),
                                                                             assign=True))
    out["kept_after_exit"] = _values(inside)

    # Training, with a state_dict() between the first forward and its backward (the root unit is
    # whole there: its entries keep their values past the backward that frees it).
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    micro = engine.train_micro_batch_size_per_gpu()
    mid = None
    for step in range(STEPS):
        lo = rank * micro
        loss = engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro])
        if step == 0:
            mid = engine.module.state_dict()
        engine.backward(loss)
        engine.step()
    out["mid"] = _describe(mid)
    out["mid_values"] = _values(mid)
    with GatheredParameters(params):
        out["trained"] = _values(engine.module.state_dict())

    # Loading: inside GatheredParameters with a modifier rank it reaches the masters.
    with GatheredParameters(params, modifier_rank=0):
        engine.module.load_state_dict(initial)
    with GatheredParameters(params):
        out["reloaded"] = _values(engine.module.state_dict())
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    out["consolidated"] = consolidated if consolidated is None else dict(consolidated)
    out["after_all"] = _describe(engine.module.state_dict())
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def ranks(request) -> list[dict]:
    return run_distributed(_rank_body, request.param, timeout=120)


def _placeholder_keys(described: dict) -> set[str]:
    return {k for k, (kind, *_) in described.items() if kind == "NotGatheredPlaceholder"}


def test_keys_shapes_and_dtypes_are_the_models(ranks) -> None:
    model = build_block_model()
    reference = model.state_dict()
    # Every trainable parameter (persistence threshold 0); frozen ones (blocks.1.up) stay whole.
    sharded = {k for k, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    assert "blocks.1.up.weight" not in sharded and "head.weight" in sharded
    for out in ranks:
        for described in (out["outside"], out["after_all"]):
            assert list(described) == list(reference)  # key order too
            assert _placeholder_keys(described) == sharded
            for k, (kind, shape, dtype, device, numel) in described.items():
                assert (shape, dtype, device, numel) == (tuple(reference[k].shape), str(reference[k].dtype), "cpu",
                                                        reference[k].numel()), k
        # Buffers are real entries with the model's values.
        assert set(out["outside_values"]) == set(reference) - sharded
        for k, v in out["outside_values"].items():
            assert torch.equal(v, reference[k]), k
        assert _placeholder_keys(out["submodule"]) == {"norm.weight", "norm.bias", "up.weight", "up.bias",
                                                       "down.weight", "down.bias"}
        assert out["keep_vars_live"]  # keep_vars=True: the live parameters, as named_parameters()


def test_reading_a_placeholder_raises_a_clear_error(ranks) -> None:
    for out in ranks:
        assert out["repr"].startswith(f"NotGatheredPlaceholder({BLOCK_PARAM!r}, shape=(11, 7), dtype=torch.float32")
        errors = out["errors"]
        assert errors["len"] is None and errors["hash"] is None  # metadata, not values
        for what in ("sum", "norm", "cpu", "clone", "equal", "copy_from", "torch.save"):
            kind, is_runtime_error, message = errors[what]
            assert kind == "ParameterNotGatheredError" and is_runtime_error, (what, errors[what])
            assert "a ZeRO-3 parameter that this rank holds only as a shard" in message, what
            assert "partita.zero.GatheredParameters(list(engine.module.parameters()))" in message, what
            assert "engine.save_16bit_model(" in message and "engine._zero3_consolidated_16bit_state_dict()" in message
        assert f"state_dict entry {BLOCK_PARAM!r} (shape [11, 7], torch.float32)" in errors["sum"][2]
        assert errors["sum"][2].startswith("sum() needs the values")
        assert errors["torch.save"][2].startswith("pickling (torch.save")


def test_loading_into_freed_parameters_raises_and_works_inside_gathered_parameters(ranks) -> None:
    initial = build_block_model().state_dict()
    for out in ranks:
        kind, is_runtime_error, message = out["load_outside"]
        assert kind == "ParameterNotGatheredError" and is_runtime_error
        assert message.startswith("load_state_dict would write 'embed.weight' (shape [13, 7]) into a ZeRO-3 parameter")
        assert "GatheredParameters(list(engine.module.parameters()), modifier_rank=0)" in message
        assert out["load_buffers_only"] is None  # keys of whole tensors load as usual
        kind, _, message = out["load_assign"]
        assert kind == "ParameterNotGatheredError" and "assign=True" in message
        for k, v in initial.items():
            assert torch.equal(out["reloaded"][k], v), k


def test_inside_gathered_parameters_the_values_are_the_torch_models(ranks) -> None:
    initial = build_block_model().state_dict()
    trained, _ = reference_train_model(build_block_model, num_steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR, clip=CLIP)
    for out in ranks:
        assert {kind for kind, *_ in out["inside"].values()} == {"Tensor"}
        for k, v in initial.items():
            assert torch.equal(out["inside_values"][k], v), k
            assert torch.equal(out["kept_after_exit"][k], v), k  # read after the block: not freed under it
        for k, v in trained.items():
            got = out["trained"][k]
            assert (got - v).norm() / v.norm() < 1e-5, k
    for other in ranks[1:]:
        assert all(torch.equal(other["trained"][k], ranks[0]["trained"][k]) for k in ranks[0]["trained"])


def test_a_state_dict_between_forward_and_backward_keeps_the_whole_units_values(ranks) -> None:
    initial = build_block_model().state_dict()
    for out in ranks:
        real = set(out["mid_values"])
        assert {ROOT_PARAM, "head.weight", "norm.weight", "norm.bias"} <= real
        assert BLOCK_PARAM in _placeholder_keys(out["mid"])
        for k in real:
            assert torch.equal(out["mid_values"][k], initial[k]), k  # the values before the first step


def test_consolidated_16bit_state_dict_on_rank_0(ranks) -> None:
    initial = build_block_model().state_dict()  # the last thing loaded
    assert list(ranks[0]["consolidated"]) == list(initial)
    for k, v in initial.items():
        assert torch.equal(ranks[0]["consolidated"][k], v), k
    assert all(out["consolidated"] is None for out in ranks[1:])  # DeepSpeed's: None elsewhere


def test_zero_init_model_before_initialize(ranks) -> None:
    reference = build_model().state_dict()
    for out in ranks:
        for k, v in reference.items():
            assert torch.equal(out["init_inside"][k], v), k
        assert list(out["init_after"]) == list(reference)
        assert "fc1.weight" in _placeholder_keys(out["init_after"])
        assert out["init_after"]["offset"][0] == "Tensor"  # a buffer
        for key in ("init_sum", "init_load"):
            kind, _, message = out[key]
            assert kind == "ParameterNotGatheredError", out[key]
            assert "built under partita.zero.Init" in message and "until partita.initialize" in message
