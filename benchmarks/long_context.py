"""Long-context benchmarks: longest trainable sequence, tokens/s, sparse attention, sequence parallelism.

    # One H200, issue 16's figures in budgeted runs (JSON rewritten after every row):
    python benchmarks/long_context.py one-gpu --out r.json                 # all phases, --budget-s 480
    # in three commands of under 10 minutes each (benchmarks/results/2026-12-01-report.md):
    python benchmarks/long_context.py one-gpu --skip-plain --skip-levers --budget-s 470 --out a.json
    python benchmarks/long_context.py one-gpu --skip-throughput --skip-sparse --search-steps 2 \
        --lever-seqs 262144 --budget-s 470 --out b.json
    python benchmarks/long_context.py one-gpu --skip-throughput --skip-sparse --skip-plain \
        --lever-seqs 524288 --search-steps 1 --budget-s 560 --out c.json  # the 512k headline
    python benchmarks/long_context.py one-gpu --tiny --out /tmp/t.json     # CPU check of the script
    # One H200, the older per-question commands:
    python benchmarks/long_context.py search --model gpt-1.3b --systems torch,fsdp2,deepspeed,partita --out r.json
    python benchmarks/long_context.py search --model gpt-7b --systems torch,partita --start 16384 --out r7.json
    python benchmarks/long_context.py throughput --model gpt-1.3b --seqs 8192,32768,131072 --out t.json
    python benchmarks/long_context.py sparse --seqs 16384,65536 --out s.json
    python benchmarks/long_context.py kernels --seq 4096 --out k.json   # ring block kernels vs SDPA
    # CPU, tiny sizes (what CI-sized machines can run):
    python benchmarks/long_context.py search --device cpu --model tiny --start 128 --max-seq 1024
    python benchmarks/long_context.py sparse --device cpu --seqs 256,512 --heads 2 --head-dim 16
    python benchmarks/long_context.py sp-steps --device cpu --world 4 --seq 512

``search``: for each system, the longest sequence that trains one optimizer step at micro-batch 1
(bf16 on GPU, every block checkpointed, AdamW), doubling from ``--start`` and then halving the gap
down to ``--granularity``. Each attempt runs in a fresh subprocess, so an out-of-memory attempt
leaves nothing behind for the next. Systems: ``torch`` (what users run: fp32 weights, bf16
autocast, fused AdamW), ``fsdp2`` (``fully_shard`` on one rank, bf16 mixed precision), ``deepspeed`` (ZeRO-3, bf16; only if
installed), ``partita`` (ZeRO-3, bf16, plus ``--partita-config`` JSON merged in for the
long-context options). The reference GPT's learned position table grows with the sequence
(``block_size`` = the sequence); it is included in every system alike.

``one-gpu``: four phases, each skippable (``--skip-throughput``, ``--skip-sparse``, ``--skip-plain``,
``--skip-levers``), within ``--budget-s`` for the whole run. *throughput*: partita with the
long-context levers (every block checkpointed, checkpoints in CPU memory, ``sequence_tiling``
loss and MLP tiles ``--loss-tile`` / ``--mlp-tile``) at ``--throughput-seqs``, tokens/s of the
median step after the first. *sparse*: the ``sparse`` command at ``--sparse-seqs``. *plain*: plain
torch (every block checkpointed, nothing else) at ``--plain-seqs`` ascending, up to its first
failure. *levers*: partita with the levers at ``--lever-seqs`` ascending, up to the first failure.
A length "trains" when, after one priming step at ``--prime-seq`` tokens (so optimizer states and
gradient buffers exist and the peak is a steady-state step's), ``--search-steps`` steps at the
length run with every loss finite; when the budget is short the step count drops (to 1), and an
attempt predicted not to fit is skipped (step time scaled by the square of the length from the
longest attempt done). An attempt cut off at the budget keeps its progress lines (build, priming,
each forward and step with the peak memory so far). ``--tiny``: CPU, the tiny model, tiny lengths.

``throughput``: partita's tokens/s at each of ``--seqs`` (median step after warm-up).
``sparse``: forward + backward time of ``SparseSelfAttention`` (fixed, bigbird; FlexAttention,
compiled on CUDA) against dense causal SDPA at each length.
``sp-steps``: ``--world`` gloo processes train the tiny GPT with ``sequence_parallel_size`` =
world, Ulysses and ring; median step time each.
``kernels``: ring attention's fused block kernels checked against SDPA on this device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the _long_context_* helpers, also when imported from elsewhere
sys.path.insert(0, os.path.dirname(HERE))  # partita from this checkout, in every trial process too

# Here: search, throughput and the command line. _long_context_trial.py: one attempt in its own process;
# _long_context_one_gpu.py: the budgeted one-gpu run; _long_context_attention.py: sparse, kernels, sp-steps.
from _long_context_attention import kernels, sp_steps, sparse  # noqa: E402
from _long_context_one_gpu import one_gpu  # noqa: E402
from _long_context_trial import _attempt, trial  # noqa: E402
from output_paths import output_file  # noqa: E402


def search(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for system in args.systems.split(","):
        attempts, good, bad = [], None, None
        seq = args.start
        while seq <= args.max_seq:  # doubling until the first failure
            row = _attempt(args, system, seq, steps=2)
            attempts.append(row)
            print(json.dumps({"system": system, **row}), flush=True)
            if not row["ok"]:
                bad = seq
                break
            good, seq = seq, seq * 2
        while good is not None and bad is not None and bad - good > args.granularity:  # halve the gap
            mid = (good + bad) // 2 // args.granularity * args.granularity
            if mid in (good, bad):
                break
            row = _attempt(args, system, mid, steps=2)
            attempts.append(row)
            print(json.dumps({"system": system, **row}), flush=True)
            good, bad = (mid, bad) if row["ok"] else (good, mid)
        results[system] = {"longest_seq": good, "first_failure": bad, "attempts": attempts}
    return results


def throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        row = _attempt(args, "partita", seq, steps=args.steps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("one-gpu", "search", "throughput", "sparse", "sp-steps", "kernels", "trial"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="gpt-1.3b", help="tiny, gpt-1.3b or gpt-7b")
    parser.add_argument("--systems", default="torch,fsdp2,deepspeed,partita")
    parser.add_argument("--system", default="partita", help="(trial) the one system to run")
    parser.add_argument("--seq", type=int, default=2048, help="(trial, sp-steps) the sequence length")
    parser.add_argument("--seqs", default="8192,32768,131072", help="(throughput, sparse) lengths to time")
    parser.add_argument("--start", type=int, default=32768)
    parser.add_argument("--max-seq", type=int, default=2**21)
    parser.add_argument("--granularity", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--partita-config", default="{}", help="JSON merged into partita's config (search, throughput)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=128, help="(sparse) block size of the patterns")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--trial-timeout", type=float, default=1800)
    parser.add_argument("--out", type=output_file, default=None)
    levers = parser.add_argument_group("one-gpu (and trial)")
    levers.add_argument("--tiny", action="store_true", help="CPU, the tiny model and tiny lengths: a check of the script")
    levers.add_argument("--budget-s", type=float, default=480, help="wall-clock budget of the whole one-gpu run")
    levers.add_argument("--throughput-seqs", default="8192,32768,131072")
    levers.add_argument("--throughput-systems", default="partita", help="comma list: partita (with levers), torch, torch-levers")
    levers.add_argument("--sparse-seqs", default="16384,65536")
    levers.add_argument("--plain-seqs", default="131072,262144", help="plain torch's lengths, ascending")
    levers.add_argument("--lever-seqs", default="262144,524288,786432,1048576", help="ascending; stops at the first failure")
    levers.add_argument("--lever-systems", default="partita", help="comma list: partita, torch-levers")
    levers.add_argument("--search-steps", type=int, default=3, help="steps per length (fewer when the budget is short)")
    levers.add_argument("--prime-seq", type=int, default=1024, help="a first step at this length allocates optimizer states")
    levers.add_argument("--loss-tile", type=int, default=8192, help="sequence_tiling.loss_tile_tokens")
    levers.add_argument("--mlp-tile", type=int, default=16384, help="sequence_tiling.mlp_tile_tokens")
    levers.add_argument("--progress", default=None, help="(trial) JSON-lines progress file")
    for phase in ("throughput", "sparse", "plain", "levers"):
        levers.add_argument(f"--skip-{phase}", action="store_true")
    args = parser.parse_args(argv)
    if args.what == "one-gpu" and args.tiny:
        args.device, args.model = "cpu", "tiny"
        for name, value in (("throughput_seqs", "64,128"), ("sparse_seqs", "256"), ("plain_seqs", "128,256"),
                            ("lever_seqs", "256,512"), ("loss_tile", 48), ("mlp_tile", 40), ("prime_seq", 32),
                            ("heads", 2), ("head_dim", 16), ("block", 16), ("steps", 2), ("search_steps", 2)):  # fmt: skip
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    if args.what == "one-gpu":
        one_gpu(args)
        return
    if args.what == "trial":
        print(json.dumps(trial(args)), flush=True)
        return
    run = {"search": search, "throughput": throughput, "sparse": sparse, "sp-steps": sp_steps, "kernels": kernels}[args.what]
    result = {"what": args.what, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "model": args.model, "result": run(args)}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
