"""Measured step time with compression on and off, 4 gloo ranks on CPU, on loopback and on an
emulated slow link (1 and 10 Gbps per rank), next to the cost model's prediction for the same bytes.

    python -m benchmarks.compressed_comm_cpu            # ~2-4 min on 2 CPU cores
    python -m benchmarks.compressed_comm_cpu --json out.json --gbps 10 1 --rounds 3

gloo moves every collective over TCP, here loopback: far faster than a link between nodes, and
no throttle is available unprivileged (`tc`/netem needs CAP_NET_ADMIN; gloo has no rate limit).
So the link is EMULATED, inside this benchmark only: partita's comms logger sees every collective
start and complete (partita/distributed/collectives.py), and here its two hooks are wrapped so
that each rank has one serial link of ``gbps``. A collective's transfer starts when it is issued
or when the link is free of the previous one, lasts its bus bytes (message x nccl-tests' bus
factor over the group: what one rank sends in a ring) / ``gbps``, and the collective does not
complete before the transfer ends (the rank sleeps the difference when it waits; differences
under 1 ms are carried on the link clock and slept later, at the latest at the end of the step).
Work between issue and wait overlaps the transfer, as on a real link. This is every rank on its own node with
a ``gbps`` link, i.e. partita.monitor.comm_model with ``ranks_per_node=1``.

The reference GPT (default shape, 858,880 parameters), bf16, 2 samples x 64 tokens per rank.
Every case is built once; then ``rounds`` rounds each run every (link, case) pair for STEPS
steps, interleaved so that the shared host's drift hits every case alike; a pair's step time is
the median over rounds of its block's median step (each step bracketed by barriers). Bytes are
the comms logger's message bytes of one step. The model's prediction for a link: the loopback
step plus the transfer of those bytes at ``gbps`` (no overlap), or the larger of the two (full
overlap); the coding cost is inside the loopback step already.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tests.harness import run_distributed

WORLD, STEPS, WARMUP = 4, 6, 2
SLEEP_MIN_S = 1e-3
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every weight sharded (the default keeps this model whole)
CASES = {
    "ZeRO-3": ("AdamW", Z3),
    "ZeRO-3 + qwZ": ("AdamW", {**Z3, "zero_quantized_weights": True}),
    "ZeRO-3 + qwZ + qgZ (int4)": ("AdamW", {**Z3, "zero_quantized_weights": True, "zero_quantized_gradients": True}),
    "ZeRO-0 AdamW": ("AdamW", {"stage": 0}),
    "ZeRO-0 OneBitAdam (compressed)": ("OneBitAdam", {"stage": 0}),
}


class EmulatedLink:
    """One serial link per rank at ``gbps`` (None: no emulation), over the comms logger's hooks."""

    def __init__(self, logger) -> None:
        from partita.monitor.comms_logger import bus_factor

        self.gbps: float | None = None
        self._bus_factor, self._free_at, self._ends = bus_factor, 0.0, {}
        self._start, self._stop = logger.start, logger._stop
        logger.start, logger._stop = self.start, self.stop  # instance attributes shadow the methods

    def start(self, op, message_bytes, tensor, group, purpose):
        token = self._start(op, message_bytes, tensor, group, purpose)
        if token is not None and self.gbps is not None:
            seconds = message_bytes * self._bus_factor(op, token.group_size) * 8 / (self.gbps * 1e9)
            begin = max(time.perf_counter(), self._free_at)
            self._free_at = begin + seconds
            self._ends[id(token)] = self._free_at
        return token

    def stop(self, token) -> None:
        end = self._ends.pop(id(token), None)
        if end is not None:
            late = end - time.perf_counter()
            # Sleeps shorter than SLEEP_MIN_S are deferred: on 2 shared cores each wake-up costs
            # about a scheduler slice, which hundreds of microsecond sleeps per step would add up.
            # The link clock keeps the debt (the next transfer queues behind it), and flush() pays it.
            if late > SLEEP_MIN_S:
                time.sleep(late)
        self._stop(token)

    def flush(self) -> None:
        """The step's last transfer has ended (called before the step's closing barrier)."""
        late = self._free_at - time.perf_counter()
        if self.gbps is not None and late > 0:
            time.sleep(late)


def _build(name: str):
    import partita
    from partita.models.gpt import GPT, GPTConfig

    kind, zero = CASES[name]
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    params = {"lr": 1e-3, **({"freeze_step": 2} if kind == "OneBitAdam" else {})}  # compressed from step 3
    cfg = {"train_batch_size": 2 * WORLD, "bf16": {"enabled": True}, "optimizer": {"type": kind, "params": params},
           "zero_optimization": zero, "comms_logger": {"enabled": True}, "steps_per_print": 10**6}
    engine, _, _, _ = partita.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def run_all(links: list[float | None], rounds: int) -> dict:
    import torch.distributed as dist

    from partita.monitor.comms_logger import COMMS_LOGGER

    link = EmulatedLink(COMMS_LOGGER)
    engines = {name: _build(name) for name in CASES}
    g = torch.Generator().manual_seed(dist.get_rank())

    def steps(engine, n: int) -> tuple[list[float], list, float]:
        times = []
        for _ in range(n):
            x = torch.randint(0, 256, (2, 64), generator=g)
            COMMS_LOGGER.reset()
            dist.barrier()
            begin = time.perf_counter()
            _, loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            link.flush()
            dist.barrier()
            times.append(time.perf_counter() - begin)
        return times, COMMS_LOGGER.records(), float(loss.detach())

    for engine in engines.values():  # warm-up (and OneBitAdam's full-precision steps), no link
        steps(engine, WARMUP + 1)
    blocks: dict[str, dict[str, list[float]]] = {name: {str(g_): [] for g_ in links} for name in CASES}
    last: dict[str, tuple] = {}
    for _ in range(rounds):
        for gbps in links:
            link.gbps = gbps
            for name, engine in engines.items():
                times, records, loss = steps(engine, STEPS)
                blocks[name][str(gbps)].append(statistics.median(times[WARMUP:]))
                last[name] = (records, loss)
    link.gbps = None
    out = {}
    for name in CASES:
        records, loss = last[name]
        out[name] = {"step_s": {k: statistics.median(v) for k, v in blocks[name].items()},
                     "block_medians_s": blocks[name],
                     "collectives": [(r.op, r.purpose, r.message_bytes, r.group_size) for r in records],
                     "message_bytes": sum(r.message_bytes for r in records), "loss": loss}
    return out


def predict(case: dict, gbps: float) -> dict:
    """The cost model's step for this case's counted bytes at ``gbps`` per rank (4 nodes of 1 rank)."""
    from partita.monitor import comm_model as cm

    plan = [cm.Collective(op, purpose, size) for op, purpose, size, group in case["collectives"] if group == WORLD]
    assert len(plan) == len(case["collectives"]), "every collective here is over the whole world"
    base = case["step_s"]["None"]
    transfer = cm.transfer_seconds(plan, world=WORLD, ranks_per_node=1, gbps=gbps)
    return {"transfer_s": transfer, "no_overlap_s": base + transfer, "full_overlap_s": max(base, transfer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbps", type=float, nargs="+", default=[10.0, 1.0], help="emulated link speeds per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    links: list[float | None] = [None, *args.gbps]
    cases = run_distributed(run_all, WORLD, links, args.rounds)[0]
    for case in cases.values():
        case["predicted"] = {str(g): predict(case, g) for g in args.gbps}
    head = "".join(f"{f'{g:g} Gbps ms (model)':>26}" for g in args.gbps)
    print(f"{'case':<34}{'bytes/step':>12}{'loopback ms':>13}{head}")
    for name, case in cases.items():
        cells = "".join(f"{case['step_s'][str(g)] * 1e3:>10.1f} ({case['predicted'][str(g)]['no_overlap_s'] * 1e3:.0f}"
                        f"/{case['predicted'][str(g)]['full_overlap_s'] * 1e3:.0f})".rjust(26) for g in args.gbps)
        print(f"{name:<34}{case['message_bytes']:>12,}{case['step_s']['None'] * 1e3:>13.1f}{cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": WORLD, "steps": STEPS, "warmup": WARMUP, "rounds": args.rounds, "gbps": args.gbps,
                       "link": "emulated (benchmarks/compressed_comm_cpu.py: EmulatedLink), loopback underneath",
                       "torch": torch.__version__, "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main()
