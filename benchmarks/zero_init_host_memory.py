"""Host memory of a model built under ``partita.zero.Init`` on CPU ranks, against one process
holding it whole (issue 32, item 9).

    python benchmarks/zero_init_host_memory.py [--world 4] [--d-model 512] [--layers 8] [--no-trim]
        [--out r.json]

Each rank (gloo, spawned here) reads its resident set size (``VmRSS`` in /proc/self/status) at
four points: after torch.distributed is up (the baseline), after the model is built under
``zero.Init``, after ``partita.initialize`` (ZeRO-3, torch AdamW), and after two training steps.
A single process that builds the same model whole and trains it at ZeRO-0 gives the reference
at the same points. The figure per point is ``(rank RSS - its baseline) / (reference RSS - its
baseline)``: 1/world is the ideal, plus what cannot shard (buffers, the data, torch's own).
Reported with and without glibc's ``malloc_trim(0)`` just before each reading
(``--no-trim`` leaves it out), which tells memory still held by tensors from memory the C
allocator keeps cached after tensors were freed. Each reading also records where the rank's
memory is (``breakdown`` in the JSON, printed for rank 0): ``live`` (the bytes of every tensor
storage reachable from Python, zero.Init's shards included, each counted once) and
``thread_arenas`` (resident bytes of glibc's per-thread arenas: anonymous mappings starting on a
64 MiB boundary, where gloo's worker threads allocate; ``malloc_trim`` never returns their top).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from output_paths import output_file  # noqa: E402

POINTS = ("built", "initialized", "trained")


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _reading(trim: bool) -> int:
    gc.collect()
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes()


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable from Python (and zero.Init's shards), once each."""
    from partita.zero.init_context import _SHARDS

    seen, total = set(), 0
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)] + list(_SHARDS.values())
    for tensor in tensors:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def thread_arena_bytes() -> int:
    """Resident bytes of glibc's per-thread arenas (anonymous maps aligned to their 64 MiB size)."""
    total, arena = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                start = int(fields[0].split("-")[0], 16)
                arena = len(fields) == 5 and start % (64 << 20) == 0  # no path: anonymous
            elif arena and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}


def _build(cfg, world: int):
    import partita
    from partita.models.gpt import GPT

    if world == 1:
        return GPT(cfg)
    with partita.zero.Init():
        return GPT(cfg)


def _train(engine, vocab: int, seq: int, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        idx = torch.randint(0, vocab, (2, seq), generator=g)
        _, loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()


def _measure(rank: int, world: int, store_path: str, args: argparse.Namespace, queue) -> None:
    import partita
    from partita.models.gpt import GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store_path}")
    partita.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.d_model)
    # Warm-up: the same path on a tiny model first, so the modules it imports and the buffers the
    # collectives allocate once are in the baseline, not counted as the model's memory.
    tiny = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    warm = _build(tiny, world)
    warm_engine, *_ = partita.initialize(model=warm, config=_config(3 if world > 1 else 0))
    _train(warm_engine, 64, 8, rank)
    warm_engine.destroy()
    del warm, warm_engine
    readings, breakdown = {}, {}

    def read(point: str) -> None:
        readings[point] = _reading(args.trim)
        breakdown[point] = {"live": live_tensor_bytes(), "thread_arenas": thread_arena_bytes()}

    read("baseline")
    model = _build(cfg, world)
    read("built")
    engine, *_ = partita.initialize(model=model, config=_config(3 if world > 1 else 0))
    read("initialized")
    _train(engine, args.vocab, args.seq, rank)
    read("trained")
    queue.put((rank, readings, breakdown))
    engine.destroy()
    dist.destroy_process_group()


def run(world: int, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_measure, args=(r, world, os.path.join(tmp, "store"), args, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(timeout=120)
    return [(readings, breakdown) for _, readings, breakdown in sorted(results, key=lambda item: item[0])]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--no-trim", dest="trim", action="store_false")
    parser.add_argument("--out", type=output_file, default=None)
    args = parser.parse_args(argv)
    reference, reference_breakdown = run(1, args)[0]
    ranks, breakdowns = zip(*run(args.world, args))
    report = {"world": args.world, "model": {"d_model": args.d_model, "layers": args.layers, "vocab": args.vocab},
              "trim": args.trim, "torch": torch.__version__, "reference_bytes": reference, "rank_bytes": list(ranks),
              "breakdown": {"reference": reference_breakdown, "ranks": list(breakdowns)}, "ratio": {}}
    for point in POINTS:
        ref = reference[point] - reference["baseline"]
        ratios = [(r[point] - r["baseline"]) / ref for r in ranks]
        report["ratio"][point] = {"max": max(ratios), "mean": sum(ratios) / len(ratios), "reference_mib": ref / 2**20}
        mine, base = breakdowns[0][point], breakdowns[0]["baseline"]
        print(f"{point:12s} reference {ref / 2**20:8.1f} MiB   rank/reference: max {max(ratios):.3f} "
              f"mean {sum(ratios) / len(ratios):.3f} (ideal {1 / args.world:.3f})   rank 0 growth: "
              f"{(ranks[0][point] - ranks[0]['baseline']) / 2**20:.1f} MiB, live tensors "
              f"{(mine['live'] - base['live']) / 2**20:+.1f}, thread arenas "
              f"{(mine['thread_arenas'] - base['thread_arenas']) / 2**20:+.1f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
