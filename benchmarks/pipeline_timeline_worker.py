"""One rank of the pipeline timeline (``benchmarks/pipeline_timeline.py`` launches it under torchrun).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/pipeline_timeline_worker.py \
        --schedule zero_bubble --virtual-stages 2 --micro-batches 8 --steps 3 --warmup 2 --out DIR [--pin main|all]

It trains ``pipeline_cpu_worker``'s model (the same blocks, seeds, data and config as the pipeline
benchmark) with partita's ``PipelineEngine`` and records, for every timed batch, each event on this
rank with its wall-clock start and end (``time.perf_counter``) and the CPU time of the main thread
(``time.thread_time``) and of the whole process (``time.process_time``: gloo's threads too):

- ``action``: one entry of torch's action list (``_PipelineScheduleRuntime`` runs each action under
  ``schedules.record_function``, which this module replaces by a recorder), e.g. ``1F3``,
  ``0SEND_F2``, ``2RECV_B0``. The single-chunk schedules (GPipe, 1F1B) run loops instead of lists,
  so they have no action events, only the ones below;
- ``compute``: the PipelineStage calls ``forward_one_chunk`` (F), ``backward_one_chunk`` (B, or I
  when torch splits the backward) and ``backward_weight_one_chunk`` (W), and the loss;
- ``wait``: ``schedules._wait_batch_p2p`` (waiting for posted receives or sends);
- ``post``: ``schedules._batch_p2p`` (posting isend / irecv);
- ``window``: the torch schedule's ``step``; ``batch``: the whole ``train_batch``.

A wait that shows wall time but no CPU time is real idle (the neighbour has not sent yet); wall
time without CPU inside a compute call is the OS running something else on this core.

The wrappers patch module globals of ``torch.distributed.pipelining.schedules`` and instance
attributes of the engine's stages (private: what a benchmark that must time inside torch may do;
the worker fails loudly if they move).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as schedules

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from output_paths import output_dir  # noqa: E402
from pipeline_cpu_worker import BASE_SEED, BLOCKS, DIM, HIDDEN, batch, config, mse  # noqa: E402


class Recorder:
    """Events of the current batch: ``[kind, name, wall0, wall1, cpu0, cpu1, proc0, proc1]``,
    times relative to the batch's start."""

    def __init__(self) -> None:
        self.events: list[list] = []
        self.origin = 0.0
        self.on = False

    def start(self) -> None:
        self.events = []
        self.origin = time.perf_counter()
        self.on = True

    def timed(self, kind: str, name: str, fn, *args, **kwargs):
        if not self.on:
            return fn(*args, **kwargs)
        w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            w1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
            self.events.append([kind, name, w0 - self.origin, w1 - self.origin, c0, c1, p0, p1])

    def wrap(self, kind: str, name, fn):
        """``fn`` recorded as ``kind``; ``name`` is a string or a function of the call's arguments."""

        def run(*args, **kwargs):
            label = name(*args, **kwargs) if callable(name) else name
            return self.timed(kind, label, fn, *args, **kwargs)

        return run


class _ActionScope:
    """What ``schedules.record_function(name)`` returns while the recorder is installed: records
    the action named ``PP:<action>`` from enter to exit."""

    def __init__(self, recorder: Recorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def __enter__(self):
        self.w0, self.c0, self.p0 = time.perf_counter(), time.thread_time(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        if self.recorder.on:
            r = self.recorder
            self.recorder.events.append(["action", self.name.removeprefix("PP:"), self.w0 - r.origin,
                                         time.perf_counter() - r.origin, self.c0, time.thread_time(),
                                         self.p0, time.process_time()])


def install(recorder: Recorder, engine) -> None:
    """Patch torch's schedule module and the engine's stages so that ``recorder`` sees every event."""
    for attr in ("record_function", "_wait_batch_p2p", "_batch_p2p"):
        if not hasattr(schedules, attr):
            raise RuntimeError(f"torch.distributed.pipelining.schedules has no {attr} in torch {torch.__version__}: "
                               "the timeline's hooks need updating")
    schedules.record_function = lambda name: _ActionScope(recorder, name)
    schedules._wait_batch_p2p = recorder.wrap("wait", lambda work: f"n{len(work)}", schedules._wait_batch_p2p)
    schedules._batch_p2p = recorder.wrap("post", lambda ops, desc=None: _describe(ops), schedules._batch_p2p)
    for stage in engine._stages:
        s = stage.stage_index
        stage.forward_one_chunk = recorder.wrap("compute", lambda mb, *a, s=s, **k: f"{s}F{mb}", stage.forward_one_chunk)
        stage.backward_one_chunk = recorder.wrap(
            "compute", lambda mb, *a, s=s, full_backward=True, **k: f"{s}{'B' if full_backward else 'I'}{mb}",
            stage.backward_one_chunk)
        stage.backward_weight_one_chunk = recorder.wrap("compute", lambda mb, *a, s=s, **k: f"{s}W{mb}",
                                                        stage.backward_weight_one_chunk)
    engine._loss.loss_fn = recorder.wrap("compute", "loss", engine._loss.loss_fn)
    engine._train_schedule.step = recorder.wrap("window", "step", engine._train_schedule.step)


def _describe(ops) -> str:
    return ",".join(("send" if op.op is dist.isend else "recv") + f"@{op.group_peer if op.group_peer is not None else op.peer}"
                    for op in ops)


def torch_order(engine) -> list[str] | None:
    """This rank's action list with communication, as torch's runtime will run it (None for the
    single-chunk schedules, which loop instead)."""
    order = getattr(engine._train_schedule, "pipeline_order_with_comms", None)
    if not order:
        return None
    return [str(a) for a in order[engine._train_schedule.rank]]


def build(schedule: str, virtual: int, micro_batches: int, extra: dict):
    import partita
    from partita.pipe import LayerSpec, PipelineModule
    from pipeline_cpu_worker import Block

    model = PipelineModule([LayerSpec(Block, DIM, HIDDEN) for _ in range(BLOCKS)], num_stages=dist.get_world_size(),
                           loss_fn=mse, partition_method="uniform", seed_layers=True, base_seed=BASE_SEED,
                           virtual_stages=virtual)
    pipeline = {"schedule": schedule, **extra}
    engine, *_ = partita.initialize(model=model, config=config(micro_batches, {"pipeline": pipeline}))
    return engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", required=True)
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--pipeline-extra", default="{}", help="JSON merged into the config's pipeline section")
    p.add_argument("--pin", choices=("none", "main", "all"), default="none",
                   help="rank r on CPU r %% cpu_count: its main thread only (gloo's threads free), or every thread "
                        "(pinned before the process group starts its threads)")
    p.add_argument("--out", type=output_dir, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    cpu = {int(os.environ["RANK"]) % os.cpu_count()}
    if args.pin == "all":
        os.sched_setaffinity(0, cpu)  # threads started from here on inherit it
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    if args.pin == "main":
        os.sched_setaffinity(0, cpu)
    import partita

    partita.init_distributed()
    engine = build(args.schedule, args.virtual_stages, args.micro_batches, json.loads(args.pipeline_extra))
    recorder = Recorder()
    install(recorder, engine)
    steps = []
    for i in range(args.warmup + args.steps):
        data = batch(i, args.micro_batches)
        dist.barrier()
        recorder.start()
        loss = recorder.timed("batch", "train_batch", engine.train_batch, iter(data))
        recorder.on = False
        if i >= args.warmup:
            steps.append({"loss": float(loss), "events": recorder.events})
    record = {"rank": rank, "schedule": args.schedule, "virtual_stages": args.virtual_stages,
              "micro_batches": args.micro_batches, "stages": dist.get_world_size(),
              "stage_indices": [s.stage_index for s in engine._stages], "pinned": args.pin,
              "affinity": sorted(os.sched_getaffinity(0)), "torch_order": torch_order(engine), "steps": steps,
              "pipeline_extra": json.loads(args.pipeline_extra)}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
