"""The compiled host AdamW that reads 16-bit gradients (partita/optim/host_adamw_compiled.py) and
the offloaded step that hands it the 16-bit host gradient partition (partita/offload/pipelined_step.py)."""

from __future__ import annotations

import pytest
import torch

from partita.optim.host_adamw_compiled import host_adamw_step
from tests.harness import run_distributed
from tests.test_zero_parity import _config

STEPS = 5


def _run_both(numel: int, grad_dtype: torch.dtype, betas: tuple[float, float], seed: int = 0):
    """Five steps with a changing lr, weight decay and a changing grad scale: the compiled step,
    torch's fused AdamW and torch's plain AdamW, all on the same (upcast) gradients."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(numel, generator=gen)
    ours = [start.clone(), torch.zeros(numel), torch.zeros(numel)]
    fused_p, plain_p = start.clone(), start.clone()
    options = {"lr": 1e-3, "betas": betas, "eps": 1e-8, "weight_decay": 0.1}
    fused = torch.optim.AdamW([fused_p], fused=True, **options)
    plain = torch.optim.AdamW([plain_p], foreach=False, **options)
    for step in range(1, STEPS + 1):
        grad = (torch.randn(numel, generator=gen) * 10.0 ** (1 - step)).to(grad_dtype)
        lr, scale = 1e-3 * 0.6**step, 1.0 + 0.37 * step  # a schedule, and loss scale x clip divisor
        for opt in (fused, plain):
            opt.param_groups[0]["lr"] = lr
        fused.grad_scale = torch.tensor(scale)
        fused_p.grad = grad.float()
        plain_p.grad = grad.float() / torch.tensor(scale)
        fused.step()
        plain.step()
        host_adamw_step(*ours, grad, step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=1e-8, weight_decay=0.1,
                        grad_scale=torch.tensor(scale))
    fused_state, plain_state = fused.state[fused_p], plain.state[plain_p]
    return (ours, [fused_p, fused_state["exp_avg"], fused_state["exp_avg_sq"]],
            [plain_p, plain_state["exp_avg"], plain_state["exp_avg_sq"]])


# 64 x 37: a multiple of 64 (the offload path's bucket ranges); 2**12 + 23: a partition's
# unaligned tail, which torch's kernel steps in its scalar loop.
@pytest.mark.parametrize("numel", [64 * 37, 2**12 + 23])
@pytest.mark.parametrize("grad_dtype,betas", [(torch.bfloat16, (0.9, 0.999)), (torch.bfloat16, (0.3, 0.95)),
                                              (torch.float16, (0.9, 0.95))])
def test_compiled_step_is_bit_identical_to_fused_adamw(numel, grad_dtype, betas) -> None:
    ours, fused, plain = _run_both(numel, grad_dtype, betas)
    for name, got, want, loop in zip(("param", "exp_avg", "exp_avg_sq"), ours, fused, plain):
        assert torch.equal(got, want), f"{name}: {(got != want).sum().item()} of {numel} elements differ"
        # torch's for-loop AdamW rounds its scalars and its lerp differently: fp32 rounding apart.
        torch.testing.assert_close(got, loop, rtol=1e-5, atol=1e-7)


def test_bad_inputs_are_refused_with_the_reason() -> None:
    p, g = torch.zeros(128), torch.zeros(128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exp_avg has 64 elements, param 128"):
        host_adamw_step(p, torch.zeros(64), torch.zeros(128), g, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.0)
    with pytest.raises(ValueError, match="grad must be a flat contiguous"):
        host_adamw_step(p, torch.zeros(128), torch.zeros(128), g.view(2, 64), step=1, lr=1e-3, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="step is the count after this step"):
        host_adamw_step(p, torch.zeros(128), torch.zeros(128), g, step=0, lr=1e-3, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.0)


def _train(configs: list[dict]) -> list[dict]:
    """One rank: each config as given; records how often the compiled step ran, and the dtype of
    the host gradient partition at every step."""
    import partita
    import partita.offload.pipelined_step as pipelined
    from tests.tiny_models import build_model, make_batches, param_groups

    calls = []
    original_step = pipelined.host_adamw_step

    def counting(*args, **kwargs):
        calls.append(args[3].dtype)
        original_step(*args, **kwargs)

    pipelined.host_adamw_step = counting
    out = []
    for cfg in configs:
        calls.clear()
        model = build_model()
        engine, optimizer, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        gas = engine.gradient_accumulation_steps()
        micro = engine.train_micro_batch_size_per_gpu()
        xs, ys = make_batches(4, cfg["train_batch_size"])
        dtypes = []
        for step in range(4):
            for m in range(gas):
                engine.backward(engine(xs[step][m * micro:(m + 1) * micro], ys[step][m * micro:(m + 1) * micro]))
                dtypes.append(str(optimizer.groups[0].grad_partition.dtype))
                engine.step()
        engine.finish_pending_step()
        out.append({"params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
                    "calls": len(calls), "dtypes": dtypes})
        engine.destroy()
    pipelined.host_adamw_step = original_step
    return out


def test_offloaded_engine_steps_on_bf16_host_gradients_bit_identically() -> None:
    cases = [(2, 1, {}), (1, 1, {}), (2, 2, {}), (2, 1, {"delayed_param_update": True}),
             (2, 1, {"overlap_step_with_forward": True})]
    configs = [_config(stage, gas, "bf16", offload_optimizer={"device": "cpu", "buffer_count": 2,
                                                              "host_step_16bit_grads": flag, **extra})
               for stage, gas, extra in cases for flag in (True, False)]
    results = run_distributed(_train, 1, configs)[0]
    for i, (stage, gas, extra) in enumerate(cases):
        sixteen, fp32 = results[2 * i], results[2 * i + 1]
        where = f"stage {stage}, gas {gas}, {extra}"
        for name, want in fp32["params"].items():
            assert torch.equal(sixteen["params"][name], want), f"{where}: {name}"
        assert fp32["calls"] == 0 and set(fp32["dtypes"]) == {"torch.float32"}, where
        if gas == 1:  # the host step read the bf16 partition on every step
            assert sixteen["calls"] >= 4 and set(sixteen["dtypes"]) == {"torch.bfloat16"}, (where, sixteen)
        else:  # accumulation widens the partition to fp32 once, exactly, and stays there
            assert sixteen["calls"] == 0 and sixteen["dtypes"][-1] == "torch.float32", (where, sixteen)


def test_16bit_host_gradients_need_cpu_offload() -> None:
    from partita.config import ConfigError, load_config

    cfg = _config(2, 1, "bf16", offload_optimizer={"device": "nvme", "nvme_path": "/tmp",
                                                   "host_step_16bit_grads": True})
    with pytest.raises(ConfigError, match='host_step_16bit_grads .* needs offload_optimizer.device "cpu" '
                                          r'\(got "nvme"\)'):
        load_config(cfg)


def _correctly_rounded(a: float, b: float, c: float) -> float:
    """fp32(a * b + c) with one rounding (to nearest, ties to even), from exact rationals."""
    import math
    import struct
    from fractions import Fraction

    def f32(x: float) -> float:
        return struct.unpack("f", struct.pack("f", x))[0]

    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = f32(float(exact))
    step = 2.0 ** (math.frexp(near)[1] - 24) if near else 2.0**-149
    candidates = {f32(near + k * step) for k in (-1, 0, 1)} | {f32(near + k * step / 2) for k in (-1, 1)}
    return min(candidates, key=lambda x: (abs(Fraction(x) - exact), struct.unpack("I", struct.pack("f", x))[0] & 1))


def test_emulated_fma_rounds_once_where_fp64_rounds_twice() -> None:
    # a * b just off half an ulp of c: the fp64 sum lands exactly on an fp32 midpoint, and a
    # plain fp64 multiply-add then rounds to the wrong neighbour (double rounding).
    from partita.optim.host_adamw_compiled import _fma_f32

    gen = torch.Generator().manual_seed(3)
    c = (torch.rand(600, generator=gen) + 0.5) * 2.0 ** torch.randint(-6, 6, (600,), generator=gen)
    c = c * torch.where(torch.rand(600, generator=gen) < 0.5, -1.0, 1.0)
    half_ulp = torch.ldexp(torch.ones(600), torch.frexp(c).exponent - 25)
    k = torch.randint(1, 9, (600,), generator=gen).float()
    a = half_ulp * (1 + k * 2.0**-20) * torch.where(torch.rand(600, generator=gen) < 0.5, -1.0, 1.0)
    b = 1 - k * 2.0**-20
    got = _fma_f32(a, b, c)
    want = torch.tensor([_correctly_rounded(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())])
    naive = (a.double() * b.double() + c.double()).float()
    assert (naive != want).sum() > 50  # the cases are real double roundings
    assert torch.equal(got, want)
