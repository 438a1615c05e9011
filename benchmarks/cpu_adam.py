"""Host optimizer-step kernel: torch's AdamW (fused / foreach / for-loop), partita's compiled bf16-gradient step, DeepSpeed's CPU Adam.

Why: with ZeRO-Offload the optimizer step runs on the host, so its kernel decides how much of a
step the CPU adds. partita steps offloaded groups with ``torch.optim.AdamW(fused=True)``;
DeepSpeed insists on its own hand-vectorised ``DeepSpeedCPUAdam`` (AVX C++ with OpenMP, JIT-built
with ninja). Issue 5 claims the two are equally fast; this measures it.

    python benchmarks/cpu_adam.py                       # sizes 1M 16M 64M, threads 1 and 2
    python benchmarks/cpu_adam.py --nice -10 --quiet-wait 20

What is measured, per thread count (one subprocess each, ``OMP_NUM_THREADS`` = ``torch.set_num_threads``
= the count, so torch's intra-op pool and DeepSpeed's OpenMP loops get the same cores):

- one flat fp32 parameter of N elements with a fixed fp32 gradient, AdamW with the training
  hyperparameters of the step-time benchmark (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1);
- ``step()`` wall time, each step timed alone, after warm-up steps (the first creates the states);
  the figure per round is the median step, per implementation the fastest clean round; the
  implementations run back to back in a rotating order each round, and fused/DeepSpeed is the
  median of per-round ratios;
- ``offload``: today's offloaded step on a bf16 model, torch fused on the fp32 copy of the gradient
  with the unscale/clip divisor in the kernel (``grad_scale``, 1.0 here), which also writes the
  unscaled gradient back: 32 bytes per element; ``compiled_bf16``: partita's
  ``partita.optim.host_adamw_compiled.host_adamw_step`` reading the bf16 gradient with the same
  divisor (torch.compile on the CPU; its compile time is reported apart): 26 bytes per element;
- correctness: from the same start, 3 steps with 3 different gradients (bf16-representable, so
  every implementation sees the same values); every implementation's
  result against torch fused (max abs difference, elements that differ) and against a float64
  for-loop reference (max abs error), so a difference can be told apart from an error.

GB/s = 28 bytes per element per step (parameter, exp_avg, exp_avg_sq read and written, gradient
read: 7 fp32 accesses) over the step time: the kernel is memory-bound at these sizes, so this
says how close each one gets to the machine's bandwidth. The second table gives every
implementation's elements per second (the bytes differ between them).

Results: a JSON file under ``benchmarks/results/`` and a Markdown table on stdout (the figures go
into that day's report, benchmarks/results/<date>-report.md, by hand, next to the end-to-end ones).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from common import cpu_busy_seconds, git_commit, hardware_summary, versions, wait_until_quiet  # noqa: E402
from output_paths import output_dir, output_file  # noqa: E402

IMPLS = ("fused", "foreach", "forloop", "offload", "compiled_bf16", "deepspeed")
HYPER = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
BYTES_PER_ELEMENT = 28  # 7 fp32 accesses per element per step, see the module docstring
CHECK_STEPS = 3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1e6, 16e6, 64e6], help="elements of the flat tensor")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--steps", type=int, default=15, help="timed steps per round")
    p.add_argument("--min-time", type=float, default=1.0,
                   help="seconds of timed steps per round at least (small sizes run more than --steps)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per round (the first creates the states)")
    p.add_argument("--rounds", type=int, default=5, help="clean rounds wanted per size, implementations rotated")
    p.add_argument("--extra-rounds", type=int, default=5,
                   help="rounds allowed beyond --rounds to replace rounds disturbed by other jobs")
    p.add_argument("--nice", type=int, default=0, help="niceness of the measuring subprocess (negative needs root)")
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="before each round, wait up to this many seconds for other jobs to leave the CPUs (0: no wait)")
    p.add_argument("--quiet-below", type=float, default=0.15, help="busy fraction (0-1) that counts as quiet")
    p.add_argument("--max-foreign", type=float, default=0.10,
                   help="rounds during which other jobs took more than this share of the CPUs are left out of the figures")
    p.add_argument("--results-dir", type=lambda value: Path(output_dir(value)), default=HERE / "results")
    # internal: the per-thread-count measuring subprocess
    p.add_argument("--worker-threads", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=lambda value: Path(output_file(value)), default=None, help=argparse.SUPPRESS)
    return p.parse_args()


# ---------------------------------------------------------------------------- worker side


def make_optimizer(impl: str, param):
    """The optimizer under test for one parameter, all with the same hyperparameters."""
    import torch

    if impl == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam([param], adamw_mode=True, **HYPER)
    if impl == "compiled_bf16":
        return CompiledBf16Step(param)
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "forloop": dict(foreach=False, fused=False),
             "offload": dict(fused=True)}
    opt = torch.optim.AdamW([param], **HYPER, **flags[impl])
    if impl == "offload":
        opt.grad_scale = torch.tensor(1.0)  # the offloaded step's unscale + clip divisor, in the kernel
    return opt


class CompiledBf16Step:
    """partita's compiled host AdamW over one flat parameter, reading a bf16 copy of its gradient
    (made once, when the gradient is set: in training it arrives in bf16)."""

    def __init__(self, param) -> None:
        import torch

        self.param, self.steps = param, 0
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
        self._grad, self._bf16 = None, None

    def step(self) -> None:
        import torch

        from partita.optim.host_adamw_compiled import host_adamw_step

        if self._grad is not self.param.grad:
            self._grad, self._bf16 = self.param.grad, self.param.grad.to(torch.bfloat16)
        self.steps += 1
        beta1, beta2 = HYPER["betas"]
        host_adamw_step(self.param.data, self.exp_avg, self.exp_avg_sq, self._bf16, step=self.steps, lr=HYPER["lr"],
                        beta1=beta1, beta2=beta2, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                        grad_scale=torch.tensor(1.0))


def check_values(impl: str, start, grads, *, dtype=None):
    """The parameter after ``CHECK_STEPS`` steps from ``start`` with gradients ``grads``."""
    import torch

    dtype = dtype or start.dtype
    p = torch.nn.Parameter(start.to(dtype, copy=True))  # never step ``start`` itself
    opt = make_optimizer(impl, p)
    for g in grads:
        p.grad = g.to(dtype)
        opt.step()
    return p.detach()


def time_steps(impl: str, start, grad, *, steps: int, warmup: int, min_s: float) -> dict[str, Any]:
    """Median of individually timed ``step()`` calls -- ``steps`` of them, more until ``min_s``
    seconds have passed -- and the CPU share other jobs took meanwhile. The floor on time is for
    that share: /proc/stat counts in 10 ms ticks, too coarse for a few sub-millisecond steps."""
    import torch

    p = torch.nn.Parameter(start.clone())
    p.grad = grad
    opt = make_optimizer(impl, p)
    for _ in range(warmup):
        opt.step()
    ncpu = os.cpu_count() or 1
    busy0, mine0, wall0 = cpu_busy_seconds(), time.process_time(), time.perf_counter()
    times: list[float] = []
    while len(times) < steps or time.perf_counter() - wall0 < min_s:
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - wall0
    # Busy time of the whole machine minus this process's own (all its threads): other jobs.
    foreign = (cpu_busy_seconds() - busy0 - (time.process_time() - mine0)) / (wall * ncpu)
    return {"step_s": times, "median_ms": 1000 * statistics.median(times), "foreign_cpu": max(foreign, 0.0)}


def worker(args: argparse.Namespace) -> None:
    import torch

    threads = args.worker_threads
    torch.set_num_threads(threads)
    impls = list(args.impls)
    out: dict[str, Any] = {"threads": threads, "torch_threads": torch.get_num_threads(),
                           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "sizes": {}}
    if "deepspeed" in impls:
        try:
            from deepspeed.ops.op_builder import CPUAdamBuilder

            t0 = time.perf_counter()
            CPUAdamBuilder().load()  # builds on first use; not timed with the steps
            out["deepspeed_load_s"] = time.perf_counter() - t0
        except Exception as error:  # noqa: BLE001 - the reason goes into the report
            out["deepspeed_error"] = f"{type(error).__name__}: {error}"
            impls.remove("deepspeed")
    for size in args.sizes:
        n = int(size)
        gen = torch.Generator().manual_seed(n)
        start = torch.randn(n, generator=gen)
        # bf16-representable: the compiled step reads them in bf16, the others in fp32.
        grads = [(torch.randn(n, generator=gen) * 1e-2).bfloat16().float() for _ in range(CHECK_STEPS)]
        if "compiled_bf16" in impls and "compile_s" not in out:
            t0 = time.perf_counter()
            check_values("compiled_bf16", start[:4096], [g[:4096] for g in grads[:1]])
            out["compile_s"] = time.perf_counter() - t0  # once per process: sizes are symbolic
        entry: dict[str, Any] = {"rounds": {impl: [] for impl in impls}}

        # Correctness first: every implementation against fused and against float64.
        reference = check_values("forloop", start, grads, dtype=torch.float64)
        fused = check_values("fused", start, grads) if "fused" in impls else None
        check = {}
        for impl in impls:
            got = fused if impl == "fused" else check_values(impl, start, grads)
            row = {"max_abs_err_vs_fp64": (got.double() - reference).abs().max().item()}
            if fused is not None:
                diff = (got - fused).abs()
                row["max_abs_diff_vs_fused"] = diff.max().item()
                row["elements_differing_from_fused"] = int((diff > 0).sum().item())
            check[impl] = row
            del got
        entry["check"] = check
        entry["max_abs_param"] = reference.abs().max().item()
        entry["max_abs_update"] = (reference - start.double()).abs().max().item()
        del reference, fused

        # Up to --extra-rounds more rounds replace rounds that other jobs disturbed: with two
        # threads on two cores one busy core stalls every OpenMP barrier, so a shared machine
        # yields few clean rounds otherwise. Disturbed rounds stay in the JSON.
        clean, rnd = 0, 0
        while clean < args.rounds and rnd < args.rounds + args.extra_rounds:
            waited = wait_until_quiet(threshold=args.quiet_below, max_wait_s=args.quiet_wait) if args.quiet_wait > 0 else 0.0
            k = rnd % len(impls)
            worst = 0.0
            for impl in impls[k:] + impls[:k]:  # rotate who goes first each round
                r = time_steps(impl, start, grads[0], steps=args.steps, warmup=args.warmup, min_s=args.min_time)
                r.update(round=rnd, quiet_wait_s=waited)
                entry["rounds"][impl].append(r)
                worst = max(worst, r["foreign_cpu"])
                print(f"threads {threads} n {n:>9,d} round {rnd} {impl:9s} {r['median_ms']:8.2f} ms"
                      f" x{len(r['step_s'])}  (other jobs {100 * r['foreign_cpu']:.0f}%)", flush=True)
            clean += worst <= args.max_foreign
            rnd += 1
        out["sizes"][str(n)] = entry
        del start, grads
    args.out.write_text(json.dumps(out))


# ---------------------------------------------------------------------------- driver side


def summarize(entry: dict[str, Any], *, max_foreign: float) -> dict[str, Any]:
    """Per implementation the fastest clean round, and fused/DeepSpeed per round."""
    best: dict[str, float] = {}
    disturbed: set[str] = set()  # no clean round at all: the figure comes from disturbed ones
    for impl, rounds in entry["rounds"].items():
        clean = [r for r in rounds if r["foreign_cpu"] <= max_foreign]
        if not clean:
            disturbed.add(impl)
        best[impl] = min(r["median_ms"] for r in clean or rounds)
    ratios: list[float] = []
    if "fused" in entry["rounds"] and "deepspeed" in entry["rounds"]:
        pairs = list(zip(entry["rounds"]["fused"], entry["rounds"]["deepspeed"]))
        clean_pairs = [(a, b) for a, b in pairs if max(a["foreign_cpu"], b["foreign_cpu"]) <= max_foreign]
        if not clean_pairs:
            disturbed.add("ratio")
        ratios = [a["median_ms"] / b["median_ms"] for a, b in clean_pairs or pairs]
    return {"best_ms": best, "ratios": ratios, "disturbed": disturbed}


def render(results: list[dict[str, Any]], impls: list[str], *, max_foreign: float) -> str:
    names = {"fused": "torch fused", "foreach": "torch foreach", "forloop": "torch for-loop", "deepspeed": "DeepSpeedCPUAdam",
             "offload": "today's offload step", "compiled_bf16": "compiled bf16-grad"}
    head = (["threads", "elements"] + [f"{names[i]} ms" for i in impls]
            + ["fused/DS (median of rounds)", "per round", "GB/s fused / DS"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        for n, entry in res["sizes"].items():
            s = summarize(entry, max_foreign=max_foreign)
            cells = [str(res["threads"]), f"{int(n) / 1e6:g}M"]
            # "~": no round free of other jobs; the figure is from disturbed rounds.
            mark = {i: "~" if i in s["disturbed"] else "" for i in [*impls, "ratio"]}
            cells += [f"{mark[i]}{s['best_ms'][i]:.2f}" if i in s["best_ms"] else "-" for i in impls]
            cells.append(f"{mark['ratio']}**{statistics.median(s['ratios']):.3f}**" if s["ratios"] else "-")
            cells.append(", ".join(f"{x:.2f}" for x in s["ratios"]) or "-")
            gbps = [f"{BYTES_PER_ELEMENT * int(n) / (s['best_ms'][i] * 1e6):.1f}" if i in s["best_ms"] else "-"
                    for i in ("fused", "deepspeed")]
            cells.append(" / ".join(gbps))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_rates(results: list[dict[str, Any]], impls: list[str], *, max_foreign: float) -> str:
    """Elements stepped per second (G/s), every implementation, and compiled bf16 / today's offload."""
    head = ["threads", "elements"] + [f"{i} Gelem/s" for i in impls]
    both = "compiled_bf16" in impls and "offload" in impls
    head += ["compiled_bf16 / offload speed"] if both else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        for n, entry in res["sizes"].items():
            s = summarize(entry, max_foreign=max_foreign)
            cells = [str(res["threads"]), f"{int(n) / 2**20:g}Mi"]
            cells += [f"{'~' if i in s['disturbed'] else ''}{int(n) / (s['best_ms'][i] * 1e6):.3f}" for i in impls]
            if both:
                cells.append(f"**{s['best_ms']['offload'] / s['best_ms']['compiled_bf16']:.2f}x**")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_check(results: list[dict[str, Any]], impls: list[str]) -> str:
    """Values after 3 steps, per thread count unless every thread count gave the same ones."""
    same = all(r["sizes"][n]["check"] == results[0]["sizes"][n]["check"] for r in results for n in r["sizes"])
    shown = results[:1] if same else results
    lines = ["| threads | elements | implementation | max abs diff vs torch fused | elements differing "
             "| max abs error vs float64 | max abs param / largest 3-step update |", "|---|---|---|---|---|---|---|"]
    for res, n in [(res, n) for res in shown for n in res["sizes"]]:
        entry = res["sizes"][n]
        threads = "all" if same else str(res["threads"])
        for i in impls:
            c = entry["check"][i]
            lines.append(f"| {threads} | {int(n) / 1e6:g}M | {i} | {c.get('max_abs_diff_vs_fused', float('nan')):.1e} "
                         f"| {c.get('elements_differing_from_fused', 0):,d} | {c['max_abs_err_vs_fp64']:.1e} "
                         f"| {entry['max_abs_param']:.2f} / {entry['max_abs_update']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.worker_threads is not None:
        worker(args)
        return
    started = dt.datetime.now(dt.timezone.utc)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for threads in args.threads:
        env = dict(os.environ)
        # DeepSpeed's kernel parallelises with OpenMP pragmas: the thread count must be in the
        # environment before the runtime starts, hence one subprocess per setting.
        env["OMP_NUM_THREADS"] = str(threads)
        env["DS_ACCELERATOR"] = "cpu"
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out = Path(tmp.name)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker-threads", str(threads), "--out", str(out),
               "--sizes", *map(str, args.sizes), "--impls", *args.impls, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--min-time", str(args.min_time), "--rounds", str(args.rounds),
               "--quiet-wait", str(args.quiet_wait),
               "--quiet-below", str(args.quiet_below), "--max-foreign", str(args.max_foreign),
               "--extra-rounds", str(args.extra_rounds)]
        nice: Callable[[], None] | None = (lambda: os.nice(args.nice)) if args.nice else None
        proc = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), preexec_fn=nice)
        if proc.returncode != 0 or out.stat().st_size == 0:
            raise SystemExit(f"measurement with {threads} thread(s) failed (exit {proc.returncode})")
        results.append(json.loads(out.read_text()))
        out.unlink()
    impls = [i for i in args.impls if all(i in next(iter(r["sizes"].values()))["rounds"] for r in results)]
    table, check = render(results, impls, max_foreign=args.max_foreign), render_check(results, impls)
    rates = render_rates(results, impls, max_foreign=args.max_foreign)
    results_file = args.results_dir / f"cpu_adam-{started:%Y%m%dT%H%M%SZ}.json"
    meta = {
        "date": f"{started:%Y-%m-%d %H:%M} UTC",
        "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO)] + sys.argv[1:]),
        "partita_commit": git_commit(str(REPO)), "versions": versions(), "hardware": hardware_summary(),
        "hyperparameters": HYPER, "steps": args.steps, "min_time_s": args.min_time, "warmup": args.warmup,
        "rounds": args.rounds, "extra_rounds": args.extra_rounds, "nice": args.nice, "max_foreign": args.max_foreign,
    }
    results_file.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print()
    print(table)
    print()
    print(rates)
    print()
    print(check)
    for r in results:
        if "compile_s" in r:
            print(f"\ncompiled_bf16: first call (compile) {r['compile_s']:.1f} s with {r['threads']} thread(s)")
    for r in results:
        if "deepspeed_error" in r:
            print(f"\nDeepSpeedCPUAdam not measured ({r['threads']} threads): {r['deepspeed_error']}")
    print(f"\nresults: {os.path.relpath(results_file, REPO)}")


if __name__ == "__main__":
    main()
