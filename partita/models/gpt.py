"""A small GPT-2 style language model used by the examples, tests and benchmarks.

It is deliberately plain PyTorch (nanoGPT-sized): partita must train user models it has never
seen, so the reference model uses only ordinary modules, keeps its ``state_dict`` keys plain and
puts no attributes on its parameters. Two details matter to a ZeRO engine and are kept on
purpose because real models have them:

- the token embedding and the output head share one ``nn.Parameter`` (weight tying), so
  ``model.parameters()`` yields it once while ``state_dict()`` lists it under both
  ``tok_emb.weight`` and ``lm_head.weight`` (aliases of one tensor);
- the loss is computed in fp32 from the logits even when the model runs in bf16/fp16, because a
  softmax over the vocabulary in half precision loses the small differences training relies on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from partita.models.kv_cache import LayerKVCache, StaticKVCache


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. The defaults describe a byte-level model (vocabulary 256)."""

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    # Mixture of experts (partita.moe.layer.MoE): every moe_every-th block's MLP becomes moe_experts
    # experts with top-moe_top_k routing; 0 keeps every MLP dense. The GShard load-balancing loss
    # of each MoE block, times moe_aux_loss_coef, is added to the training loss.
    moe_every: int = 0
    moe_experts: int = 8
    moe_top_k: int = 2
    moe_capacity_factor: float = 1.0
    moe_drop_tokens: bool = True
    moe_ep_size: int = 1
    moe_aux_loss_coef: float = 0.01
    # Long-context memory levers (partita.sequence.tiling): None computes all tokens at once.
    # loss_tile_tokens: the LM head and the loss run over this many tokens at a time, so the
    # (T, vocab) fp32 logits never exist; training forwards (targets given) return logits None.
    # Cost: one more LM-head matmul in backward. mlp_tile_tokens: every dense MLP runs this many
    # tokens at a time, its (T, 4d) intermediate recomputed per tile in backward. Cost: one more
    # MLP forward per block.
    loss_tile_tokens: int | None = None
    mlp_tile_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"pick n_head among the divisors of n_embd"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.moe_every < 0 or (self.moe_every and not 1 <= self.moe_top_k <= self.moe_experts):
            raise ValueError(
                f"GPTConfig: moe_every={self.moe_every} must be >= 0 (0: no experts), and with experts "
                f"1 <= moe_top_k ({self.moe_top_k}) <= moe_experts ({self.moe_experts})"
            )
        for name in ("loss_tile_tokens", "mlp_tile_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"GPTConfig.{name} must be a positive int (tokens per tile) or None, got {value!r}")

    @classmethod
    def tiny(cls) -> GPTConfig:
        """Byte-level demo model (~0.8 M parameters): its loss falls visibly within two minutes on
        two CPU cores (two processes, one core each)."""
        return cls(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)

    @classmethod
    def gpt2_124m(cls) -> GPTConfig:
        """GPT-2 small shape. The vocabulary is 50304 (50257 rounded up to a multiple of 64 for
        faster matmuls), as in the GPU benchmarks."""
        return cls(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)

    @classmethod
    def gpt_1_3b(cls) -> GPTConfig:
        """The 1.3 B-parameter reference model of the GPU benchmarks (docs/performance/index.md)."""
        return cls(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048)

    @classmethod
    def gpt_125m(cls) -> GPTConfig:
        """The small variant of the GPU benchmark suite: GPT-2 small's shape at sequence 2048."""
        return cls(vocab_size=50304, block_size=2048, n_layer=12, n_head=12, n_embd=768)

    @classmethod
    def gpt_7b(cls) -> GPTConfig:
        """The large variant of the GPU benchmark suite (~6.9 B parameters, LLaMA-7B's width and depth)."""
        return cls(vocab_size=50304, block_size=2048, n_layer=32, n_head=32, n_embd=4096)

    @classmethod
    def gpt_scaled(cls, n_layer: int, n_embd: int, *, n_head: int | None = None, block_size: int = 2048) -> GPTConfig:
        """A GPT of the benchmarks' family with a chosen depth and width (head size 128 unless
        ``n_head`` is given): for "largest model that fits" searches."""
        return cls(vocab_size=50304, block_size=block_size, n_layer=n_layer, n_head=n_head or max(1, n_embd // 128), n_embd=n_embd)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``, which picks a
    flash / memory-efficient kernel where the device has one."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, kv_cache: LayerKVCache | None = None,
                cache_positions: torch.Tensor | None = None) -> torch.Tensor:
        """``kv_cache`` (generation, see partita/models/kv_cache.py): with ``cache_positions``
        None the input is a prompt at positions 0..T-1 (a prefill), else the tokens sit at those
        positions and attend over the cached ones."""
        # Shapes come from qkv's output, not from x or n_head: tensor parallelism gives each rank
        # whole heads (a column shard of q, k and v), and sequence parallelism feeds x as a
        # sequence shard that qkv gathers; the code below is the same for all of them.
        qkv = self.qkv(x)
        batch, seq, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim): SDPA attends over the last two dims.
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if kv_cache is None:
            y = self.attend(q, k, v)
        else:
            dropout_p = self.dropout if self.training else 0.0
            if cache_positions is None:
                y = kv_cache.prefill(q, k, v, dropout_p=dropout_p)
            else:
                y = kv_cache.extend(q, k, v, cache_positions, dropout_p=dropout_p)
        y = y.transpose(1, 2).contiguous().view(batch, seq, -1)
        return self.resid_dropout(self.proj(y))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of (B, heads, T, head_dim) tensors: the one place strategies that
        change how attention runs (its dropout stream under tensor parallelism, sequence
        parallelism's all-to-all) wrap."""
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.tile_tokens = config.mlp_tile_tokens  # None: all tokens at once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_tokens is None:
            return self.dense(x)
        from partita.sequence.tiling import tiled_mlp  # the model stays plain torch unless tiling is asked for

        return tiled_mlp(self.dense, x, tile_tokens=self.tile_tokens, params=tuple(self.parameters()))

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: the residual stream itself is never normalized, which
    keeps deep stacks trainable without warm-up tricks."""

    def __init__(self, config: GPTConfig, *, moe: bool = False) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        if moe:
            from partita.models.gpt_moe import MoEFeedForward

            self.mlp = MoEFeedForward(config)
        else:
            self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, kv_cache: LayerKVCache | None = None,
                cache_positions: torch.Tensor | None = None) -> torch.Tensor:
        # The cache is an argument of the block's forward (not state set on the attention) so that
        # whatever wraps a block (ZeRO-3's gather hooks, activation checkpointing) sees one call per
        # block and token, as in training.
        if kv_cache is None:
            x = x + self.attn(self.ln_1(x))
        else:
            x = x + self.attn(self.ln_1(x), kv_cache, cache_positions)
        return x + self.mlp(self.ln_2(x))


class LanguageModelLoss(nn.Module):
    """Mean next-token cross-entropy, in fp32 whatever the logits' dtype (see the module docstring)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def from_hidden(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tile_tokens: int) -> torch.Tensor:
        """The same mean from the final hidden states and the head weight, ``tile_tokens`` tokens at a time."""
        from partita.sequence.tiling import tiled_cross_entropy

        return tiled_cross_entropy(hidden, weight, targets, tile_tokens=tile_tokens)


class GPT(nn.Module):
    """Decoder-only transformer: ``forward(idx, targets=None) -> (logits, loss)``, and
    ``generate(idx, max_new_tokens)`` over a static KV cache (``decode_step`` is its compilable step)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        every = config.moe_every
        self.blocks = nn.ModuleList(Block(config, moe=every > 0 and (i + 1) % every == 0) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_loss = LanguageModelLoss()  # no parameters: tensor parallelism swaps in a vocabulary-parallel one
        # Weight tying: the output head reuses the embedding matrix (one Parameter, two modules).
        self.lm_head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 initialization: N(0, 0.02) weights, zero biases, and the two projections that
        write into the residual stream scaled by 1/sqrt(2 * n_layer), so the stream's variance
        does not grow with depth (each block adds two such contributions).

        Everything goes through ``self.apply``: under ``partita.zero.Init`` that is what makes
        each module's (sharded) parameters whole while they are initialised.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        residual = {id(block.attn.proj) for block in self.blocks} | {id(block.mlp.proj) for block in self.blocks if hasattr(block.mlp, "proj")}

        # Stacked MoE experts are initialised by MoEFeedForward (before the copies are made): drawing
        # here would consume the generator by the number of experts this rank holds (ep_size).
        experts = {id(m) for block in self.blocks if hasattr(block.mlp, "moe") for m in block.mlp.moe.experts.modules()}

        def init(module: nn.Module) -> None:
            if id(module) in experts:
                return
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if id(module) in residual else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

        self.apply(init)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, position_ids: torch.Tensor | None = None,
        kv_cache: StaticKVCache | None = None, logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return logits of shape (B, T, vocab_size) and the mean cross-entropy against
        ``targets`` (fp32 scalar), or ``None`` when no targets are given. With
        ``config.loss_tile_tokens`` and targets, the logits are ``None`` (never built).

        ``position_ids`` (T,): the tokens' positions in their sequence, default ``0..T-1``; a
        sequence-parallel rank holds a slice of each sequence at other positions.

        Generation (:meth:`generate`): ``kv_cache`` (:meth:`new_kv_cache`) without
        ``position_ids`` is a prefill (the prompt at 0..T-1, its keys and values cached); with
        ``position_ids`` the tokens attend over the cache up to their positions (a decode step).
        ``logits_to_keep`` > 0 computes the logits of the last that many positions only (a
        prefill needs the last one), as in Hugging Face's forward. Under tensor parallelism the
        logits' last dimension is this rank's vocabulary shard."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, seq), got {tuple(idx.shape)}")
        seq = idx.size(1)
        if seq > self.config.block_size:
            raise ValueError(
                f"cannot forward a sequence of length {seq}: block_size is {self.config.block_size}; "
                f"cut the input into windows of at most block_size tokens"
            )
        pos = torch.arange(seq, device=idx.device) if position_ids is None else position_ids
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        if kv_cache is None:
            for block in self.blocks:
                x = block(x)
        else:
            if targets is not None:
                raise ValueError("kv_cache serves generation: call the forward with kv_cache and no targets (the loss "
                                 "needs every position's logits from a forward without the cache)")
            if len(kv_cache) != len(self.blocks):
                raise ValueError(f"kv_cache has {len(kv_cache)} layers for a model of {len(self.blocks)} blocks: build it "
                                 f"with this model's new_kv_cache(max_len)")
            for block, layer in zip(self.blocks, kv_cache.layers):
                x = block(x, kv_cache=layer, cache_positions=position_ids)
        if logits_to_keep:
            if targets is not None:
                raise ValueError("logits_to_keep needs targets=None: the loss is computed over every position")
            x = x[:, -logits_to_keep:]
        tile = self.config.loss_tile_tokens
        if targets is not None and tile is not None:
            # Tiled loss: the (T, vocab) logits are never built, so there are none to return.
            logits, loss = None, self._tiled_loss(self.ln_f(x), targets, tile)
        else:
            logits = self.lm_head(self.ln_f(x))
            if targets is None:
                return logits, None
            loss = self.lm_loss(logits, targets)
        aux = [block.mlp.aux_loss for block in self.blocks if getattr(block.mlp, "aux_loss", None) is not None]
        if aux:
            loss = loss + self.config.moe_aux_loss_coef * torch.stack(aux).sum()
        return logits, loss

    def _tiled_loss(self, hidden: torch.Tensor, targets: torch.Tensor, tile: int) -> torch.Tensor:
        if targets.shape != hidden.shape[:-1]:
            raise ValueError(f"targets must have the shape of idx {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
        from_hidden = getattr(self.lm_loss, "from_hidden", None)
        if from_hidden is None:  # tensor parallelism's vocabulary-parallel loss, or a user's
            raise NotImplementedError(
                f"GPTConfig.loss_tile_tokens={tile} with the loss replaced by {type(self.lm_loss).__name__} (tensor_parallel."
                "vocab_parallel_lm_head, or your own) is not implemented: the tiled loss needs the whole head weight; "
                "set loss_tile_tokens to None or tensor_parallel.vocab_parallel_lm_head to false"
            )
        return from_hidden(hidden, self.lm_head.weight, targets, tile)

    # ------------------------------------------------------------------ generation
    def new_kv_cache(self, max_len: int) -> StaticKVCache:
        """An empty static KV cache of ``max_len`` slots per sequence (buffers allocated at the
        prefill, with the batch, heads, dtype and device the model computes)."""
        if max_len > self.config.block_size:
            raise ValueError(
                f"KV cache max_len {max_len} exceeds block_size {self.config.block_size} (the position embedding "
                f"has block_size rows); use max_len <= {self.config.block_size}"
            )
        return StaticKVCache(len(self.blocks), max_len)

    def decode_step(self, token: torch.Tensor, position: torch.Tensor, kv_cache: StaticKVCache) -> torch.Tensor:
        """Logits (B, vocab or this rank's vocabulary shard) for ``token`` (B, 1) at ``position``
        (a (1,) long tensor) after the tokens cached before it, its keys and values cached.

        Shapes depend on the batch and the cache's max_len only, never on the position: compile
        it once (``torch.compile(model.decode_step, mode="reduce-overhead")``) and replay it for
        every token. It runs through the model's ``__call__`` so module hooks (ZeRO-3's gathers)
        fire as in a forward."""
        logits, _ = self(token, position_ids=position, kv_cache=kv_cache)
        return logits[:, -1]

    def generate(self, idx: torch.Tensor | None = None, max_new_tokens: int | None = None, **options) -> torch.Tensor:
        """Continue the prompts ``idx`` (B, T) by ``max_new_tokens`` tokens; returns (B, T + new),
        fewer new tokens when ``eos_token_id`` ended every row. Greedy (argmax) unless
        ``do_sample``; keyword options and the Hugging Face calling shape (``input_ids=``,
        ``attention_mask=``) are described in :func:`partita.models.gpt_generate.generate`."""
        from partita.models.gpt_generate import generate

        return generate(self, idx, max_new_tokens, **options)

    def set_sequence_tiling(self, *, loss_tile_tokens: int | None, mlp_tile_tokens: int | None) -> None:
        """Set (or, with None, turn off) the tiled loss and the tiled dense MLPs after construction:
        what the config's ``sequence_tiling`` section does. MoE MLPs are never tiled (their routing
        capacity is per call)."""
        self.config = dataclasses.replace(self.config, loss_tile_tokens=loss_tile_tokens, mlp_tile_tokens=mlp_tile_tokens)
        for module in self.modules():
            if isinstance(module, MLP):
                module.tile_tokens = mlp_tile_tokens

    def num_parameters(self, *, exclude_position_embedding: bool = False) -> int:
        """Number of distinct parameters (the tied embedding/head matrix counts once)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_position_embedding:
            total -= self.pos_emb.weight.numel()
        return total

    def flops_per_token(self, *, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6N + 12·L·d·T (PaLM appendix B; Kaplan et al.).

        6N covers forward and backward matmuls over the parameters; N leaves out the position
        embedding (a lookup, no matmul) but keeps the tied token embedding, which the output head
        multiplies by. 12·L·d·T covers attention scores and the weighted sum, whose cost grows with
        the sequence length T (default: block_size).
        """
        seq = self.config.block_size if seq_len is None else seq_len
        n = self.num_parameters(exclude_position_embedding=True)
        for block in self.blocks:  # a token runs through top_k of the experts, not all of them
            if hasattr(block.mlp, "active_fraction"):
                local = sum(p.numel() for p in block.mlp.moe.experts.parameters())
                n += round(local * (block.mlp.active_fraction() - 1))
        return 6 * n + 12 * self.config.n_layer * self.config.n_embd * seq

    def optimizer_param_groups(self, weight_decay: float) -> list[dict]:
        """Two optimizer groups: weight decay on matrices (>= 2-D: linear and embedding weights),
        none on biases and LayerNorm parameters, whose decay only hurts.

        Every trainable parameter appears exactly once (``named_parameters`` already yields the
        tied matrix a single time).
        """
        decay, no_decay = [], []
        for _, param in self.named_parameters():
            if not param.requires_grad:
                continue
            (decay if param.dim() >= 2 else no_decay).append(param)
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
