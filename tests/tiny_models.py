"""Small models for parity tests: odd sizes (padding at every world size), tied weights,
a frozen layer, a parameter that never gets a gradient, and a buffer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 13
WIDTH = 7
HIDDEN = 11
SEQ = 5


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.unused = nn.Linear(3, 3)  # trainable, never called: gets no gradient
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, WIDTH))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.offset
        h = h + self.frozen(h)
        h = h + self.fc2(torch.tanh(self.fc1(h)))
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def build_model(seed: int = 0) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


def param_groups(model: TiedNet, *, lr_scale: float = 1.0) -> list[dict]:
    """Two groups with different weight decay and learning rate."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2e-2 * lr_scale},
    ]


def make_batches(num_steps: int, global_batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (num_steps, global_batch, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (num_steps, global_batch, SEQ), generator=g)
    return x, y


def reference_train(
    *, num_steps: int, global_batch: int, lr: float, clip: float, betas=(0.9, 0.999)
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process torch: the oracle every ZeRO stage must match."""
    model = build_model()
    groups = param_groups(model)
    for g in groups:
        g["params"] = [p for p in g["params"] if p.requires_grad]
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)
    xs, ys = make_batches(num_steps, global_batch)
    norms = []
    for step in range(num_steps):
        opt.zero_grad()
        loss = model(xs[step], ys[step])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


class Block(nn.Module):
    def __init__(self, *, frozen: bool = False, with_unused: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        if frozen:
            self.up.requires_grad_(False)
        self.unused = nn.Linear(2, 2) if with_unused else None
        self.register_buffer("gain", torch.full((WIDTH,), 0.9))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gain * self.down(torch.tanh(self.up(self.norm(h))))


class BlockNet(nn.Module):
    """Repeated blocks in a ModuleList (ZeRO-3 units), a block called twice per forward,
    tied embedding/head, a frozen layer inside a block, a never-used parameter, buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block(frozen=True), Block(with_unused=True)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.reverse_blocks = False  # data-dependent control flow in tests: the unit order changes

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in reversed(self.blocks) if self.reverse_blocks else self.blocks:
            h = block(h)
        h = self.blocks[0](h)  # called twice in one forward
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def build_block_model(seed: int = 0) -> BlockNet:
    torch.manual_seed(seed)
    return BlockNet()


def reference_train_model(
    build, *, num_steps: int, global_batch: int, lr: float, clip: float, reverse_from: int | None = None
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process torch AdamW with global-norm clipping on the full batch."""
    model = build()
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in param_groups(model)]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    xs, ys = make_batches(num_steps, global_batch)
    norms = []
    for step in range(num_steps):
        if reverse_from is not None and step >= reverse_from:
            model.reverse_blocks = True
        opt.zero_grad()
        model(xs[step], ys[step]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms
