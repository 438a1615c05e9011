"""ZeRO-3 at one rank (zero/one_rank_gather.py): local gathers and ``stage3_one_rank_resident``.

One process, BlockNet (a block called twice, tied embedding/head, a frozen layer, an unused
parameter), every parameter sharded (persistence threshold 0), AdamW with weight decay and
clipping, gradient accumulation 2, 3 steps, fp32 and bf16. For each dtype: ZeRO-1, ZeRO-3 (local
gathers, the default) and ZeRO-3 resident give bitwise the same losses, fp32 gradient partitions
(per parameter, at each boundary) and final weights. Then what the two ZeRO-3 modes hold:

- default: between forward and backward the blocks are freed (ParameterNotGatheredError, as
  before); gathering a bf16 unit allocates exactly its parameters' bytes (the send buffer of the
  general gather, another copy of them, is gone); an fp32 unit is copied, not shared;
- resident: no unit hook is registered, every parameter is whole at every point (mid-step reads
  give values); fp32 parameters live in the fp32 master's storage (data_ptr inside it, so
  ``refresh_shards`` writes nothing), bf16 ones in their own; a forward + backward allocates no
  more bytes than ZeRO-1's (no weight-sized copy);
- ``GatheredParameters(modifier_rank=0)`` edits land (in the master and the next forward) in both.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.tiny_models import WIDTH, build_block_model, make_batches

STEPS, GA, MICRO, LR = 3, 2, 2, 1e-2


def _config(stage: int, bf16: bool, resident: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}, "gradient_clipping": 1.0,
            "bf16": {"enabled": bf16}, "steps_per_print": 10**6,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "one_rank_gradient_fold": "early", "stage3_one_rank_resident": resident}}


def _bytes_created(fn) -> int:
    """Bytes of tensor storage allocated while ``fn`` runs (torch.profiler's memory timeline)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    return sum(size for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline
               if action is Action.CREATE)


def _grads(engine, names: dict) -> dict[str, torch.Tensor]:
    out = {}
    for group in engine.zero.optimizer.groups:
        for spec in group.layout.specs:
            part = group.grad_partition
            if part is not None:
                lo = spec.partition_offset
                out[names[group.params[spec.index]]] = part[lo : lo + spec.numel].clone()
    return out


# mode: (stage, stage3_one_rank_resident). "general": ZeRO-3's gather of more ranks (send buffer,
# "collective", unpack), what one rank ran before; "zero2_whole": one_rank_free_weights off;
# "resident_threshold": resident with persistent parameters beside the sharded ones.
MODES = {"zero1": (1, False), "zero2": (2, False), "zero2_whole": (2, False), "general": (3, False),
         "local": (3, False), "resident": (3, True), "resident_threshold": (3, True)}


def _train(mode: str, bf16: bool) -> dict:
    import partita
    from partita.zero import GatheredParameters
    from partita.zero.freed import is_freed

    stage, resident = MODES[mode]
    model = build_block_model()
    config = _config(stage, bf16, resident)
    config["zero_optimization"]["one_rank_free_weights"] = mode != "zero2_whole"
    if mode == "resident_threshold":  # the norms and biases stay whole, written back by the optimizer
        config["zero_optimization"]["stage3_param_persistence_threshold"] = WIDTH
    engine, _, _, _ = partita.initialize(model=model, config=config)
    if mode == "general":
        engine.zero.gatherer._local = None  # the gather of more ranks (send buffer, unpack): ZeRO-3 before
    module = engine.module
    names = {p: n for n, p in module.named_parameters()}
    xs, ys = make_batches(STEPS * GA, MICRO)
    out: dict = {"losses": [], "grads": [], "freed_mid": []}
    for step in range(STEPS):
        for micro in range(GA):
            i = step * GA + micro
            loss = engine(xs[i], ys[i])
            out["freed_mid"].append(sorted(n for p, n in names.items() if is_freed(p)))
            engine.backward(loss)
            out["losses"].append(loss.item())
            if micro == GA - 1:
                out["grads"].append(_grads(engine, names))
            engine.step()
    params = list(module.parameters())
    with GatheredParameters(params):
        out["final"] = {n: p.detach().float().clone() for p, n in names.items()}
    # One more forward + backward (the first micro-batch of an accumulation: no update follows).
    out["fwd_bwd_bytes"] = _bytes_created(lambda: engine.backward(engine(xs[0], ys[0])))
    engine.step()
    gatherer = engine.zero.gatherer
    if gatherer is None:
        return out
    block = module.blocks[0]
    out["resident"] = len(gatherer.resident)
    out["hooks"] = len(gatherer._hooks)
    masters = [g.master.untyped_storage() for g in engine.zero.optimizer.groups]
    trained = [p for p in block.parameters() if p.requires_grad]
    out["in_master"] = [any(m.data_ptr() <= p.data_ptr() < m.data_ptr() + m.nbytes() for m in masters)
                        for p in trained] if not is_freed(trained[0]) else None
    out["unit_bytes"] = sum(p.numel() * p.element_size() for p in block.parameters())
    out["gather_bytes"] = _bytes_created(lambda: gatherer.gather_unit(block))
    out["in_master_gathered"] = [any(m.data_ptr() <= p.data_ptr() < m.data_ptr() + m.nbytes() for m in masters)
                                 for p in trained]
    gatherer.release_unit(block)
    # An edit through GatheredParameters with a modifier rank lands in the master and the weights.
    weight = block.up.weight
    with GatheredParameters([weight], modifier_rank=0):
        weight.data.fill_(0.25)
    with GatheredParameters([weight]):
        out["edited"] = weight.detach().float().clone()
    group = next(g for g in engine.zero.optimizer.groups if any(p is weight for p in g.params))
    spec = next(s for s in group.layout.specs if group.params[s.index] is weight)
    out["edited_master"] = group.master[spec.partition_offset : spec.partition_offset + spec.numel].clone()
    return out


def _body() -> dict:
    return {(mode, bf16): _train(mode, bf16) for bf16 in (False, True) for mode in MODES}


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_distributed(_body, 1, timeout=300)[0]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_one_rank_zero3_is_bitwise_zero1_and_zero3_before(runs, bf16: bool) -> None:
    # ZeRO-1 accumulates param.grad over the micro-batches and folds once; ZeRO-2/3 fold each
    # micro-batch into the fp32 partition: in bf16 those differ by design, so there ZeRO-2 is the peer.
    peers = ["zero2", "zero2_whole", "general"] + ([] if bf16 else ["zero1"])
    want = runs[("zero2", bf16)]
    for mode in peers + ["local", "resident", "resident_threshold"]:
        got = runs[(mode, bf16)]
        assert got["losses"] == want["losses"], mode
        for got_step, want_step in zip(got["grads"], want["grads"], strict=True):
            assert sorted(got_step) == sorted(want_step) and len(want_step) > 8
            for name, value in want_step.items():
                assert torch.equal(got_step[name], value), (mode, name)
        for name, value in want["final"].items():
            assert torch.equal(got["final"][name], value), (mode, name)
    initial = build_block_model().state_dict()
    assert not torch.equal(want["final"]["blocks.0.up.weight"], initial["blocks.0.up.weight"].float())  # it trained


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_default_frees_blocks_and_gathers_without_a_send_buffer(runs, bf16: bool) -> None:
    local = runs[("local", bf16)]
    assert local["resident"] == 0 and local["hooks"] > 0
    # Between forward and backward every block's weights are freed, the root's (embedding, head) whole.
    assert all("blocks.2.up.weight" in freed and "embed.weight" not in freed for freed in local["freed_mid"])
    assert local["in_master"] is None  # freed between uses
    # One copy into the parameters' own storage (fp32 included: it is not shared with the master).
    assert local["gather_bytes"] == local["unit_bytes"]
    assert local["in_master_gathered"] == [False] * len(local["in_master_gathered"])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_resident_keeps_everything_whole_without_hooks(runs, bf16: bool) -> None:
    resident = runs[("resident", bf16)]
    assert resident["resident"] > 8 and resident["hooks"] == 0
    # With a persistence threshold the small parameters stay persistent (the optimizer's).
    assert 0 < runs[("resident_threshold", bf16)]["resident"] < resident["resident"]
    assert resident["freed_mid"] == [[]] * (STEPS * GA)
    assert resident["gather_bytes"] == 0  # whole already
    # fp32: the parameters are the master's storage (no copy of the weights); bf16: their own.
    assert resident["in_master"] == [not bf16] * len(resident["in_master"])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_forward_backward_allocations(runs, bf16: bool) -> None:
    general, local, resident, whole = (runs[(m, bf16)]["fwd_bwd_bytes"] for m in ("general", "local", "resident",
                                                                                  "zero2_whole"))
    # Resident: exactly what ZeRO-2 with whole weights allocates (activations, gradients), no weight copy.
    assert resident == whole
    # Local gathers: each sharded unit's weights once per gather (forward and backward), no send buffers.
    assert resident < local < general


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_gathered_parameters_edits_land(runs, bf16: bool) -> None:
    for mode in ("local", "resident", "general"):
        got = runs[(mode, bf16)]
        assert torch.equal(got["edited"], torch.full_like(got["edited"], 0.25)), mode
        assert torch.equal(got["edited_master"].view(-1), torch.full((got["edited"].numel(),), 0.25)), mode
