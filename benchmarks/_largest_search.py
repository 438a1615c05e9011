"""The settings, the size ladder and the rung-by-rung search of benchmarks/largest_per_setting.py.

Pure logic, no torch and no processes: the driver hands :func:`search_setting` a function that
runs (or declines to run) one trial, so the stepping rules and the JSON shape are tested with a
fake trial function (tests/test_largest_per_setting.py).

The search per setting: start at the rung the estimator predicts to be the largest that fits,
run it; after a pass go one rung up until a trial fails, after a failure go one rung down until
one passes. The measured result is the largest passing rung and the first failing rung above it,
with its cause. A trial the driver declines (predicted too slow for the per-trial timeout, or
not enough of the overall budget left) ends the setting's search: a smaller or larger rung says
nothing more about the edge than the rungs already run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

VOCAB = 50304
SEQ_LEN = 2048
HEAD_DIM = 128


@dataclass(frozen=True)
class Setting:
    """One way to train: the engine family, its memory options and what it is compared with.

    ``options`` are :class:`partita.estimate.Setup` fields; for partita they are also the run's
    config. FSDP2 and DeepSpeed have no estimator of their own: their starting rung comes from
    partita's estimate of the partita setting that keeps the same bytes in the same places
    (``options`` then describes that analogue, and the table marks the prediction as one).
    """

    name: str
    family: str  # "partita", "fsdp2" or "deepspeed"
    label: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def eight_bit(self) -> bool:
        return "8bit" in self.options.get("optimizer", "AdamW")

    @property
    def host_step(self) -> bool:
        """Whether the optimizer steps on the host (its speed then sets the step time)."""
        return self.options.get("offload_optimizer", "none") != "none"


def _p(name: str, label: str, **options: Any) -> Setting:
    return Setting(name, "partita", label, {"stage": 3, **options})


_8 = {"optimizer": "AdamW8bit"}
# One process, nothing offloaded, fused AdamW or AdamW8bit: "auto" takes one_rank_gradient_fold "stream" (no fp32
# gradient partition, partita/zero/streamed_step.py); the worker sets it explicitly, the estimate models it.
_STREAM = {"fold_gradients_at_end": True, "streamed_step": True}
SETTINGS: tuple[Setting, ...] = (
    _p("p-none", "partita ZeRO-3, AdamW, nothing offloaded", **_STREAM),
    _p("p-none-8b", "partita ZeRO-3, AdamW8bit, nothing offloaded", **_8, **_STREAM),
    _p("p-opt", "partita ZeRO-3, AdamW, optimizer in CPU memory", offload_optimizer="cpu"),
    _p("p-opt-8b", "partita ZeRO-3, AdamW8bit, optimizer in CPU memory", offload_optimizer="cpu", **_8),
    _p("p-optp", "partita ZeRO-3, AdamW, optimizer + parameters in CPU memory", offload_optimizer="cpu",
       offload_param="cpu"),
    _p("p-optp-gm", "partita ZeRO-3, AdamW, optimizer + parameters in CPU memory, gathered from the fp32 master",
       offload_optimizer="cpu", offload_param="cpu", param_gather_from_master=True),
    _p("p-optp-8b", "partita ZeRO-3, AdamW8bit, optimizer + parameters in CPU memory", offload_optimizer="cpu",
       offload_param="cpu", **_8),
    # Optimizer states on NVMe with the parameters in CPU memory: the estimator gives this a larger
    # edge than parameters on NVMe too (the disk, 64 GiB, fills first; parameters there add 2 B each).
    _p("p-nvme", "partita ZeRO-3, AdamW, optimizer states on NVMe, parameters in CPU memory",
       offload_optimizer="nvme", offload_param="cpu"),
    # 8-bit states cannot be swapped to NVMe (partita refuses block-quantised states there), so
    # NVMe holds the parameters and the 8-bit optimizer lives in CPU memory.
    _p("p-nvme-8b", "partita ZeRO-3, AdamW8bit, optimizer in CPU memory, parameters on NVMe",
       offload_optimizer="cpu", offload_param="nvme", **_8),
    Setting("fsdp2", "fsdp2", "FSDP2 fully_shard per block + root, fp32 master, bf16 compute, fused AdamW",
            {"stage": 3}),
    # Analogue: partita's optimizer offload, 16 B/param on the host (fp32 master, gradient, moments) as
    # CPUOffloadPolicy keeps there (fp32 parameters, gradients, moments); parameter offload would add 2 B.
    Setting("fsdp2-off", "fsdp2", "FSDP2 as above with CPUOffloadPolicy (parameters, gradients, AdamW on the host)",
            {"stage": 3, "offload_optimizer": "cpu"}),
    Setting("ds-off", "deepspeed", "DeepSpeed ZeRO-3, offload_optimizer + offload_param cpu, pin_memory",
            {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}),
)
BY_NAME = {s.name: s for s in SETTINGS}


def parse_settings(text: str | None) -> list[Setting]:
    """``--settings a,b``: the settings named (all when None or "all"), unknown names refused."""
    if text in (None, "", "all"):
        return list(SETTINGS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; the settings are {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in dict.fromkeys(names)]


def gpt_params(d_model: int, n_layers: int, vocab: int = VOCAB, seq_len: int = SEQ_LEN) -> int:
    """Parameters of partita's reference GPT (tied embedding/head, learned positions, biases)."""
    return vocab * d_model + seq_len * d_model + n_layers * (12 * d_model * d_model + 13 * d_model) + 2 * d_model


def ladder(tiny: bool = False) -> list[tuple[int, int]]:
    """(d_model, n_layers) rungs, smallest first.

    d 4096 (32 heads) from 16 to 56 layers (3.4-11.5 B), then d 5120 (40 heads) from 38 to 64
    layers (12.2-20.4 B): two layers a rung, 5-8% more parameters a rung between 6 and 20 B.
    """
    if tiny:
        return [(64, n) for n in range(2, 10)]  # two blocks at least: checkpointing wants a repeated block
    return [(4096, n) for n in range(16, 57, 2)] + [(5120, n) for n in range(38, 65, 2)]


def rung_dict(rungs: list[tuple[int, int]], index: int, *, vocab: int = VOCAB, seq_len: int = SEQ_LEN) -> dict:
    d, n = rungs[index]
    return {"rung": index, "d_model": d, "n_layers": n, "params": gpt_params(d, n, vocab, seq_len)}


# A trial function gets a rung index and returns at least {"status": "pass" | "fail" | "skipped"},
# with "cause" for a failure and "reason" for a skip; the rest (peaks, losses) is recorded as is.
TrialFn = Callable[[int], dict[str, Any]]


def search_setting(start: int, n_rungs: int, run_trial: TrialFn, *, max_trials: int = 4) -> dict[str, Any]:
    """Step from ``start`` one rung at a time to the edge between passing and failing.

    Returns ``{"start_rung", "trials": [...], "largest": index | None, "first_fail": index | None,
    "outcome": text}``; every trial dict gets its ``rung``.
    """
    if not 0 <= start < n_rungs:
        raise ValueError(f"start rung {start} is outside the ladder of {n_rungs} rungs")
    trials: list[dict[str, Any]] = []
    largest = first_fail = None

    def run(index: int) -> dict[str, Any]:
        result = {"rung": index, **run_trial(index)}
        if result.get("status") not in ("pass", "fail", "skipped"):
            raise ValueError(f"trial at rung {index} returned status {result.get('status')!r}; "
                             "expected pass, fail or skipped")
        trials.append(result)
        return result

    def done(outcome: str) -> dict[str, Any]:
        return {"start_rung": start, "trials": trials, "largest": largest, "first_fail": first_fail,
                "outcome": outcome}

    first = run(start)
    if first["status"] == "skipped":
        return done(f"not run: {first.get('reason', 'skipped')}")
    step = 1 if first["status"] == "pass" else -1
    if step == 1:
        largest = start
    else:
        first_fail = start
    index = start
    while True:
        index += step
        if not 0 <= index < n_rungs:
            return done("every rung up to the top of the ladder passed" if step == 1
                        else "no rung passed, down to the bottom of the ladder")
        if len(trials) >= max_trials:
            return done(f"edge not reached within {max_trials} trials")
        result = run(index)
        if result["status"] == "skipped":
            return done(f"edge not reached: rung {index} not run ({result.get('reason', 'skipped')})")
        if step == 1 and result["status"] == "pass":
            largest = index
        elif step == -1 and result["status"] == "fail":
            first_fail = index
        else:  # the status changed: the edge lies between this rung and the previous one
            if step == 1:
                first_fail = index
            else:
                largest = index
            return done("edge found")


def _gib(value: Any) -> str:
    return "—" if value is None else f"{value:.1f}"


def format_params(params: int) -> str:
    return f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.3f} M"


def _size(r: dict) -> str:
    return f"{format_params(r['params'])} ({r['d_model']}×{r['n_layers']})"


def markdown_table(report: dict[str, Any]) -> str:
    """The results of a run (its JSON) as a markdown table, one row per setting."""
    head = ("setting", "largest that trains", "peak GPU alloc / reserved GiB", "peak host RSS GiB", "disk GiB",
            "s/step", "tokens/s", "first failing size: cause", "estimator's largest")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in report["settings"]:
        by_rung = {t["rung"]: t for t in s.get("trials", [])}
        best = by_rung.get(s.get("largest"))
        fail = by_rung.get(s.get("first_fail"))
        pred = s.get("predicted") or {}
        predicted = "—" if pred.get("rung") is None else _size(pred) + (" (partita analogue)" if pred.get("proxy") else "")
        if best is None:
            cells = [s.get("outcome", "not run"), "—", "—", "—", "—", "—"]
        else:
            cells = [_size(best), f"{_gib(best.get('peak_gpu_allocated_gib'))} / {_gib(best.get('peak_gpu_reserved_gib'))}",
                     _gib(best.get("peak_host_rss_gib")), _gib(best.get("peak_disk_gib")),
                     "—" if best.get("step_s") is None else f"{best['step_s']:.2f}",
                     "—" if best.get("tokens_per_s") is None else f"{best['tokens_per_s']:,.0f}"]
        if fail is not None:
            beyond = f"{_size(fail)}: {fail.get('cause', 'failed')}"
        else:
            beyond = s.get("outcome", "—") if best is not None else "—"
        lines.append("| " + " | ".join([s["setting"], *cells, beyond, predicted]) + " |")
    return "\n".join(lines)


def classify_trial(raw: dict[str, Any]) -> dict[str, Any]:
    """A worker's outcome (its result line, exit status, what the driver's watch saw) as one
    trial row: ``status`` pass or fail, ``cause`` / ``cause_kind`` for a failure, the figures."""
    result = raw.get("result") or {}
    row: dict[str, Any] = {k: raw[k] for k in ("peak_host_rss_gib", "start_available_gib", "min_available_gib",
                                                 "peak_disk_gib", "wall_s", "returncode") if k in raw}
    # None (e.g. params of a worker that failed while building) never hides the rung's own figure.
    row.update({k: v for k, v in result.items()
                if k not in ("setting", "d_model", "n_layers", "status") and v is not None})

    def fail(kind: str, cause: str) -> dict[str, Any]:
        row.update(status="fail", cause_kind=kind, cause=cause)
        if kind == "error":
            row["stderr_tail"] = raw.get("stderr_tail", "")
        return row

    stopped = raw.get("stopped")
    if stopped == "timeout":
        return fail("timeout", f"timeout: no result within {raw.get('timeout_s', '?')} s")
    if stopped == "host-floor":
        return fail("host-oom", f"host OOM: MemAvailable fell below {raw.get('min_available_gib', 0):.1f} GiB "
                                "(stopped by the driver before the kernel's OOM killer)")
    if stopped == "host-limit":
        return fail("host-oom", f"host OOM: process-tree RSS {raw.get('peak_host_rss_gib', 0):.2f} GiB over "
                                "--host-limit-gib (stopped by the driver)")
    status = result.get("status")
    if status is None:
        code = raw.get("returncode")
        if code in (-9, 137):
            return fail("host-oom", f"host OOM: killed by SIGKILL (exit status {code}) without a result line, "
                                    "the kernel's OOM killer")
        tail = [ln for ln in raw.get("stderr_tail", "").splitlines() if ln.strip()]
        return fail("error", f"error: exit status {code}: {tail[-1][:200] if tail else 'no output'}")
    where = f" in {result.get('phase')}" if result.get("phase") else ""
    if status == "oom":
        reserved, total = result.get("peak_gpu_reserved_gib"), result.get("gpu_total_gib")
        held = f"; peak reserved {reserved:.1f} of {total:.1f} GiB" if reserved is not None and total else ""
        return fail("gpu-oom", f"GPU OOM{where} ({result.get('detail', '')}{held})")
    if status == "host-oom":
        return fail("host-oom", f"host OOM{where} ({result.get('detail', '')})")
    if status == "disk-full":
        return fail("disk-full", f"disk full{where} ({result.get('detail', '')})")
    if status != "ok":
        return fail("error", f"error{where}: {result.get('detail', status)}")
    losses = result.get("losses") or []
    if len(losses) < 2 or not losses[-1] < losses[0]:
        return fail("loss", f"loss did not fall: {losses[0] if losses else '?'} -> {losses[-1] if losses else '?'}")
    row["status"] = "pass"
    return row
