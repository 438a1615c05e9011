"""Issue 17 item 1, one rank: what partita holds at the memory peak, and that holding less
changes no value.

- each gradient is folded into the fp32 partition as it arrives (reducer [Note: folding on one
  rank]): when the last gradient of a backward arrives, no earlier ``param.grad`` is still alive;
- the partition's first pass copies instead of zero-fill + add (shard_group [Note: first write on
  the device]): unused parameters' ranges are still zero;
- ZeRO-3 keeps no unit whole across the forward's end (param_gatherer [Note: reuse]), but still
  keeps a unit reused inside the forward;
- all of it bitwise equal to the previous rule (fold in ``finish_backward`` from a zeroed partition,
  keep units for the backward), run in the same process.
"""

from __future__ import annotations

import torch

from tests.harness import run_distributed


def _model(twice: bool = False, moe: bool = False):
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    experts = {"moe_every": 2, "moe_experts": 4, "moe_top_k": 2} if moe else {}  # block 1: 4 expert units inside
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=16, **experts))
    if twice:  # block 0 runs twice in every forward: a unit reused inside the forward
        model.blocks[0] = _Twice(model.blocks[0])
    return model


class _Twice(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.inner = torch.nn.ModuleList([block])  # a ModuleList child: its own ZeRO-3 unit
        object.__setattr__(self, "mlp", block.mlp)  # GPT.forward reads block.mlp (not registered twice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner[0](self.inner[0](x))


def _train(stage: int, *, legacy: bool, twice: bool = False, gas: int = 1, fold: str = "early") -> dict:
    import partita
    from partita.zero import reducer as reducer_module
    from partita.zero import shard_group

    model = _model(twice)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20,
                                 "one_rank_gradient_fold": fold},
           "steps_per_print": 10**6}
    engine, _, _, _ = partita.initialize(model=model, config=cfg)
    reducer, groups = engine.zero.reducer, engine.optimizer.groups
    restore = []
    if legacy:
        # The previous rule: leave gradients in param.grad and fold them at the end of backward
        # into a zero-filled partition; keep units across the forward's end (set after step 1).
        reducer.remove_hooks()
        original_hook = reducer._on_grad_ready
        legacy_hook = lambda p: original_hook(p) if not reducer._armed else None  # noqa: E731
        reducer._hooks = [p.register_post_accumulate_grad_hook(legacy_hook) for p in reducer._bucket_of]
        for group in groups:
            group._write_on_device = lambda start, reduced, g=group: g.ensure_grad_partition()[
                start : start + reduced.numel()].add_(reduced)
    alive_at_last: list[int] = []
    params = [p for p in model.parameters() if p.requires_grad]
    last = params[0]  # tok_emb: tied, its gradient is the last of a backward

    def at_last_hook(p):
        alive_at_last.append(sum(q.grad is not None for q in params if q is not last))

    hook = last.register_post_accumulate_grad_hook(at_last_hook)
    g = torch.Generator().manual_seed(1)
    losses = []
    for micro in range(3 * gas):
        x = torch.randint(0, 37, (2, 8), generator=g)
        loss = engine(x, x)[1]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if legacy and micro == 0 and engine.zero.gatherer is not None:
            trace = engine.zero.gatherer.trace  # ready now: no reuse crosses into the backward
            trace.reused_in_backward = [False] * len(trace.reused_in_backward)
    hook.remove()
    kept = engine.zero.gatherer.kept_count if engine.zero.gatherer is not None else None
    return {
        "masters": [grp.master.clone() for grp in groups],
        "states": [{k: v.clone() for k, v in st.items() if torch.is_tensor(v)} for st in engine.optimizer.inner.state.values()],
        "losses": losses, "alive_at_last": alive_at_last, "kept": kept,
    }


def run_cases() -> dict:
    out = {}
    for stage in (1, 2, 3):
        for gas in (1, 2):
            out[(stage, gas)] = (_train(stage, legacy=False, gas=gas), _train(stage, legacy=True, gas=gas))
    out["twice"] = (_train(3, legacy=False, twice=True), _train(3, legacy=True, twice=True))
    # one_rank_gradient_fold "end": the previous rule's fold through the config key (no patching)
    out["end"] = {(stage, gas): _train(stage, legacy=False, gas=gas, fold="end") for stage in (1, 2, 3) for gas in (1, 2)}
    return out


def test_one_rank_folds_early_keeps_no_unit_and_changes_no_value() -> None:
    results = run_distributed(run_cases, 1, timeout=300)[0]
    for case, end in results.pop("end").items():
        early = results[case][0]
        assert end["losses"] == early["losses"], case
        assert all(torch.equal(a, b) for a, b in zip(end["masters"], early["masters"])), case
        for a, b in zip(end["states"], early["states"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), case
        # Every other gradient still held in param.grad when the last one arrives.
        assert end["alive_at_last"][-1] == results[case][1]["alive_at_last"][-1] > 0, case
    for case, (new, old) in results.items():
        assert new["losses"] == old["losses"], case
        for a, b in zip(new["masters"], old["masters"]):
            assert torch.equal(a, b), case
        for a, b in zip(new["states"], old["states"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), case
        # The last (reducing) backward: every other gradient was folded and freed before the last.
        assert new["alive_at_last"][-1] == 0, case
        assert old["alive_at_last"][-1] > 0, case
    # ZeRO-3 at world 1: nothing kept for the backward (old rule: every block), but block 0's
    # reuse inside the forward still is (once per forward after the first step).
    assert results[(3, 1)][0]["kept"] == 0 and results[(3, 1)][1]["kept"] > 0
    assert results["twice"][0]["kept"] == 2


# ----------------------------------------------------------------------------- freed block weights
# zero_optimization.one_rank_free_weights (partita/zero/one_rank_weights.py): at one process, stages
# 0-2 free each block's 16-bit weights after its forward and cast them back from the fp32 master
# before its backward. Against the same run with the key off, in the same process: every loss,
# every gradient (param.grad and the fp32 partition after each backward), masters and states
# bitwise equal; the parameter bytes alive at the start of backward are exactly those outside the
# blocks (embeddings, final norm), which the estimator's start-of-backward phase predicts.


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (NaN gradients of a skipped fp16 step included)."""
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(as_int), b.view(as_int))


def _root_param_bytes(model) -> int:
    outside = [model.tok_emb.weight, model.pos_emb.weight, *model.ln_f.parameters()]  # lm_head is tok_emb
    return sum(p.numel() * p.element_size() for p in outside)


def _live_param_bytes(model) -> int:
    """Bytes held by the parameters' storages, each storage once (MoE experts share one)."""
    storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def _train_freed(stage: int, *, free: bool, checkpoint: bool = False, gas: int = 1, dtype: str = "bf16",
                 edit: bool = False, compile_backend: str | None = None, moe: bool = False,
                 fold: str = "early") -> dict:
    import partita
    from partita.estimate import Setup, estimate_memory
    from partita.estimate.model_info import model_info
    from partita.estimate.result import START_BACKWARD

    model = _model(moe=moe)
    groups = model.optimizer_param_groups(0.1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, dtype: {"enabled": True},
           "zero_optimization": {"stage": stage, "one_rank_free_weights": free, "one_rank_gradient_fold": fold},
           "steps_per_print": 10**6}
    if dtype == "fp16":
        cfg["fp16"].update(initial_scale_power=18, hysteresis=1)  # overflows at first: skipped steps
    if checkpoint:
        cfg["activation_checkpointing"] = {"policy": "every"}
    if compile_backend is not None:
        cfg["compile"] = {"enabled": True, "backend": compile_backend}
    info = model_info(model, param_groups=groups)
    predicted = estimate_memory(info, Setup.from_config(cfg, world_size=1)).total(category="parameters",
                                                                                 phase=START_BACKWARD)
    engine, _, _, _ = partita.initialize(model=model, model_parameters=groups, config=cfg)
    weights = engine.zero.one_rank_weights
    assert (weights is not None) == free, (free, weights)
    params = list(model.parameters())
    whole = sum(p.numel() * p.element_size() for p in params)
    g = torch.Generator().manual_seed(1)
    out = {"losses": [], "grads": [], "partitions": [], "at_start": [], "whole_between": True, "refills": [],
           "at_fold": []}
    if weights is not None:  # parameter bytes alive after each block is cast back in backward
        refill = weights.on_pre_backward
        weights.on_pre_backward = lambda unit: (refill(unit), out["refills"].append(_live_param_bytes(model)))
        # ... and when finish_backward folds the gradients ("end": every block freed again)
        finish = engine.zero.reducer.finish_backward
        engine.zero.reducer.finish_backward = lambda: (out["at_fold"].append(_live_param_bytes(model)), finish())
    for micro in range(4 * gas):
        if edit and micro == 2 * gas:
            # An in-place edit of the model between steps (the master still holds the old values):
            # today's rule uses the edited weights in this forward and backward; the next step's
            # write-back puts the master's in again.
            state = {k: v * 1.5 for k, v in model.state_dict().items()}
            model.load_state_dict(state)
        x = torch.randint(0, 37, (2, 8), generator=g)
        loss = engine(x, x)[1]
        loss.register_hook(lambda grad: out["at_start"].append(_live_param_bytes(model)))
        engine.backward(loss)
        out["grads"].append([None if p.grad is None else p.grad.clone() for p in params])
        out["partitions"].append([None if grp.grad_partition is None else grp.grad_partition.clone()
                                  for grp in engine.optimizer.groups])
        engine.step()
        out["losses"].append(loss.item())
        out["whole_between"] &= _live_param_bytes(model) == whole
    # A training forward that no backward follows leaves blocks freed until the next use; the
    # state_dict and an eval forward see whole weights.
    x = torch.randint(0, 37, (2, 8), generator=g)
    engine(x, x)
    out["after_lone_forward"] = _live_param_bytes(model)
    # Whole: each entry's storage holds all of it (an MoE expert's row lies inside the stacked storage).
    out["state_dict_whole"] = all(v.untyped_storage().nbytes() >= (v.storage_offset() + v.numel()) * v.element_size()
                                  for v in model.state_dict().values())
    engine.eval()
    with torch.no_grad():
        out["eval_logits"] = engine(x)[0].clone()
    out.update(
        masters=[grp.master.clone() for grp in engine.optimizer.groups],
        states=[{k: v.clone() for k, v in st.items() if torch.is_tensor(v)} for st in engine.optimizer.inner.state.values()],
        whole=whole, root=_root_param_bytes(model), predicted=predicted,
        blocks=[sum(p.numel() * p.element_size() for p in block.parameters()) for block in model.blocks],
        freed_count=weights.freed_count if weights is not None else 0, skipped=engine.skipped_steps,
        applied=engine.global_steps - engine.skipped_steps, compiled=engine.is_compiled,
    )
    if compile_backend is not None:
        from partita.compile.apply import compile_stats

        out["graphs"] = sum(s.graphs for s in compile_stats(model).values())
    return out


_FREED_CASES = [dict(stage=stage, checkpoint=ckpt, gas=gas) for stage in (1, 2) for ckpt in (False, True)
                for gas in (1, 2)]
_FREED_CASES += [dict(stage=0), dict(stage=2, dtype="fp16"), dict(stage=2, edit=True),
                 dict(stage=2, compile_backend="aot_eager"), dict(stage=1, checkpoint=True, compile_backend="aot_eager"),
                 dict(stage=2, moe=True)]
# one_rank_gradient_fold "end": blocks freed again after their backward ([Note: freed again after
# the unit's backward]); compared with the key off under the same fold.
_FREED_CASES += [dict(stage=2, fold="end"), dict(stage=1, gas=2, checkpoint=True, fold="end"),
                 dict(stage=2, moe=True, fold="end")]


def run_freed_cases() -> dict:
    from partita.zero.one_rank_weights import build_one_rank_weights

    out = {}
    for case in _FREED_CASES:
        key = tuple(sorted(case.items()))
        off = _train_freed(free=False, **case)  # first: compiled cases then find TorchDynamo's graphs cached
        out[key] = (_train_freed(free=True, **case), off)
    # Where the fp32 master is not the whole model on the weights' device, nothing is freed.
    import partita

    def built(stage: int, dtype: str = "bf16", **zero) -> bool:
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage, **zero}, "steps_per_print": 10**6}
        if dtype != "fp32":
            cfg[dtype] = {"enabled": True}
        engine, _, _, _ = partita.initialize(model=_model(), config=cfg)
        if engine.zero.one_rank_weights is None:
            return False
        assert build_one_rank_weights(engine.module, engine.optimizer.groups, enabled=True, world_size=2,
                                      delayed_update=False) is None  # more than one process
        return True

    # Blocks compiled in a mode that records CUDA graphs (fixed addresses) are never freed.
    from partita.compile.apply import compile_blocks
    from partita.zero.one_rank_weights import _records_cuda_graphs

    records = {}
    for name, kwargs in (("default", {}), ("reduce-overhead", {"mode": "reduce-overhead"}),
                         ("triton.cudagraphs", {"options": {"triton.cudagraphs": True}})):
        model = _model()
        compile_blocks(model, backend="eager", **kwargs)
        records[name] = _records_cuda_graphs(model.blocks[0])
    out["records_cuda_graphs"] = records
    out["built"] = {
        "stage 2": built(2), "stage 3": built(3), "fp32 (parameters are the master)": built(2, "fp32"),
        "offload_optimizer cpu": built(2, offload_optimizer={"device": "cpu"}),
        "offload ratio 0.5": built(1, offload_optimizer={"device": "cpu", "ratio": 0.5}),
    }
    return out


def test_one_rank_freed_block_weights_change_no_value_and_leave_only_the_root_at_backward() -> None:
    results = run_distributed(run_freed_cases, 1, timeout=600)[0]
    assert results.pop("records_cuda_graphs") == {"default": False, "reduce-overhead": True, "triton.cudagraphs": True}
    assert results.pop("built") == {"stage 2": True, "stage 3": False, "fp32 (parameters are the master)": False,
                                    "offload_optimizer cpu": False, "offload ratio 0.5": False}
    for case, (on, off) in results.items():
        assert on["losses"] == off["losses"], case
        for step_on, step_off in zip(on["grads"] + on["partitions"], off["grads"] + off["partitions"], strict=True):
            for a, b in zip(step_on, step_off, strict=True):
                assert (a is None and b is None) or _bitwise_equal(a, b), case
        for a, b in zip(on["masters"], off["masters"], strict=True):
            assert torch.equal(a, b), case
        for a, b in zip(on["states"], off["states"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), case
        assert torch.equal(on["eval_logits"], off["eval_logits"]), case
        assert on["whole_between"] and off["whole_between"] and on["state_dict_whole"], case
        # The start of backward: only the parameters outside the blocks are alive, as predicted.
        micro_steps = len(on["losses"])
        edited = dict(case).get("edit")
        expected = [on["root"]] * micro_steps
        if edited:  # the edited step keeps today's rule (whole); the step after it writes the master back
            gas = dict(case).get("gas", 1)
            expected[2 * gas : 3 * gas] = [on["whole"]] * gas
        assert on["at_start"] == expected, case
        assert off["at_start"] == [off["whole"]] * micro_steps, case
        assert on["predicted"] == on["root"] and off["predicted"] == off["whole"], case
        assert on["freed_count"] == 3 * (micro_steps - (gas if edited else 0)) + 3, case  # 3 blocks per forward
        assert on["after_lone_forward"] == on["root"] and off["after_lone_forward"] == off["whole"], case
        end = dict(case).get("fold") == "end"
        if not edited:  # in backward the blocks come back one by one, last first: the walk's rule
            last_first = on["blocks"][::-1]
            if end:  # ... each freed again once its gradients are in, until finish_backward has folded
                back = [on["root"] + last_first[k] for k in range(3)]
                assert on["at_fold"] == [on["root"]] * micro_steps and off["at_fold"] == [], case
            else:  # ... and stay
                back = [on["root"] + sum(last_first[: k + 1]) for k in range(3)]
                assert on["at_fold"] == [on["whole"]] * micro_steps, case
            assert on["refills"] == back * micro_steps, case
    fp16 = results[(("dtype", "fp16"), ("stage", 2))][0]
    assert fp16["skipped"] > 0 and fp16["applied"] > 0, fp16  # overflows skipped, later steps applied
    # Compiled blocks are freed too, and freeing makes TorchDynamo build no graph the same run
    # without it had not built (guards do not look at storage sizes).
    compiled = [(on, off) for case, (on, off) in results.items() if dict(case).get("compile_backend")]
    assert all(on["compiled"] and off["compiled"] and on["graphs"] == 0 for on, off in compiled)
    assert sum(off["graphs"] for _, off in compiled) > 0
