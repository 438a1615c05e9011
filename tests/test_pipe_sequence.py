"""Pipelines with sequence parallelism (partita/pipe/sequence.py) equal single-process torch.

The model is a tiny causal transformer as a LayerSpec stack: token + learned position embeddings
(positions come in as an input, cut with the tokens), attention blocks whose attention is
``DistributedAttention`` (Ulysses) or ``RingAttention`` (bound to the sequence group at
``initialize``; a plain causal SDPA in the single-process oracle), a LayerNorm and a head. The
loss is a plain mean cross-entropy with some labels -100, unevenly spread over the sequence so the
two sequence ranks hold different numbers of valid tokens: averaging the ranks' own means would
be wrong, the token-weighted mean is exact.

Runs, 4 gloo processes: pipe 2 x sequence 2 with Ulysses (1F1B, ZeRO-1) and with ring attention
(GPipe, ZeRO-2); a checkpoint saved at pipe 2 x sequence 2 after one step and resumed at pipe 2 x
data 2 (same global batch), ending equal to the uninterrupted single-process run; and the refusals.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed

VOCAB, DIM, HEADS, SEQ = 13, 8, 2, 8
MICRO, M = 2, 2  # samples per micro-batch, micro-batches per step
N_BLOCKS, STEPS = 2, 2
LR, BASE_SEED = 1e-2, 4321


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)

    def forward(self, inputs: tuple) -> torch.Tensor:
        ids, positions = inputs
        return self.tok(ids) + self.pos(positions)


def _causal_sdpa_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on [batch, seq, heads, head_dim], the layout DistributedAttention passes."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


class AttentionBlock(nn.Module):
    """``x + proj(attention(ln(x)))``; ``kind`` picks how attention sees the whole sequence."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        from partita.sequence import RingAttention
        from partita.sequence.layer import DistributedAttention

        self.kind = kind
        self.ln = nn.LayerNorm(DIM)
        # No bias: a key bias only shifts every score of a query alike, so its true gradient is 0 and
        # Adam would blow rounding noise up to full-size steps that differ between layouts.
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM)
        if kind == "ulysses":
            self.attention = DistributedAttention(_causal_sdpa_bshd, None)
        elif kind == "ring":
            self.attention = RingAttention(None, causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)
        if self.kind == "ulysses":
            out = self.attention(q, k, v, 0)
        elif self.kind == "ring":  # [batch, heads, seq, head_dim]
            out = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        else:  # the oracle and sequence_parallel_size 1: plain causal attention
            out = _causal_sdpa_bshd(q, k, v)
        return x + self.proj(out.reshape(b, s, DIM))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def layer_specs(kind: str) -> list:
    from partita.pipe import LayerSpec

    return ([LayerSpec(Embed)] + [LayerSpec(AttentionBlock, kind) for _ in range(N_BLOCKS)]
            + [LayerSpec(nn.LayerNorm, DIM), LayerSpec(nn.Linear, DIM, VOCAB)])


def global_batches() -> tuple[torch.Tensor, torch.Tensor]:
    """[STEPS, M * MICRO, SEQ] ids and labels; the labels' -100s fall mostly in the second half."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (STEPS, M * MICRO, SEQ + 1), generator=g)
    labels = ids[..., 1:].clone()
    ignored = torch.rand(labels.shape, generator=g) < torch.linspace(0.0, 0.8, SEQ)
    labels[ignored] = -100
    return ids[..., :-1], labels


def reference() -> dict:
    """Single-process torch, the same layers under the same seeds, the whole global batch."""
    layers = []
    for i, spec in enumerate(layer_specs("local")):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(BASE_SEED + i)
            layers.append(spec.build())
    params = [p for layer in layers for p in layer.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ids, labels = global_batches()
    positions = torch.arange(SEQ).expand(M * MICRO, SEQ)
    losses = []
    for step in range(STEPS):
        h = layers[0]((ids[step], positions))
        for layer in layers[1:]:
            h = layer(h)
        # Gradient accumulation's loss: the mean of the micro-batches' own token means.
        loss = torch.stack([loss_fn(h[k * MICRO:(k + 1) * MICRO], labels[step][k * MICRO:(k + 1) * MICRO])
                            for k in range(M)]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {f"{i}.{k}": v.detach().clone() for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}
    return {"losses": losses, "state": state}


def _config(run: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": run.get("accumulation", M),
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {"stage": run.get("zero_stage", 1)},
        "pipeline": {"schedule": run.get("schedule", "1f1b")},
        "sequence_parallel_size": run.get("sequence", 2),
        "sequence_parallel": {"mode": "ring" if run["kind"] == "ring" else "ulysses"},
        "steps_per_print": 1000,
    }


def _micro_batches(engine, step: int, accumulation: int) -> list:
    """This data rank's micro-batches of the global batch (every sequence rank reads the same ones):
    micro-batch k of data rank d holds samples MICRO * (d * accumulation + k) onwards."""
    ids, labels = global_batches()
    positions = torch.arange(SEQ).expand(ids.shape[1], SEQ)
    first = engine.topology.data_rank * accumulation * MICRO
    return [((ids[step][first + k * MICRO:][:MICRO], positions[first + k * MICRO:][:MICRO]),
             labels[step][first + k * MICRO:][:MICRO]) for k in range(accumulation)]


def train_runs(runs: list[dict], ckpt_dir: str) -> list[dict]:
    import torch.distributed as dist

    import partita
    from partita.pipe import PipelineModule

    partita.init_distributed()
    out = []
    for run in runs:
        model = PipelineModule(layer_specs(run["kind"]), num_stages=2, loss_fn=loss_fn, partition_method="uniform",
                               seed_layers=True, base_seed=BASE_SEED)
        try:
            engine, *_ = partita.initialize(model=model, config=_config(run))
        except Exception as error:  # noqa: BLE001 - compared by the test
            out.append({"error": (type(error).__name__, str(error))})
            continue
        accumulation = run.get("accumulation", M)
        warnings: list[str] = []
        if run.get("load"):
            import logging

            class Record(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    warnings.append(record.getMessage())

            handler = Record(logging.WARNING)
            logging.getLogger("partita").addHandler(handler)
            engine.load_checkpoint(ckpt_dir)
            logging.getLogger("partita").removeHandler(handler)
        steps = range(engine.global_steps, run.get("stop", STEPS))
        losses = [engine.train_batch(iter(_micro_batches(engine, step, accumulation))).item() for step in steps]
        if run.get("save"):
            engine.save_checkpoint(ckpt_dir)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out.append({"losses": losses, "state": state, "rank": dist.get_rank(), "warnings": warnings,
                    "coords": (engine.topology.pipe_rank, engine.topology.data_rank, engine.topology.sequence_rank)})
        engine.destroy()
    return out


def _check(results: list[list[dict]], r: int, expected: dict, first_step: int = 0) -> None:
    whole: dict[str, torch.Tensor] = {}
    for rank_results in results:
        got = rank_results[r]
        assert got["losses"] == pytest.approx(expected["losses"][first_step:], rel=1e-5), (r, got["coords"])
        for key, value in got["state"].items():
            if key in whole:  # the other sequence (or data) rank of the stage: the same weights exactly
                torch.testing.assert_close(value, whole[key], rtol=0, atol=0)
            whole[key] = value
    assert sorted(whole) == sorted(expected["state"])
    for key, value in expected["state"].items():
        torch.testing.assert_close(whole[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"run {r} {k}: {m}")


def test_pipe_2_by_sequence_2_matches_torch_and_reshards(tmp_path) -> None:
    runs = [
        {"kind": "ulysses", "schedule": "1f1b", "zero_stage": 1},
        {"kind": "ring", "schedule": "gpipe", "zero_stage": 2},
        # Saved at pipe 2 x sequence 2 after one step, resumed at pipe 2 x data 2 (one micro-batch per
        # data rank: the same micro-batches of the same global batch): the second step ends where the
        # uninterrupted run does.
        {"kind": "ulysses", "zero_stage": 2, "stop": 1, "save": True},
        {"kind": "local", "zero_stage": 2, "sequence": 1, "accumulation": 1, "schedule": "gpipe", "load": True},
        # A pipeline whose attention is not sequence-parallel on any stage: refused on every rank.
        {"kind": "local", "sequence": 2},
    ]
    results = run_distributed(train_runs, 4, runs, str(tmp_path / "ckpt"), timeout=600)
    expected = reference()
    _check(results, 0, expected)
    _check(results, 1, expected)
    _check(results, 3, expected, first_step=1)
    for rank_results in results:
        assert rank_results[2]["losses"] == pytest.approx(expected["losses"][:1], rel=1e-5)
        # The global batch is the same (4 samples): sequence ranks read the same samples, so the
        # checkpoint counts 1 data rank, not 2, and the resume at data 2 warns of nothing.
        assert rank_results[3]["warnings"] == []
        kind, message = rank_results[4]["error"]
        assert kind == "NotImplementedError"
        assert message.startswith("sequence_parallel_size=2 with a PipelineModule that holds no "
                                  "partita.sequence.layer.DistributedAttention or partita.sequence.RingAttention layer")
    assert sorted(r[0]["coords"] for r in results) == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
