"""Plain-text tables for :class:`~partita.estimate.result.MemoryEstimate`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from partita.estimate.phases import CATEGORIES, DEVICES, PHASES

if TYPE_CHECKING:
    from partita.estimate.result import MemoryEstimate

__all__ = ["format_bytes", "format_estimate"]

_HEADERS = {"accelerator": "accelerator", "cpu": "CPU", "nvme": "NVMe"}


def format_bytes(nbytes: int) -> str:
    """Binary units (GiB = 2**30 bytes), as torch.cuda.memory_allocated is usually read."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_estimate(estimate: MemoryEstimate) -> str:
    """The estimate as a table: one row per line, a column per device in use, then the peaks."""
    devices = [d for d in DEVICES if d == "accelerator" or estimate.total(d)]
    rows: list[tuple[str, str, list[str]]] = []
    for category in CATEGORIES:
        first = True
        for line in (x for x in estimate.lines if x.category == category):
            cells = ["-"] * len(devices)
            mark = "" if line.exact else "~"
            cells[devices.index(line.device)] = mark + format_bytes(line.nbytes)
            item = line.item + (f" [{line.note}]" if line.note else "")
            rows.append((category if first else "", item, cells))
            first = False
        if first and category == "activations" and not estimate.activations_known:
            rows.append((category, "unknown (pass --activation-bytes / activation_bytes)", ["?"] + ["-"] * (len(devices) - 1)))
    rows.append(("", "", [""] * len(devices)))
    rows.append(("model states", "parameters + gradients + optimizer states (exact)",
                 [format_bytes(estimate.model_states(d)) for d in devices]))
    _, phase = estimate.peak("accelerator")
    rows.append(("peak", f"per rank (accelerator: {phase})", [format_bytes(estimate.peak(d)[0]) for d in devices]))
    if estimate.reserved is not None and estimate.reserved.model.kind != "none":
        r = estimate.reserved
        held = f", +{format_bytes(r.held_logits)} held logits' hole" if r.held_logits else ""
        rows.append(("reserved", f"~ with the caching allocator ({r.model.describe()}: +{format_bytes(r.rounding + r.pages)} "
                     f"rounding and segment ends, +{format_bytes(r.fragmentation)} fragmentation{held})",
                     [format_bytes(estimate.reserved_accelerator)] + [""] * (len(devices) - 1)))

    widths = [max(len(r[0]) for r in rows + [("category", "", [])]), max(len(r[1]) for r in rows + [("", "item", [])])]
    cell_widths = [max([len(_HEADERS[d])] + [len(r[2][i]) for r in rows]) for i, d in enumerate(devices)]
    out = [f"partita estimate: {estimate.model}", estimate.setup.describe(), ""]
    header = f"{'category':<{widths[0]}}  {'item':<{widths[1]}}" + "".join(
        f"  {_HEADERS[d]:>{w}}" for d, w in zip(devices, cell_widths)
    )
    out += [header, "-" * len(header)]
    for category, item, cells in rows:
        out.append(
            (f"{category:<{widths[0]}}  {item:<{widths[1]}}" + "".join(f"  {c:>{w}}" for c, w in zip(cells, cell_widths))).rstrip()
        )
    out.append("")
    out.append("~ estimate (activations, transient buffers); the other lines are exact per partita's allocation.")
    out.append("peak = the largest total over a step's phases: " + ", ".join(
        f"{p} {format_bytes(estimate.total('accelerator', phase=p))}" for p in PHASES) + " (accelerator)")
    out += [f"note: {n}" for n in estimate.notes]
    return "\n".join(out)
