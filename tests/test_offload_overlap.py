"""offload_optimizer.overlap_step_with_forward: the exact offloaded step run on beside the next
forward, on CPU gloo ranks.

The host step is slowed (each bucket's range sleeps first) so that the next forward really
starts while buckets are still being stepped: a module that did not wait for its buckets would
compute on weights one update old and the results below would differ.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.harness import run_distributed
from tests.test_zero_parity import _check_against_reference, _config

SCHEDULED = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01}}}


def _overlap(flag: bool, **extra) -> dict:
    return {"offload_optimizer": {"device": "cpu", "overlap_step_with_forward": flag, **extra}}


def _slow_host_step(seconds: float = 0.01) -> list[bool]:
    """Make every bucket's host step sleep first; returns a list that records, at each
    ``engine.step()`` return, whether an overlapped update was still in flight."""
    import partita.offload.pipelined_step as pipelined
    import partita.zero.sharded_optimizer as sharded

    original_range = pipelined._step_range

    def slow_range(*args, **kwargs):
        time.sleep(seconds)
        return original_range(*args, **kwargs)

    pipelined._step_range = slow_range
    in_flight = []
    original_step = sharded.ShardedOptimizer.step

    def spy(self, **kwargs):
        result = original_step(self, **kwargs)
        in_flight.append(self.overlapped is not None and self.overlapped.in_flight)
        return result

    sharded.ShardedOptimizer.step = spy
    return in_flight


def train_overlapped(configs: list[dict]) -> dict:
    """train_partita's loop, reading the weights after ``finish_pending_step()`` (the last
    step's update may still be landing when the loop ends, as documented)."""
    import torch.distributed as dist

    import partita
    from tests.test_zero_parity import STEPS
    from tests.tiny_models import build_model, make_batches, param_groups

    in_flight = _slow_host_step()
    results = []
    for cfg in configs:
        model = build_model()
        engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        rank, world = dist.get_rank(), dist.get_world_size()
        gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
        xs, ys = make_batches(STEPS, cfg["train_batch_size"])
        norms = []
        for step in range(STEPS):
            for m in range(gas):
                start = (m * world + rank) * micro
                engine.backward(engine(xs[step][start : start + micro], ys[step][start : start + micro]))
                engine.step()
            norms.append(engine.get_global_grad_norm())
        engine.finish_pending_step()
        results.append({"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms,
                        "steps": engine.global_steps, "skipped": engine.skipped_steps})
        engine.destroy()
    return {"results": results, "in_flight": in_flight}


CASES = [(stage, gas) for stage in (1, 2) for gas in (1, 2)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_overlapped_step_is_bitwise_the_exact_step(world_size: int) -> None:
    # Tiny all-gather buckets (from _config): many buckets per group, so the forward's first
    # modules run while later buckets are still stepping. A scheduler changes the rate every
    # step, so an update that read the next step's rate would differ too.
    configs = [{**_config(stage, gas, **_overlap(flag)), **SCHEDULED} for stage, gas in CASES for flag in (False, True)]
    out = run_distributed(train_overlapped, world_size, configs)
    for rank_out in out:
        results = rank_out["results"]
        for i, (stage, gas) in enumerate(CASES):
            plain, overlapped = results[2 * i], results[2 * i + 1]
            for name, want in plain["params"].items():
                assert torch.equal(overlapped["params"][name], want), f"stage {stage}, gas {gas}: {name}"
            assert overlapped["norms"] == plain["norms"]
        # The first step creates the optimizer state unpipelined; every later step of an
        # overlapped run returned with its host step still running. With 2 ranks the partition
        # is sharded (the write-back is an all-gather): the plain pipelined step runs instead.
        steps = len(results[0]["norms"])
        flags = rank_out["in_flight"]
        for i in range(len(CASES)):
            overlapped_flags = flags[(2 * i + 1) * steps : (2 * i + 2) * steps]
            want = [False] + [world_size == 1] * (steps - 1)
            assert overlapped_flags == want, overlapped_flags


def test_overlapped_step_equals_torch() -> None:
    out = run_distributed(train_overlapped, 2, [_config(2, 1, **_overlap(True))])[0]
    _check_against_reference(out["results"][0], tol=1e-5)


def save_right_after_step(path: str) -> dict:
    """A checkpoint saved right after step() holds the whole update; so does a read of the
    weights after finish_pending_step()."""
    import partita
    from tests.tiny_models import build_model, make_batches, param_groups

    _slow_host_step(0.02)
    out = {}
    for flag in (False, True):
        model = build_model()
        cfg = _config(2, 1, **_overlap(flag))
        engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        xs, ys = make_batches(3, cfg["train_batch_size"])
        for step in range(3):
            engine.backward(engine(xs[step], ys[step]))
            engine.step()
        engine.save_checkpoint(f"{path}/{flag}", tag="t")
        saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
        reloaded = build_model()
        engine2, _, _, _ = partita.initialize(model=reloaded, model_parameters=param_groups(reloaded), config=cfg)
        engine2.load_checkpoint(f"{path}/{flag}", tag="t")
        out[flag] = {"saved": saved, "reloaded": {k: v.clone() for k, v in engine2.module.state_dict().items()}}
        engine.destroy()
        engine2.destroy()
    return out


def test_checkpoint_after_an_overlapped_step_holds_the_whole_update(tmp_path) -> None:
    out = run_distributed(save_right_after_step, 1, str(tmp_path))[0]
    for name, want in out[False]["saved"].items():
        assert torch.equal(out[True]["saved"][name], want), name
        assert torch.equal(out[True]["reloaded"][name], want), name


def failing_host_step(_: None) -> str:
    import partita
    import partita.offload.pipelined_step as pipelined
    from tests.tiny_models import build_model, make_batches, param_groups

    model = build_model()
    cfg = _config(2, 1, **_overlap(True))
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    xs, ys = make_batches(3, cfg["train_batch_size"])
    engine.backward(engine(xs[0], ys[0]))
    engine.step()  # creates the state (not overlapped)

    def broken(*args, **kwargs):
        raise MemoryError("host step failed on purpose")

    pipelined._step_range = broken
    engine.backward(engine(xs[1], ys[1]))
    engine.step()  # returns; the failure happens on the worker
    try:
        engine(xs[2], ys[2])
    except MemoryError as error:
        return f"forward raised: {error}"
    return "forward did not raise"


def test_a_failed_overlapped_host_step_raises_at_the_next_forward() -> None:
    assert run_distributed(failing_host_step, 1, None)[0] == "forward raised: host step failed on purpose"


def test_overlap_refusals_name_the_fix() -> None:
    from partita.config import ConfigError, load_config

    with pytest.raises(ConfigError, match='overlap_step_with_forward .* needs offload_optimizer.device "cpu", '
                                          '"nvme" or "auto" \\(got "none"\\)'):
        load_config(_config(2, 1, **_overlap(True, device="none")))
    # NVMe and tiered layouts overlap too (tests/test_tiered_overlap.py).
    assert load_config(_config(2, 1, **_overlap(True, device="nvme", nvme_path="/tmp"))).zero_optimization.offload_optimizer.overlap_step_with_forward


def stage_three(_: None) -> str:
    import partita
    from partita.config import ConfigError
    from tests.tiny_models import build_model, param_groups

    model = build_model()
    try:
        partita.initialize(model=model, model_parameters=param_groups(model), config=_config(3, 1, **_overlap(True)))
    except ConfigError as error:
        return str(error)
    return "accepted"


def test_overlap_at_stage_three_is_refused() -> None:
    message = run_distributed(stage_three, 1, None)[0]
    assert "overlap_step_with_forward needs ZeRO stage 1 or 2" in message and "use stage 2" in message


def train_delayed_landings(configs: list[dict]) -> dict:
    """Each config with the delayed update landed whole before the next forward (the default)
    and beside it (with overlap_step_with_forward)."""
    import partita
    from tests.test_zero_parity import STEPS
    from tests.tiny_models import build_model, make_batches, param_groups

    in_flight = _slow_host_step()
    out = []
    for cfg in configs:
        for beside_forward in (False, True):
            cfg["zero_optimization"]["offload_optimizer"]["overlap_step_with_forward"] = beside_forward
            model = build_model()
            engine, optimizer, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
            landed_beside = []
            xs, ys = make_batches(STEPS + 1, cfg["train_batch_size"])
            for step in range(STEPS + 1):
                engine.backward(engine(xs[step], ys[step]))
                engine.step()
                landed_beside.append(optimizer.overlapped is not None and optimizer.overlapped.in_flight)
            engine.finish_pending_step()
            out.append({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                        "lr": engine.get_lr(), "landed_beside": landed_beside})
            engine.destroy()
    return {"runs": out, "in_flight": in_flight}


def test_delayed_update_lands_beside_the_forward_bitwise() -> None:
    configs = [{**_config(stage, 1, **_overlap(False, delayed_param_update=True)), **SCHEDULED} for stage in (1, 2)]
    runs = run_distributed(train_delayed_landings, 1, configs)[0]["runs"]
    for stage, (whole, beside) in zip((1, 2), zip(runs[::2], runs[1::2])):
        for name, want in whole["params"].items():
            assert torch.equal(beside["params"][name], want), f"stage {stage}: {name}"
        assert beside["lr"] == whole["lr"]
        # Step 1 has nothing to land; from step 2 on the previous update goes up beside the
        # next forward (step 1's made the state, so the next one steps bucket by bucket).
        assert whole["landed_beside"] == [False] * 4
        assert beside["landed_beside"] == [False, True, True, True], beside["landed_beside"]


def train_gpt(_: None) -> dict:
    """The reference GPT: its blocks wait as wholes (so no hook runs inside a compiled block),
    the embeddings, final norm and head as their own modules."""
    import partita
    from partita.models import GPT, GPTConfig

    in_flight = _slow_host_step(0.002)
    out = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32))
        cfg = {**_config(2, 1, allgather_bucket_size=2000, **_overlap(flag)), "train_batch_size": 2, **SCHEDULED}
        engine, optimizer, _, _ = partita.initialize(model=model, config=cfg)
        hooked = sorted({name for name, m in model.named_modules() if m._forward_pre_hooks})
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            x = torch.randint(0, 64, (2, 16), generator=g)
            loss = engine(x, x)[1]
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.finish_pending_step()
        out[flag] = {"losses": losses, "params": [p.detach().clone() for p in model.parameters()], "hooked": hooked}
        engine.destroy()
    return {**out, "in_flight": in_flight[-4:]}


def test_overlap_on_the_reference_gpt_waits_per_block() -> None:
    out = run_distributed(train_gpt, 1, None)[0]
    assert out[True]["losses"] == out[False]["losses"]
    assert all(torch.equal(a, b) for a, b in zip(out[True]["params"], out[False]["params"]))
    assert out["in_flight"] == [False, True, True, True]
    assert out[True]["hooked"] == ["blocks.0", "blocks.1", "blocks.2", "lm_head", "ln_f", "pos_emb", "tok_emb"]
