"""CPU benchmark: greedy generation from a ZeRO-3 engine on 2 gloo processes, partita against the
unsharded model and DeepSpeed ZeRO-3, in the same processes, interleaved (issue 28 item 2).

    .bench-venv/bin/python benchmarks/zero3_generate.py [--rounds 3] [--new-tokens 48] [--json out.json]

One ``torchrun --nproc-per-node 2`` job of this file's worker (``--worker``, one thread per
process) builds one Llama-shaped Hugging Face model from a config (random weights, fp32, ~34 M
parameters: 8 layers, hidden 512, 8 heads / 4 KV heads, MLP 1536, vocabulary 8192) and, from the
same weights:

- ``unsharded``: the plain model's ``generate`` on every rank (no communication);
- ``partita_gather_once``: ``partita.initialize`` at ZeRO-3, ``engine.module.generate`` (the
  generation session gathers every unit once per call and holds it, partita/zero/generation.py);
- ``partita_stream``: the same with ``stage3_generation "stream"`` (units gathered per forward, the
  next ones prefetched, ``synced_gpus`` passed automatically);
- ``partita_gathered``: TRL's ``with zero.GatheredParameters(model.parameters()): model.generate()``;
- ``deepspeed_zero3``: ``deepspeed.initialize`` at ZeRO-3, ``engine.module.generate(synced_gpus=True)``
  (what DeepSpeed users run: its hooks fetch and release every module for every token);
- ``deepspeed_gathered``: DeepSpeed's ``GatheredParameters`` around the same call.

Both engines: stage 3 with DeepSpeed's defaults (persistence threshold 1e5, prefetch 5e7), torch
AdamW. Every case generates ``--new-tokens`` tokens greedily (``min_new_tokens`` equal, so every
rank runs the same number of forwards) from a 32-token prompt per rank (different on each rank),
round-robin ``--rounds`` times after one warm-up call each; a case's time is the slowest rank's
(after a barrier), the figure the median over rounds. Every case's tokens are checked against the
unsharded model's. The DeepSpeed rows need ``deepspeed`` importable (the benchmark venv
``.bench-venv``, DS_ACCELERATOR=cpu); without it they record why and the partita rows still run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # benchmarks/ is not a package
from output_paths import output_file  # noqa: E402

SIZE = dict(layers=8, hidden=512, heads=8, kv_heads=4, mlp=1536, vocab=8192, prompt=32)
CASES = ["unsharded", "partita_gather_once", "partita_stream", "partita_gathered", "deepspeed_zero3",
         "deepspeed_gathered"]


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=SIZE["layers"], hidden_size=SIZE["hidden"], num_attention_heads=SIZE["heads"],
        num_key_value_heads=SIZE["kv_heads"], intermediate_size=SIZE["mlp"], vocab_size=SIZE["vocab"],
        max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()


def _config(generation: str | None = None) -> dict:
    zero = {"stage": 3}
    if generation is not None:
        zero["stage3_generation"] = generation
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1_000_000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "zero_optimization": zero}


def worker(rounds: int, new_tokens: int, out: str) -> None:
    import contextlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    prompt = torch.randint(1, SIZE["vocab"], (1, SIZE["prompt"]), generator=torch.Generator().manual_seed(rank))
    generate_kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False)
    import partita
    import partita.zero

    calls, errors = {}, {}
    plain = _model()
    calls["unsharded"] = lambda: plain.generate(prompt, **generate_kwargs)
    gathered, _, _, _ = partita.initialize(model=_model(), config=_config())
    gathered.eval()
    calls["partita_gather_once"] = lambda: gathered.module.generate(prompt, **generate_kwargs)
    streamed, _, _, _ = partita.initialize(model=_model(), config=_config("stream"))
    streamed.eval()
    calls["partita_stream"] = lambda: streamed.module.generate(prompt, **generate_kwargs)

    def partita_gathered():
        with partita.zero.GatheredParameters(gathered.module.parameters()):
            return gathered.module.generate(prompt, **generate_kwargs)

    calls["partita_gathered"] = partita_gathered
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the existing group
        ds, _, _, _ = deepspeed.initialize(model=_model(), model_parameters=None, config=_config())
        ds.eval()
        calls["deepspeed_zero3"] = lambda: ds.module.generate(prompt, synced_gpus=True, **generate_kwargs)

        def deepspeed_gathered():
            with deepspeed.zero.GatheredParameters(list(ds.module.parameters())):
                return ds.module.generate(prompt, synced_gpus=True, **generate_kwargs)

        calls["deepspeed_gathered"] = deepspeed_gathered
    except Exception as error:  # noqa: BLE001 - recorded in the results, the partita rows still run
        for case in ("deepspeed_zero3", "deepspeed_gathered"):
            errors[case] = f"{type(error).__name__}: {error}"[:400]
    times: dict[str, list[float]] = {case: [] for case in calls}
    tokens: dict[str, list[int]] = {}
    for case, call in calls.items():  # warm-up: first-call costs, the stream case's recorded unit order
        tokens[case] = call()[0, SIZE["prompt"]:].tolist()
    for _ in range(rounds):
        for case, call in calls.items():
            dist.barrier()
            began = time.perf_counter()
            with contextlib.nullcontext():
                call()
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[case].append(float(elapsed))
    equal = {case: tokens[case] == tokens["unsharded"] for case in tokens}
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, {"equal": equal, "modes": [gathered.generation_mode, streamed.generation_mode]})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times_s": times, "errors": errors, "tokens_rank0": tokens, "ranks": every_rank,
                       "params": sum(p.numel() for p in plain.parameters())}, f)
    dist.barrier()


def summarize(raw: dict, new_tokens: int) -> list[dict]:
    rows = []
    base = statistics.median(raw["times_s"]["unsharded"])
    for case in CASES:
        if case in raw["errors"]:
            rows.append({"case": case, "error": raw["errors"][case]})
            continue
        times = raw["times_s"][case]
        median = statistics.median(times)
        rows.append({"case": case, "seconds": median, "rounds_s": times, "ms_per_token": 1000 * median / new_tokens,
                     "vs_unsharded": median / base,
                     "tokens_equal_unsharded": all(r["equal"][case] for r in raw["ranks"])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--out", type=output_file, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=output_file, default=None, help="write the raw and summarized results here")
    parser.add_argument("--port", type=int, default=29653)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.new_tokens, args.out)
        return
    from common import git_commit, hardware_summary, versions

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "raw.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(args.port),
               __file__, "--worker", "--rounds", str(args.rounds), "--new-tokens", str(args.new_tokens), "--out", out]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        began = time.time()
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"worker job failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        raw = json.load(open(out))
    rows = summarize(raw, args.new_tokens)
    print(f"greedy generate, {args.new_tokens} new tokens, 2 CPU processes (1 thread each), Llama-shaped "
          f"{raw['params'] / 1e6:.1f} M params fp32 {SIZE}; modes {raw['ranks'][0]['modes']}")
    print(f"{'case':<22}{'seconds':>9}{'ms/token':>10}{'vs unsharded':>14}  {'tokens ok':<10}{'rounds'}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<22}  {r['error']}")
            continue
        rounds = "/".join(f"{v:.2f}" for v in r["rounds_s"])
        print(f"{r['case']:<22}{r['seconds']:>9.2f}{r['ms_per_token']:>10.1f}{r['vs_unsharded']:>13.2f}x  "
              f"{str(r['tokens_equal_unsharded']):<10}{rounds}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(began)), "size": SIZE,
                       "new_tokens": args.new_tokens, "rounds": args.rounds,
                       "command": " ".join([".bench-venv/bin/python", "benchmarks/zero3_generate.py", *sys.argv[1:]]),
                       "commit": git_commit(REPO), "hardware": hardware_summary(), "versions": versions(),
                       "rows": rows, "raw": raw}, f, indent=2)


if __name__ == "__main__":
    main()
