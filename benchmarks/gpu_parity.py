"""GPU correctness: ZeRO 0/1/2/3 on NCCL equal single-process torch on the global batch.

The CPU test suite proves parity on gloo; this script proves the same on GPUs, where
collectives run asynchronously on NCCL's own stream while backward goes on. Run with
as many GPUs as there are (each rank on its own GPU):

    torchrun --nproc_per_node 2 benchmarks/gpu_parity.py [STAGES, e.g. 0,1,2,3] [--offload] [--compile]

Rank 0 prints one line per (stage, accumulation, precision) and exits non-zero on a mismatch.
``--offload`` adds the ZeRO-Offload / ZeRO-Infinity variants (the CUDA side of partita/offload:
side streams, pinned staging, host masters feeding NCCL), ``--compile`` torch.compile per block.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import partita  # noqa: E402
from tests.tiny_models import build_model, make_batches, param_groups  # noqa: E402

LR, CLIP, STEPS, GLOBAL_BATCH = 1e-2, 0.5, 4, 8


def reference(device: torch.device) -> dict[str, torch.Tensor]:
    model = build_model().to(device)
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in param_groups(model)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    for step in range(STEPS):
        opt.zero_grad()
        model(xs[step].to(device), ys[step].to(device)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().float() for n, p in model.named_parameters()}


NVME_PATH = "/tmp/partita-parity-nvme"


def variants(stages: list[int], *, offload: bool, compile_blocks: bool) -> list[tuple[int, str, dict, dict]]:
    """(stage, name, extra zero_optimization keys, extra top-level keys) to check."""
    out = [(stage, "plain", {}, {}) for stage in stages]
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # One process: the step reads param.grad range by range, no gradient partition (streamed_step.py).
        out += [(stage, "stream", {"one_rank_gradient_fold": "stream"}, {}) for stage in stages]
    if offload:
        cpu = {"offload_optimizer": {"device": "cpu"}}
        nvme = {"offload_optimizer": {"device": "nvme", "nvme_path": NVME_PATH, "pipeline_read": True,
                                      "pipeline_write": True}, "sub_group_size": 64}
        out += [(s, "offload-cpu", cpu, {}) for s in stages if s > 0]
        out += [(s, "offload-cpu-overlap", {"offload_optimizer": {"device": "cpu", "overlap_step_with_forward": True}}, {})
                for s in stages if s in (1, 2)]
        out += [(2, "offload-cpu-ratio0.5", {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, {}),
                (2, "offload-nvme", nvme, {"aio": {"block_size": 4096}}),
                (3, "offload-param-cpu", {**cpu, "offload_param": {"device": "cpu"}}, {}),
                (3, "offload-param-cpu-gather-master",
                 {**cpu, "offload_param": {"device": "cpu", "gather_from_master": True}}, {}),
                (3, "offload-param-nvme", {"offload_param": {"device": "nvme", "nvme_path": NVME_PATH}},
                 {"aio": {"block_size": 4096}})]
    if compile_blocks:
        out += [(s, "compile", {}, {"compile": {"enabled": True}}) for s in stages]
    return out


def run(stage: int, gas: int, precision: str, zero_extra: dict | None = None, top_extra: dict | None = None) -> dict[str, torch.Tensor]:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 60, "allgather_bucket_size": 50, **(zero_extra or {})},
        "steps_per_print": 1000,
        **(top_extra or {}),
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    model = build_model()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = engine.train_micro_batch_size_per_gpu()
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    for step in range(STEPS):
        for m in range(gas):
            lo = (m * world + rank) * micro
            loss = engine(xs[step][lo : lo + micro].to(engine.device), ys[step][lo : lo + micro].to(engine.device))
            engine.backward(loss)
            engine.step()
    engine.finish_pending_step()  # an overlapped step may still be landing its last buckets
    return {n: p.detach().float() for n, p in model.named_parameters()}


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    stages = [int(s) for s in (args[0] if args else "0,1,2,3").split(",")]
    checks = variants(stages, offload="--offload" in sys.argv, compile_blocks="--compile" in sys.argv)
    Path(NVME_PATH).mkdir(parents=True, exist_ok=True)
    failures = 0
    ref = None
    for precision, tol in (("fp32", 1e-5), ("bf16", 0.05)):
        for stage, name, zero_extra, top_extra in checks:
            for gas in (1, 2):
                if name == "stream" and stage >= 2 and gas > 1:
                    continue  # refused: stages 2-3 sum micro-batches in fp32, "stream" in param.grad
                try:
                    got = run(stage, gas, precision, zero_extra, top_extra)
                except Exception as error:  # noqa: BLE001 - report every variant, then fail
                    failures += 1
                    if dist.get_rank() == 0:
                        print(f"parity {precision} stage={stage} {name} gas={gas} ERROR {type(error).__name__}: {error}",
                              flush=True)
                    continue
                if ref is None:
                    # CPU (gloo) works too, to check this script where there is no GPU.
                    ref = reference(torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                    else torch.device("cpu"))
                worst = max(float((got[n] - r).norm() / r.norm()) for n, r in ref.items())
                ok = worst < tol
                failures += not ok
                if dist.get_rank() == 0:
                    print(f"parity {precision} stage={stage} {name} gas={gas} world={dist.get_world_size()} "
                          f"backend={dist.get_backend()} worst_rel_err={worst:.2e} {'OK' if ok else 'FAIL'}",
                          flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
