"""One-GPU MoE GPT benchmark: tokens/s and peak memory of partita's dropless grouped-GEMM MoE,
partita's capacity MoE and DeepSpeed's MoE (``deepspeed.moe.layer.MoE``) in the same run.

    python benchmarks/moe_gpu.py                     # H200: d_model 2048, 8 and 64 experts, seq 2048
    python benchmarks/moe_gpu.py --tiny              # CPU smoke test of the same code (seconds)

The model is the reference GPT (partita/models/gpt.py) with an MoE MLP in every second block
(``--layers`` blocks, default 4: 2 MoE blocks), ``4 * d_model`` experts' width, top-2 routing,
ep_size 1. Every variant trains the same model the same way — bf16 parameters (``--dtype``), torch's
AdamW (fused on a GPU), one micro-batch of ``--micro-batch`` sequences per step — and differs only in the MoE
layer:

- ``partita-dropless``: ``MoE(drop_tokens=False)``, every token routed, the experts run as
  grouped GEMMs (``torch._grouped_mm``; the JSON records whether that path ran);
- ``partita-capacity``: ``MoE(drop_tokens=True)``, capacity buffers and batched GEMMs;
- ``deepspeed-capacity`` / ``deepspeed-dropless``: DeepSpeed's layer with ``drop_tokens`` True /
  False (False pads every expert to the largest expert's count), built from the same expert and
  gate weights and swapped into the same blocks.

Cases run one after another in this process (the DeepSpeed ones need ``deepspeed`` importable:
otherwise, or when a case fails or runs out of memory, its row says why and the others run).
Peak memory is ``torch.cuda.max_memory_allocated`` over each case's timed steps, reset after the
previous case's tensors are freed. Writes ``--out`` (default ``$OUT/moe_gpu.json`` when ``$OUT``
is set, else ``moe_gpu.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # benchmarks/ is not a package
from output_paths import output_file  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

VARIANTS = ("partita-dropless", "partita-capacity", "deepspeed-capacity", "deepspeed-dropless")
FULL = dict(d_model=2048, n_head=16, seq=2048, vocab=50304, experts=(8, 64))
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TINY = dict(d_model=64, n_head=4, seq=64, vocab=256, experts=(4, 8))


def build_model(variant: str, experts: int, args, device: torch.device) -> nn.Module:
    from partita.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.n_head,
                    n_embd=args.d_model, moe_every=2, moe_experts=experts, moe_top_k=2,
                    moe_capacity_factor=args.capacity_factor, moe_drop_tokens=variant.endswith("capacity"))
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    if variant.startswith("deepspeed"):
        _swap_in_deepspeed(model, drop_tokens=variant.endswith("capacity"), capacity_factor=args.capacity_factor)
    return model.to(dtype=_DTYPES[args.dtype])


def _swap_in_deepspeed(model: nn.Module, *, drop_tokens: bool, capacity_factor: float) -> None:
    """Replace every block's partita MoE by DeepSpeed's, with the same initial expert and gate weights
    (partita's MoE has DeepSpeed's module layout, so its state_dict loads into DeepSpeed's as is)."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    for block in model.blocks:
        if not hasattr(block.mlp, "moe"):
            continue
        ours = block.mlp.moe
        expert = copy.deepcopy(ours.experts.deepspeed_experts[0])  # the same expert class (ExpertMLP)
        theirs = DeepSpeedMoE(ours.hidden_size, expert, num_experts=ours.num_experts, ep_size=1, k=2,
                              capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor,
                              min_capacity=ours.min_capacity, drop_tokens=drop_tokens).to(expert.fc1.weight.device)
        # Same module layout, same state_dict keys: DeepSpeed's layer takes partita's weights as they are.
        theirs.load_state_dict(ours.state_dict(), strict=True)
        theirs.set_deepspeed_parallelism()
        block.mlp.moe = theirs
        del ours


def run_case(variant: str, experts: int, args, device: torch.device) -> dict:
    row: dict = {"variant": variant, "experts": experts}
    model = opt = None
    try:
        model = build_model(variant, experts, args, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        row["params"] = sum(p.numel() for p in model.parameters())
        if variant.startswith("partita"):
            row["grouped_mm"] = all(b.mlp.moe.experts.uses_grouped_mm for b in model.blocks if hasattr(b.mlp, "moe"))
        g = torch.Generator(device="cpu").manual_seed(1)
        batches = [torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g).to(device)
                   for _ in range(2)]

        def step(i: int) -> float:
            batch = batches[i % 2]
            _, loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for i in range(args.warmup):
            step(i)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        begin = time.perf_counter()
        for i in range(args.steps):
            loss = step(i)
        _sync(device)
        seconds = time.perf_counter() - begin
        row["step_ms"] = 1e3 * seconds / args.steps
        row["tokens_per_s"] = args.micro_batch * args.seq * args.steps / seconds
        row["final_loss"] = float(loss)
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if variant.startswith("partita"):  # routing over the timed steps (and warm-up), summed over MoE blocks
            stats = [b.mlp.moe.take_routing_stats() for b in model.blocks if hasattr(b.mlp, "moe")]
            row["dropped_fraction"] = sum(s.dropped_fraction for s in stats if s) / max(len(stats), 1)
    except Exception as error:  # noqa: BLE001 - a variant that cannot run (OOM, no deepspeed) is a result
        row["error"] = f"{type(error).__name__}: {error}"[:300]
    finally:
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke test)")
    parser.add_argument("--layers", type=int, default=4, help="GPT blocks; every second one is MoE")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--experts", type=int, nargs="+", default=None)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="parameters' dtype (bf16; --tiny: fp32)")
    parser.add_argument("--out", type=output_file, default=None)
    args = parser.parse_args()
    sizes = TINY if args.tiny else FULL
    for key in ("d_model", "n_head", "seq", "vocab"):
        setattr(args, key, sizes[key])
    args.experts = args.experts or list(sizes["experts"])
    args.dtype = args.dtype or ("fp32" if args.tiny else "bf16")  # CPU bf16 matmuls are slow: --tiny is a smoke test
    if args.tiny:
        args.micro_batch, args.steps, args.warmup = 2, min(args.steps, 3), min(args.warmup, 1)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "moe_gpu.json")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    # DeepSpeed's layer needs torch.distributed (a one-process group; no network: a file store).
    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store.name}",
                            rank=0, world_size=1)
    try:
        import deepspeed

        # DeepSpeed's layer asks deepspeed.comm, which adopts the group started above.
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        ds_version = deepspeed.__version__
    except Exception as error:  # noqa: BLE001
        ds_version = f"not importable: {type(error).__name__}: {error}"[:300]
    began = time.time()
    rows = [run_case(v, e, args, device) for e in args.experts for v in args.variants]
    info = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(began)),
        "command": " ".join(["python", "benchmarks/moe_gpu.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "deepspeed": ds_version, "python": platform.python_version(),
        "model": {k: getattr(args, k) for k in ("layers", "d_model", "n_head", "seq", "vocab", "micro_batch",
                                                 "capacity_factor", "steps", "warmup", "dtype")} | {"top_k": 2, "moe_every": 2},
        "wall_s": time.time() - began, "rows": rows,
    }
    with open(out, "w") as f:
        json.dump(info, f, indent=2)
    print(f"# MoE GPT on {info['device']}: {info['model']} torch {info['torch']}, deepspeed {ds_version}")
    print(f"{'experts':>7} {'variant':<20}{'tokens/s':>12}{'step ms':>10}{'peak GiB':>10}{'vs DS capacity':>16}"
          f"{'dropped':>9}  notes")
    for row in rows:
        if "error" in row:
            print(f"{row['experts']:>7} {row['variant']:<20}  {row['error']}")
            continue
        peer = next((r for r in rows if r["experts"] == row["experts"] and r["variant"] == "deepspeed-capacity"
                     and "tokens_per_s" in r), None)
        ratio = f"{row['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else "-"
        peak = f"{row['peak_gib']:.2f}" if "peak_gib" in row else "-"
        dropped = f"{100 * row['dropped_fraction']:.1f}%" if "dropped_fraction" in row else "-"
        notes = "" if "grouped_mm" not in row else f"grouped_mm={row['grouped_mm']}"
        print(f"{row['experts']:>7} {row['variant']:<20}{row['tokens_per_s']:>12,.0f}{row['step_ms']:>10.1f}"
              f"{peak:>10}{ratio:>16}{dropped:>9}  {notes}")
    print(f"# wrote {out} ({info['wall_s']:.0f} s)")
    dist.destroy_process_group()
    os.unlink(store.name)


if __name__ == "__main__":
    main()
