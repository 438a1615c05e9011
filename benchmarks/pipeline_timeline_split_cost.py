"""What zero bubble's backward split costs against one full backward, in one process.

    python benchmarks/pipeline_timeline_split_cost.py [--blocks 4] [--repeats 60] [--rounds 3]

On ``pipeline_cpu_worker``'s blocks (64 rows, d 256, hidden 1024, one torch thread), per backward
of one chunk, main-thread CPU ms, median over ``--repeats`` samples per round (the three kinds
taking turns sample by sample), for ``--rounds`` rounds:

- ``full``: torch's ``stage_backward`` (what 1F1B and interleaved run as B);
- ``autograd``: torch's split, ``stage_backward_input`` then ``stage_backward_weight``
  (``pipeline.zero_bubble_weight_split "autograd"``);
- ``linear``: partita's, a full backward with the ``nn.Linear`` weight GEMMs deferred, then those
  GEMMs (``"linear"``, :mod:`partita.pipe.weight_grads`).

Between I and W two unrelated forwards run (untimed), as other actions do in a schedule, so W
meets a cache that has moved on. Also checks that ``linear`` gives the full backward's gradients.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
from torch.distributed.pipelining import _backward as pipeline_backward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_cpu_worker import DIM, HIDDEN, ROWS, Block  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4, help="blocks per chunk (4: 2 stages x 2 chunks of the benchmark)")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from partita.pipe.weight_grads import DeferredLinearGrads

    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*[Block(DIM, HIDDEN) for _ in range(args.blocks)])
    deferred = copy.deepcopy(plain)
    store = DeferredLinearGrads()
    store.patch(deferred)
    x0, g = torch.randn(ROWS, DIM), torch.randn(ROWS, DIM)

    def other_work() -> None:
        with torch.no_grad():
            plain(torch.randn(ROWS, DIM))
            plain(torch.randn(ROWS, DIM))

    def once(kind: str) -> tuple[float, float]:
        model = deferred if kind == "linear" else plain
        for p in model.parameters():
            p.grad = None
        x = x0.clone().requires_grad_(True)
        out = model(x)
        t0 = time.thread_time()
        if kind == "autograd":
            _, groups = pipeline_backward.stage_backward_input((out,), (g,), (x,), model.parameters())
        else:
            pipeline_backward.stage_backward((out,), (g,), (x,))
        i_s = time.thread_time() - t0
        weights = store.builder() if kind == "linear" else None
        other_work()
        t1 = time.thread_time()
        if kind == "autograd":
            pipeline_backward.stage_backward_weight(model.parameters(), groups)
        elif weights is not None:
            weights()
        return i_s, time.thread_time() - t1

    results: dict[str, list[list[float]]] = {"full": [], "autograd": [], "linear": []}
    for _ in range(args.rounds):
        samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in results}
        for _ in range(args.repeats):  # the kinds take turns sample by sample: a shared machine's drift hits all
            for kind in results:
                samples[kind].append(once(kind))
        for kind, rows in samples.items():
            rows.sort(key=sum)
            results[kind].append(list(rows[len(rows) // 2]))
    grads = {}
    for kind, model in (("full", plain), ("linear", deferred)):
        once(kind)
        grads[kind] = [p.grad.clone() for p in model.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(grads["full"], grads["linear"]))
    out = {kind: {"I_ms": 1e3 * statistics.median(r[0] for r in rows), "W_ms": 1e3 * statistics.median(r[1] for r in rows),
                  "total_ms_per_round": [round(1e3 * sum(r), 3) for r in rows]} for kind, rows in results.items()}
    full = statistics.median(sum(r) for r in results["full"])
    for kind, row in out.items():
        row["vs_full"] = statistics.median(sum(r) for r in results[kind]) / full
        print(f"{kind:9s} I {row['I_ms']:.2f} ms  W {row['W_ms']:.2f} ms  total / full {row['vs_full']:.3f}")
    print(f"linear gradients equal to the full backward's: {same}")
    print(json.dumps({"blocks": args.blocks, "results": out, "linear_equals_full": same}))


if __name__ == "__main__":
    main()
