"""DeepSpeed's sparse-attention patterns: layouts against hand-computed blocks, FlexAttention and the
dense path against SDPA under the same explicit mask, the config section, the GPT wiring, errors.

Layouts use ``block=1`` so a layout is its token mask and the expected matrices can be read off
DeepSpeed's rules by hand (1: the query block row attends to the key block column).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partita.config import ConfigError, load_config
from partita.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
    layout_to_dense_mask,
)

# force_flex runs FlexAttention eagerly on CPU (its compiled kernel is the GPU path): torch warns once.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _m(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[int(c) for c in row] for row in rows], dtype=torch.int64)


# Fixed, 10 blocks, windows of 4 ([0-3], [4-7], short [8-9]); representative = last block of each
# window (3, 7) and, for the short window, min(8 + 3, 10 - 1) = 9.
FIXED_BI = _m(["1111000101", "1111000101", "1111000101", "1111000101", "0001111101",
               "0001111101", "0001111101", "0001111101", "0001000111", "0001000111"])
FIXED_UNI = _m(["1000000000", "1100000000", "1110000000", "1111000000", "0001100000",
                "0001110000", "0001111000", "0001111100", "0001000110", "0001000111"])
# Fixed bidirectional with horizontal global attention, 8 blocks: rows 3 and 7 attend to everything.
FIXED_HORIZONTAL = _m(["11110001", "11110001", "11110001", "11111111",
                       "00011111", "00011111", "00011111", "11111111"])
# Variable: windows [2, 3] then 3 repeating: [0-1], [2-4], [5-7], [8-9]; global column 1.
VARIABLE = _m(["1100000000", "1100000000", "0111100000", "0111100000", "0111100000",
               "0100011100", "0100011100", "0100011100", "0100000011", "0100000011"])
# Variable unidirectional, global ranges [0, 2) and [5, 6), windows of 3: [0-2], [3-5], [6-7].
# Global columns start at their own row (DeepSpeed's rule), so row 0 lists block 1 of the range [0, 2);
# the token-level causal mask removes it.
VARIABLE_UNI_RANGES = _m(["11000000", "11000000", "11100000", "11010000",
                          "11011000", "11011100", "11000110", "11000111"])
# BigBird without random blocks: window of 3 around the diagonal, block 0 global.
BIGBIRD = _m(["11111111", "11100000", "11110000", "10111000",
              "10011100", "10001110", "10000111", "10000011"])
# BSLongformer: window of 3, global block ranges [0, 1) and [4, 6), unidirectional (lower triangle).
BSLONGFORMER_UNI = _m(["10000000", "11000000", "11100000", "10110000",
                       "11111000", "11111100", "10001110", "10001111"])
SLIDING_UNI = _m(["10000000", "11000000", "01100000", "00110000",
                  "00011000", "00001100", "00000110", "00000011"])


@pytest.mark.parametrize(
    "config, seq, expected",
    [
        (FixedSparsityConfig(num_heads=2, block=1), 10, FIXED_BI),
        (FixedSparsityConfig(num_heads=2, block=1, attention="unidirectional"), 10, FIXED_UNI),
        (FixedSparsityConfig(num_heads=1, block=1, horizontal_global_attention=True), 8, FIXED_HORIZONTAL),
        (VariableSparsityConfig(num_heads=1, block=1, local_window_blocks=[2, 3], global_block_indices=[1]), 10, VARIABLE),
        (
            VariableSparsityConfig(
                num_heads=1, block=1, local_window_blocks=[3], global_block_indices=[0, 5],
                global_block_end_indices=[2, 6], attention="unidirectional",
            ),
            8,
            VARIABLE_UNI_RANGES,
        ),
        (BigBirdSparsityConfig(num_heads=1, block=1, num_random_blocks=0), 8, BIGBIRD),
        (
            BSLongformerSparsityConfig(
                num_heads=1, block=1, global_block_indices=[0, 4], global_block_end_indices=[1, 6],
                attention="unidirectional",
            ),
            8,
            BSLONGFORMER_UNI,
        ),
        (LocalSlidingWindowSparsityConfig(num_heads=1, block=1), 8, SLIDING_UNI),
        (DenseSparsityConfig(num_heads=1, block=1), 4, torch.ones(4, 4, dtype=torch.int64)),
    ],
    ids=["fixed", "fixed-uni", "fixed-horizontal", "variable", "variable-uni-ranges", "bigbird", "bslongformer-uni",
         "sliding", "dense"],
)
def test_layouts_equal_hand_computed_blocks(config, seq, expected) -> None:
    layout = config.make_layout(seq)
    assert layout.shape == (config.num_heads, *expected.shape)
    for head in layout:  # one layout for all heads unless different_layout_per_head
        assert torch.equal(head, expected), f"\n{head}"


def test_fixed_different_global_patterns_per_head() -> None:
    config = FixedSparsityConfig(num_heads=3, block=1, num_local_blocks=4, num_global_blocks=2,
                                 different_layout_per_head=True, num_different_global_patterns=2)
    layout = config.make_layout(8)
    # Head 0: representatives are the last 2 blocks of each window (2-3, 6-7); head 1: the 2 before (0-1, 4-5);
    # head 2 repeats head 0 (2 patterns).
    assert layout[0][:, [2, 3, 6, 7]].all() and not layout[0][4:, [0, 1]].any()
    assert layout[1][:, [0, 1, 4, 5]].all() and not layout[1][4:, [2, 3]].any()
    assert torch.equal(layout[2], layout[0])


def test_random_blocks_come_from_the_shared_seed() -> None:
    def layout(seed: int, attention: str = "bidirectional") -> torch.Tensor:
        return BigBirdSparsityConfig(num_heads=2, block=1, num_random_blocks=2, num_sliding_window_blocks=1,
                                     num_global_blocks=1, attention=attention, seed=seed).make_layout(16)[0]

    assert torch.equal(layout(5), layout(5))  # every rank builds the same layout
    assert not torch.equal(layout(5), layout(6))
    base = BigBirdSparsityConfig(num_heads=1, block=1, num_random_blocks=0, num_sliding_window_blocks=1).make_layout(16)[0]
    extra = layout(5) - base
    assert (extra >= 0).all() and (extra[1:].sum(-1) <= 2).all() and extra[1:].sum() > 8  # up to 2 random per row
    uni = layout(5, "unidirectional")
    assert torch.equal(uni, uni.tril())  # causal random blocks are drawn from the past only
    variable = VariableSparsityConfig(num_heads=1, block=1, num_random_blocks=3, local_window_blocks=[1],
                                      global_block_indices=[0], seed=1).make_layout(12)[0]
    assert ((variable[:, 1:].sum(-1) - 1) <= 3).all() and variable.sum() > 12 + 12  # random blocks present


def _qkv(heads: int, seq: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, seq, 8, generator=gen) for _ in range(3)]


CONFIGS = {
    "dense": DenseSparsityConfig(num_heads=2, block=16),
    "fixed": FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2, attention="unidirectional"),
    "variable": VariableSparsityConfig(num_heads=2, block=16, num_random_blocks=1, local_window_blocks=[1, 2],
                                       global_block_indices=[1], different_layout_per_head=True, seed=3),
    "bigbird": BigBirdSparsityConfig(num_heads=2, block=16, num_sliding_window_blocks=1, seed=4),
    "bslongformer": BSLongformerSparsityConfig(num_heads=2, block=16, num_sliding_window_blocks=1,
                                               global_block_indices=[2], attention="unidirectional"),
}


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_sparse_attention_equals_dense_attention_under_the_same_mask(mode: str) -> None:
    config = CONFIGS[mode]
    q, k, v = _qkv(2, 128)
    layout = config.make_layout(128)
    causal = getattr(config, "attention", "bidirectional") == "unidirectional"
    mask = layout_to_dense_mask(layout, 16, causal=causal)  # (heads, seq, seq)
    assert not mask.all() or mode == "dense"
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None])
    flex = SparseSelfAttention(config, max_seq_length=128, force_flex=True)(q, k, v)  # FlexAttention + BlockMask
    assert (flex - reference).abs().max() < 1e-5
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    dense = SparseSelfAttention(config, max_seq_length=128)(*inputs)  # CPU training path, with gradients
    assert (dense - reference).abs().max() < 1e-5
    dense.sum().backward()
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref_inputs, attn_mask=mask[None]).sum().backward()
    for mine, ref in zip(inputs, ref_inputs):
        assert (mine.grad - ref.grad).abs().max() < 1e-5


def test_block_mask_skips_the_empty_blocks() -> None:
    config = BSLongformerSparsityConfig(num_heads=1, block=128, num_sliding_window_blocks=1)
    sparse = SparseSelfAttention(config, max_seq_length=512)
    block_mask = sparse.block_mask(512, torch.device("cpu"))
    # The diagonal, block row 0 and block column 0: FlexAttention computes 10 of the 16 blocks.
    assert block_mask.to_dense()[0, 0].tolist() == sparse.layout(512)[0].tolist()
    assert int(sparse.layout(512).sum()) == 10


def test_masks_and_their_modes() -> None:
    config = BSLongformerSparsityConfig(num_heads=2, block=16, num_sliding_window_blocks=1)
    q, k, v = _qkv(2, 64, seed=2)
    sparse = SparseSelfAttention(config, max_seq_length=64)
    padding = torch.ones(2, 64)
    padding[1, 40:] = 0  # the second sample's last 24 tokens are padding
    attn = torch.ones(64, 64).tril()
    out = sparse(q, k, v, key_padding_mask=(padding - 1) * 1e9, attn_mask=attn)  # "add" and "mul" modes
    mask = layout_to_dense_mask(config.make_layout(64), 16, causal=False)[None] & attn.bool() & padding.bool()[:, None, None]
    assert (out - F.scaled_dot_product_attention(q, k, v, attn_mask=mask)).abs().max() < 1e-5


def test_sparse_attention_config_section() -> None:
    cfg = load_config({"train_batch_size": 1, "sparse_attention": {"mode": "bigbird", "block": 32}})
    pattern = cfg.sparse_attention.to_sparsity_config(4)
    assert isinstance(pattern, BigBirdSparsityConfig)
    assert (pattern.block, pattern.num_random_blocks, pattern.num_sliding_window_blocks, pattern.num_global_blocks) == (32, 1, 3, 1)
    fixed = load_config({"train_batch_size": 1, "sparse_attention": {}}).sparse_attention.to_sparsity_config(2)
    assert isinstance(fixed, FixedSparsityConfig) and (fixed.num_local_blocks, fixed.attention) == (4, "bidirectional")
    bad = [
        ({"mode": "fixed", "num_random_blocks": 2}, "mode 'fixed' does not read ['num_random_blocks']"),
        ({"mode": "fixed", "num_local_blocks": 4, "num_global_blocks": 3}, "must be divisible by num_global_blocks=3"),
        ({"mode": "fixed", "num_different_global_patterns": 2}, "needs different_layout_per_head=true"),
        ({"mode": "variable", "global_block_indices": [0, 3], "global_block_end_indices": [2]}, "give one end per start"),
        ({"mode": "bslongformer", "global_block_indices": [3], "global_block_end_indices": [3]}, "must be smaller"),
        ({"mode": "dense", "seed": 1}, "seed only affects modes"),
        ({"mode": "sliding"}, "not one of the choices"),
    ]
    for section, message in bad:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config({"train_batch_size": 1, "sparse_attention": section})


def test_bad_inputs() -> None:
    sparse = SparseSelfAttention(FixedSparsityConfig(num_heads=2, block=16), max_seq_length=64)
    q = torch.zeros(1, 2, 40, 8)
    with pytest.raises(ValueError, match=r"sequence length 40 is not divisible by the sparse attention block size 16.*48"):
        sparse(q, q, q)
    q = torch.zeros(1, 2, 80, 8)
    with pytest.raises(ValueError, match=r"exceeds max_seq_length=64.*max_seq_length >= 80"):
        sparse(q, q, q)
    q = torch.zeros(1, 3, 32, 8)
    with pytest.raises(ValueError, match=r"3 heads but the sparsity config was built for num_heads=2"):
        sparse(q, q, q)
    with pytest.raises(NotImplementedError, match=r"rpe"):
        sparse(q, q, q, rpe=torch.zeros(1))
    with pytest.raises(ValueError, match="needs sparsity_config="):
        SparseSelfAttention()
    with pytest.raises(ValueError, match=r"sequence length 40 is not divisible .* block size 16"):
        FixedSparsityConfig(num_heads=1).make_layout(40)
    with pytest.raises(ValueError, match=r"num_random_blocks=5 exceeds the 4 blocks"):
        BigBirdSparsityConfig(num_heads=1, num_random_blocks=5).make_layout(64)
    with pytest.raises(ValueError, match=r"num_sliding_window_blocks=5 exceeds the 4 blocks"):
        BSLongformerSparsityConfig(num_heads=1, num_sliding_window_blocks=5).make_layout(64)
    with pytest.raises(NotImplementedError, match="unidirectional"):
        FixedSparsityConfig(num_heads=1, attention="causal")
    with pytest.raises(ValueError, match="needs attention \"bidirectional\""):
        VariableSparsityConfig(num_heads=1, attention="unidirectional", horizontal_global_attention=True)


def _gpt():
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=64, n_layer=1, n_head=2, n_embd=16, bias=False))


def test_reference_gpt_runs_the_config_pattern() -> None:
    from partita.ops.sparse_attention import SparseAttentionConfig, apply_sparse_attention

    section = SparseAttentionConfig(mode="fixed", block=16, num_local_blocks=2, attention="unidirectional")
    model, plain = _gpt(), _gpt()
    assert apply_sparse_attention(model, section) == 1
    assert model.state_dict().keys() == plain.state_dict().keys()
    idx = torch.randint(0, 32, (2, 64), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx, idx)
    # The same GPT with its attention computed under the explicit mask.
    mask = layout_to_dense_mask(section.to_sparsity_config(2).make_layout(64), 16, causal=True)
    attn = plain.blocks[0].attn
    attn.attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None])
    ref_logits, ref_loss = plain(idx, idx)
    assert (logits - ref_logits).abs().max() < 1e-5 and abs(loss.item() - ref_loss.item()) < 1e-6
    loss.backward()
    assert model.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    # Really sparse: the plain causal GPT differs.
    assert (logits - _gpt()(idx)[0]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="causal language model: set sparse_attention.attention to \"unidirectional\""):
        apply_sparse_attention(_gpt(), SparseAttentionConfig(mode="bigbird"))
    with pytest.raises(ValueError, match=r"block=48 does not divide the model's block_size=64"):
        apply_sparse_attention(_gpt(), SparseAttentionConfig(mode="fixed", block=48, num_local_blocks=1,
                                                             attention="unidirectional"))
    with pytest.raises(ValueError, match="Linear builds its own layers"):
        apply_sparse_attention(torch.nn.Linear(2, 2), section)


def _initialize_with_section() -> tuple[float, float]:
    import partita
    from partita.ops.sparse_attention import SparseAttentionConfig, apply_sparse_attention

    section = {"mode": "bslongformer", "block": 16, "num_sliding_window_blocks": 1, "attention": "unidirectional"}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "sparse_attention": section, "steps_per_print": 1000}  # fmt: skip
    engine, *_ = partita.initialize(model=_gpt(), config=config)
    idx = torch.randint(0, 32, (2, 64), generator=torch.Generator().manual_seed(1))
    _, loss = engine(idx, idx)
    manual = _gpt()
    apply_sparse_attention(manual, SparseAttentionConfig(**section))
    return float(loss.detach()), float(manual(idx, idx)[1].detach())


def test_initialize_reads_the_section() -> None:
    from tests.harness import run_distributed

    got, expected = run_distributed(_initialize_with_section, 1)[0]
    idx = torch.randint(0, 32, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = float(_gpt()(idx, idx)[1])
    assert abs(got - expected) < 1e-6 and abs(got - plain) > 1e-4


def test_sliding_window_and_document_masks() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from partita.ops.sparse_attention import document_mask, masked_attention, sliding_window_mask

    q, k, v = _qkv(2, 32, seed=5)
    documents = torch.tensor([[0] * 10 + [1] * 22, [0] * 5 + [1] * 5 + [2] * 22])
    expected = {
        "window": torch.tensor([[0 <= i - j < 6 for j in range(32)] for i in range(32)])[None, None],
        "documents": torch.stack([
            torch.tensor([[j <= i and int(documents[b, i]) == int(documents[b, j]) for j in range(32)] for i in range(32)])
            for b in range(2)
        ])[:, None],  # fmt: skip
    }
    for name, mask_mod in (("window", sliding_window_mask(6)), ("documents", document_mask(documents))):
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=expected[name])
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = masked_attention(*inputs, mask_mod)
        assert (out - reference).abs().max() < 1e-5, name
        out.sum().backward()
        assert inputs[0].grad is not None
        # The same mask_mod as a FlexAttention BlockMask (the CUDA path), forward on CPU.
        block_mask = create_block_mask(mask_mod, 2, None, 32, 32, device="cpu", BLOCK_SIZE=8)
        assert (flex_attention(q, k, v, block_mask=block_mask) - reference).abs().max() < 1e-5, name
    with pytest.raises(ValueError, match="sliding window 0"):
        sliding_window_mask(0)
    with pytest.raises(ValueError, match=r"document_ids must be an integer tensor \(batch, seq\)"):
        document_mask(torch.zeros(4))
