"""The bubble a pipeline schedule should have, two ways, for the pipeline benchmark.

- ``formula_bubble``: the closed forms of the literature (idle fraction of a stage's wall time,
  F = forward, B = 2F the full backward): 1F1B / GPipe (p-1)/(m+p-1) (Narayanan et al. 2021,
  DeepSpeed's 2(m+p-1) steps); interleaved with v chunks per rank (p-1)/(v*m+p-1); zero bubble
  (Qi et al. 2024, ZB1P: bubble (p-1)(F+B-2W) instead of (p-1)(F+B), with I = W = F) divided by
  v for v chunks: (p-1)/(3*v*m+p-1).
- ``simulated_bubble``: the idle fraction per rank of torch's own action list for the schedule
  (the schedule class's ``pipeline_order``, built over stand-in stages: the order the runtime
  executes), replayed with zero-cost communication and unit costs F = I = W = 1, B = 2 per chunk
  (divided by v). It is what *this implementation* of a schedule can reach, where the formula is
  what the paper's schedule reaches; the two differ where torch's order is not the optimal one.

Kept apart from the driver so that the arithmetic is testable without processes.
"""

from __future__ import annotations

# partita schedule name (config pipeline.schedule) -> torch's get_schedule_class name.
TORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
               "zero_bubble": "InterleavedZeroBubble"}
COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def formula_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of each stage's time in the pipelined region, from the closed forms
    (partita.pipe.bubble's, which ``engine.last_bubble`` reports; DeepSpeed's 1F1B is 1F1B's)."""
    from partita.pipe.bubble import theory_idle_fraction

    return theory_idle_fraction(p, m, "1f1b" if schedule == "deepspeed_1f1b" else schedule, v)


def replay(ops: list[list[tuple[int, str, int]]], num_stages: int, v: int,
           costs: dict[tuple[int, str, int], float] | None = None) -> list[float]:
    """Idle fraction of each rank when every rank runs its ``(stage, kind, micro_batch)`` list in
    order, each op starting once its rank is free and its inputs exist (zero-cost sends):
    F(s, k) after F(s-1, k); B or I (s, k) after F(s, k) and B/I(s+1, k); W(s, k) after I(s, k).
    ``costs``: each op's own duration (e.g. measured, ``pipeline_timeline``); default the unit
    costs ``COST`` divided by ``v``."""
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(ops)
    busy = [0.0] * len(ops)
    nxt = [0] * len(ops)
    total = sum(len(r) for r in ops)
    while len(done) < total:
        progressed = False
        for rank, actions in enumerate(ops):
            while nxt[rank] < len(actions):
                stage, kind, mb = actions[nxt[rank]]
                deps = []
                if kind == "F" and stage > 0:
                    deps.append((stage - 1, "F", mb))
                if kind in ("B", "I"):
                    deps.append((stage, "F", mb))
                    if stage < num_stages - 1:
                        up = (stage + 1, "B", mb) if (stage + 1, "B", mb) in done else (stage + 1, "I", mb)
                        deps.append(up)
                if kind == "W":
                    deps.append((stage, "I", mb))
                if any(d not in done for d in deps):
                    break
                start = max([free[rank]] + [done[d] for d in deps])
                cost = costs[(stage, kind, mb)] if costs is not None else COST[kind] / v
                done[(stage, kind, mb)] = free[rank] = start + cost
                busy[rank] += cost
                nxt[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the action lists deadlock at positions {nxt}")
    makespan = max(free)
    return [1.0 - b / makespan for b in busy]


def single_stage_ops(schedule: str, p: int, m: int) -> list[list[tuple[int, str, int]]]:
    """The order torch's ScheduleGPipe / Schedule1F1B ``_step_microbatches`` loops run (their
    ``pipeline_order`` tables are for display only and, in torch 2.13, number the last rank's 1F1B
    micro-batches from 1, so they are not replayed). 1F1B: stage s runs min(m, p - s) forwards,
    then backward/forward pairs, then the remaining backwards."""
    ops = []
    for s in range(p):
        if schedule == "gpipe":
            ops.append([(s, "F", k) for k in range(m)] + [(s, "B", k) for k in range(m)])
            continue
        warmup = min(m, p - s)
        rank = [(s, "F", k) for k in range(warmup)]
        fwd, bwd = warmup, 0
        while True:
            rank.append((s, "B", bwd))
            bwd += 1
            if fwd == m:
                break
            rank.append((s, "F", fwd))
            fwd += 1
        rank += [(s, "B", k) for k in range(bwd, m)]
        ops.append(rank)
    return ops


def simulated_bubble(schedule: str, p: int, m: int, v: int = 1) -> list[float] | None:
    """Per-rank idle fraction of the order torch runs ``schedule`` in (None where this torch
    version lacks the schedule's class)."""
    if schedule in ("gpipe", "1f1b", "deepspeed_1f1b"):
        return replay(single_stage_ops("gpipe" if schedule == "gpipe" else "1f1b", p, m), p, 1)
    ops = torch_order(schedule, p, m, v)
    return None if ops is None else replay(ops, p * v, v)


def torch_order(schedule: str, p: int, m: int, v: int) -> list[list[tuple[int, str, int]]] | None:
    """Each rank's compute actions in the order torch's multi-stage schedule ``schedule`` lists
    them (``pipeline_order``), built over stand-in stages the way torch's private visualizer
    helper does; that helper refuses one stage per rank, which zero bubble (ZB-H1) runs. None
    where this torch has no such class."""
    from unittest import mock

    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import PipelineStage

    cls = getattr(schedules, "Schedule" + TORCH_NAMES[schedule], None)
    if cls is None:
        return None
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p * v
    order = cls([stage] * v, m).pipeline_order
    return [[(a.stage_index, a.computation_type.value, a.microbatch_index) for a in order[r]
             if a is not None and a.computation_type.value in COST] for r in range(p)]
