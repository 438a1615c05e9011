"""Modelled step time of GPT-1.3B at 100-800 Gbps between nodes: ZeRO-3 against ZeRO++ and OneBitAdam.

    python -m benchmarks.comm_model                      # prints the table (a second, no GPU)
    python -m benchmarks.comm_model --json out.json --markdown out.md

Bytes per step are computed from the model's parameter count with partita's own wire formats
(partita/monitor/comm_model.py; tests/test_comm_model.py checks them against the comms logger's
counted bytes of a real run). Compute per step = tokens per rank / a measured rate: 30,100 tokens/s
per H200 for GPT-1.3B (micro-batch 1 x 2048 tokens, one GPU, 2026-12-01 report,
memory_breakdown_stream_final2_mb1_h200_2026-12-01.json). The quantize cost assumes 3,000 GB/s of
achieved memory bandwidth. Each row gives both bounds: no overlap (compute + coding + transfer)
and full overlap (max of the two). hpZ's group is one node (G = ranks per node); OneBitAdam and
OneBitLamb rows are their compressed phase (warm-up steps are the AdamW / LAMB rows); ZeroOneAdam
is the mean step on DeepSpeed's default schedule (the step log's window) and its steady phase 2,
one sync every 16 steps. qgZ is modelled in two hops across nodes, as partita runs it
(an all-to-all inside each node, then one between nodes); the "one hop" row is the single
all-to-all a reduce over a sub-group still uses.
"""

from __future__ import annotations

import argparse
import json

import torch

from partita.models.gpt import GPT, GPTConfig
from partita.monitor import comm_model as cm
from partita.monitor.comm_advice import zero_one_adam_horizon
from partita.optim.config import ZeroOneAdamParams

TOKENS_PER_S = 30_100.0
MEMORY_GBYTES_PER_S = 3000.0


def gpt_1_3b_params() -> tuple[int, int]:
    """(elements, parameter tensors) of GPT-1.3B."""
    with torch.device("meta"):
        model = GPT(GPTConfig.gpt_1_3b())
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)


def plans(numel: int, world: int, ranks_per_node: int, tensors: int = 1) -> dict[str, list[cm.Collective]]:
    # qgZ as partita runs it: two hops across nodes (partita/zero/hierarchical_reduce.py). The one-hop
    # row is what a reduce over a sub-group, or the code before two hops, sends. hpZ's group is one node.
    g = ranks_per_node
    zero_one = ZeroOneAdamParams()  # DeepSpeed's defaults
    horizon = zero_one_adam_horizon(zero_one)
    schedule = dict(var_freeze_step=zero_one.var_freeze_step, var_update_scaler=zero_one.var_update_scaler,
                    local_step_scaler=zero_one.local_step_scaler, local_step_clipper=zero_one.local_step_clipper)
    onebit = dict(parameters=tensors)
    return {
        "ZeRO-3": cm.zero3_collectives(numel, world),
        "ZeRO-3 + qwZ": cm.zero3_collectives(numel, world, weight_bits=8),
        "ZeRO-3 + qgZ (int4)": cm.zero3_collectives(numel, world, grad_bits=4, ranks_per_node=ranks_per_node),
        "ZeRO-3 + qwZ + qgZ (int4)": cm.zero3_collectives(numel, world, weight_bits=8, grad_bits=4,
                                                          ranks_per_node=ranks_per_node),
        "ZeRO-3 + qwZ + qgZ (int4, one hop)": cm.zero3_collectives(numel, world, weight_bits=8, grad_bits=4),
        f"ZeRO-3 + hpZ (G={g})": cm.zero3_collectives(numel, world, hpz_partition_size=g),
        f"ZeRO-3 + qwZ + hpZ (G={g})": cm.zero3_collectives(numel, world, weight_bits=8, hpz_partition_size=g),
        f"ZeRO-3 + qwZ + qgZ (int4) + hpZ (G={g})": cm.zero3_collectives(
            numel, world, weight_bits=8, grad_bits=4, ranks_per_node=ranks_per_node, hpz_partition_size=g),
        "ZeRO-0 AdamW": cm.data_parallel_collectives(numel, world, stage=0),
        "ZeRO-0 OneBitAdam (compressed)": cm.onebit_collectives(numel, world, stage=0, **onebit),
        "ZeRO-0 OneBitLamb (compressed)": cm.onebit_collectives(numel, world, optimizer="OneBitLamb", stage=0,
                                                                **onebit),
        f"ZeRO-0 ZeroOneAdam (mean of first {horizon:,} steps)": cm.zero_one_adam_collectives(
            numel, world, steps=horizon, **onebit, **schedule),
        "ZeRO-0 ZeroOneAdam (phase 2, interval 16)": cm.zero_one_adam_collectives(
            numel, world, steps=zero_one.local_step_scaler, first_step=horizon - zero_one.local_step_scaler,
            **onebit, **schedule),
        "ZeRO-2 AdamW": cm.data_parallel_collectives(numel, world, stage=2),
        "ZeRO-2 OneBitAdam (compressed)": cm.onebit_collectives(numel, world, stage=2, **onebit),
        "ZeRO-2 OneBitLamb (compressed, weight decay)": cm.onebit_collectives(
            numel, world, optimizer="OneBitLamb", stage=2, weight_decay=True, **onebit),
    }


def table(tokens_per_rank: int, ranks_per_node: int) -> dict:
    numel, tensors = gpt_1_3b_params()
    compute = tokens_per_rank / TOKENS_PER_S
    rows = []
    for world in (8, 64):
        for name, plan in plans(numel, world, ranks_per_node, tensors).items():
            node_bytes = cm.step_inter_node_bytes(plan, world=world, ranks_per_node=ranks_per_node)
            coding = cm.coding_seconds(plan, memory_gbytes_per_s=MEMORY_GBYTES_PER_S)
            times = cm.sweep(compute, plan, world=world, ranks_per_node=ranks_per_node,
                             memory_gbytes_per_s=MEMORY_GBYTES_PER_S)
            rows.append({"world": world, "plan": name, "message_bytes": sum(c.count * c.message_bytes for c in plan),
                         "inter_node_bytes_per_node": node_bytes, "coding_s": coding,
                         "no_overlap_s": {t.gbps: t.no_overlap_s for t in times},
                         "full_overlap_s": {t.gbps: t.full_overlap_s for t in times}})
    return {"params": numel, "parameter_tensors": tensors,
            "hpz_copies_bytes_per_rank": {w: cm.hpz_memory_bytes(numel, w, ranks_per_node) for w in (8, 64)},
            "tokens_per_rank": tokens_per_rank, "ranks_per_node": ranks_per_node,
            "compute_s": compute, "tokens_per_s_measured": TOKENS_PER_S,
            "memory_gbytes_per_s": MEMORY_GBYTES_PER_S, "rows": rows}


def markdown(result: dict) -> str:
    head = " | ".join(f"{g} Gbps" for g in cm.BANDWIDTHS_GBPS)
    lines = [f"GPT-1.3B ({result['params']:,} parameters), {result['tokens_per_rank']:,} tokens per rank per step, "
             f"compute {result['compute_s'] * 1e3:.0f} ms/step, {result['ranks_per_node']} ranks per node. "
             f"Step time in ms: no overlap / full overlap.", "",
             f"| ranks | plan | message GB/rank | GB off each node | coding ms | {head} |",
             "|---|---|---|---|---|" + "---|" * len(cm.BANDWIDTHS_GBPS)]
    for r in result["rows"]:
        cells = " | ".join(f"{r['no_overlap_s'][g] * 1e3:.0f} / {r['full_overlap_s'][g] * 1e3:.0f}"
                           for g in cm.BANDWIDTHS_GBPS)
        lines.append(f"| {r['world']} | {r['plan']} | {r['message_bytes'] / 1e9:.2f} | "
                     f"{r['inter_node_bytes_per_node'] / 1e9:.2f} | {r['coding_s'] * 1e3:.1f} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-per-rank", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    results = [table(t, args.ranks_per_node) for t in args.tokens_per_rank]
    text = "\n\n".join(markdown(r) for r in results)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
