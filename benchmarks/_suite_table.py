"""Ratios and tables of the throughput suite: pure functions over the per-engine result dicts
that benchmarks/gpu_throughput.py collects (no torch, no processes), so they are tested on CPU.

A result dict has ``engine``, ``world`` and ``status`` ("ok", "oom", "failed", "skipped",
"timeout"); an "ok" one also has ``tokens_per_s_per_gpu``, ``mfu`` (None where no peak FLOP/s
applies), ``step_ms``, ``forward_ms``, ``backward_ms``, ``optimizer_ms`` and ``peak_gib``.
"""

from __future__ import annotations

from typing import Any

from _suite_engines import PEER_COLUMNS, parse_engine, peer_of

Result = dict[str, Any]

HEADERS = (
    "engine", "tokens/s/GPU", "MFU", "step ms", "fwd ms", "bwd ms", "opt ms", "peak GiB", "est. GiB",
    *(f"{kind} vs {peer}" for peer in PEER_COLUMNS for kind in ("tok/s", "mem")),
)
_STATUS_LABEL = {"oom": "OOM", "failed": "failed", "skipped": "skipped", "timeout": "timeout"}


def add_ratios(results: list[Result]) -> list[Result]:
    """Give every result of one world size a ``ratios`` dict: for each peer column, the peer's
    name and the row's tokens/s and peak memory divided by the peer's, or None when the column
    does not apply to the row or either run did not finish.

    Tokens/s ratio > 1: the row is faster. Memory ratio < 1: the row needs less memory.
    """
    worlds = {r["world"] for r in results}
    if len(worlds) > 1:
        raise ValueError(f"add_ratios compares engines of one world size; got worlds {sorted(worlds)}: "
                         "group the results by world first")
    by_name = {r["engine"]: r for r in results}
    out = []
    for result in results:
        ratios: dict[str, dict[str, Any] | None] = {}
        for column in PEER_COLUMNS:
            peer_name = peer_of(parse_engine(result["engine"]), column)
            peer = by_name.get(peer_name) if peer_name else None
            if result["status"] != "ok" or peer is None or peer["status"] != "ok":
                ratios[column] = None
                continue
            ratios[column] = {
                "peer": peer_name,
                "tokens_per_s": result["tokens_per_s_per_gpu"] / peer["tokens_per_s_per_gpu"],
                "peak_gib": result["peak_gib"] / peer["peak_gib"] if peer["peak_gib"] > 0 else None,
            }
        out.append({**result, "ratios": ratios})
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _estimate(r: Result) -> str:
    """partita's own prediction of the peak (``partita estimate``), for partita rows."""
    value = r.get("predicted_peak_gib")
    return f"{value:.2f}" if isinstance(value, (int, float)) else "—"


def table_rows(results: list[Result]) -> list[list[str]]:
    """One row of cells per result (results must carry ``ratios`` from :func:`add_ratios`)."""
    rows = []
    for r in results:
        if r["status"] != "ok":
            peak = r.get("peak_gib")
            peak_cell = f"{peak:.2f} at OOM" if r["status"] == "oom" and peak is not None else "—"
            rows.append([r["engine"], _STATUS_LABEL[r["status"]], "—", "—", "—", "—", "—", peak_cell, _estimate(r)]
                        + ["—"] * (2 * len(PEER_COLUMNS)))
            continue
        cells = [
            r["engine"], f"{r['tokens_per_s_per_gpu']:,.0f}",
            "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
            f"{r['step_ms']:.1f}", f"{r['forward_ms']:.1f}", f"{r['backward_ms']:.1f}", f"{r['optimizer_ms']:.1f}",
            f"{r['peak_gib']:.2f}", _estimate(r),
        ]
        for column in PEER_COLUMNS:
            ratio = r["ratios"][column]
            cells += ["—", "—"] if ratio is None else [_fmt(ratio["tokens_per_s"], ".2f"), _fmt(ratio["peak_gib"], ".2f")]
        rows.append(cells)
    return rows


def render_markdown(headers: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render_text(headers: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    """Fixed-width table for the terminal: first column left-aligned, numbers right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]

    def line(cells: list[str] | tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(row) for row in rows])


def failure_notes(results: list[Result]) -> list[str]:
    """One line per engine that did not finish: why, and for an OOM the memory at failure."""
    notes = []
    for r in results:
        if r["status"] == "ok":
            continue
        if r["status"] == "oom":
            where = f" during {r['phase']}" if r.get("phase") else ""
            rank = f" on rank {r['rank']}" if r.get("rank") is not None else ""
            memory = ""
            if r.get("memory_at_failure_gib") is not None:
                memory = (f" (allocated {r['memory_at_failure_gib']:.2f} GiB, peak {r['peak_gib']:.2f} GiB"
                          + (f" of {r['device_total_gib']:.1f} GiB" if r.get("device_total_gib") else "") + ")")
            detail = f" — {r['detail']}" if r.get("detail") else ""
            notes.append(f"{r['engine']}: out of memory{where}{rank}{memory}{detail}")
        else:
            reason = (r.get("error") or "").strip()
            notes.append(f"{r['engine']}: {_STATUS_LABEL[r['status']]}" + (f" — {reason}" if reason else ""))
    return notes


SCALING_HEADERS = ("engine", "tokens/s/GPU at 1", "tokens/s/GPU at N", "N", "scaling efficiency")


def scaling_rows(results: list[Result]) -> list[list[str]]:
    """Per engine measured at world 1 and at a larger world: per-GPU tokens/s at N divided by
    per-GPU tokens/s at 1 (1.0 = perfect scaling), one row per larger world."""
    single = {r["engine"]: r for r in results if r["world"] == 1 and r["status"] == "ok"}
    rows = []
    for r in results:
        base = single.get(r["engine"])
        if r["world"] == 1 or r["status"] != "ok" or base is None:
            continue
        rows.append([r["engine"], f"{base['tokens_per_s_per_gpu']:,.0f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                     str(r["world"]), f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}"])
    return rows
