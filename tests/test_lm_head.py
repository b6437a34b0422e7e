"""LM head (spec 01 §5): row selection, FP32 logits, vocab shards, greedy argmax."""
import torch

from types import SimpleNamespace

from dsv41.config import FLASH, Topology
from dsv41.ops.lm_head import greedy, logits_shard, select_rows
from _fp32_sum import defined_sum, within_fp32_bound
from _spec_ref import bf16_64


def _g(seed):
    return torch.Generator().manual_seed(seed)


def test_select_rows_minus_one_is_zero_and_clamps():
    hidden = bf16_64(torch.randn(6, 16, generator=_g(0))).float()
    rows = select_rows(hidden, torch.tensor([-1, 0, 5, 100], dtype=torch.int32))
    assert (rows[0] == 0).all()
    assert torch.equal(rows[1], hidden[0]) and torch.equal(rows[2], hidden[5])
    assert torch.equal(rows[3], hidden[5])                          # clamped into [0, T-1]
    empty = select_rows(torch.zeros(0, 16), torch.tensor([-1, -1]))
    assert empty.shape == (2, 16) and (empty == 0).all()


def test_zero_row_gives_zero_logits_and_argmax_zero():
    hidden = bf16_64(torch.randn(3, 16, generator=_g(1))).float()
    head = bf16_64(torch.randn(40, 16, generator=_g(2))).float()
    logits = logits_shard(select_rows(hidden, torch.tensor([2, -1])), head)
    assert logits.dtype == torch.float32 and logits.shape == (2, 40)
    assert (logits[1] == 0).all()
    assert greedy(logits)[1].item() == 0


def test_logits_fp32_vs_exact():
    rows = bf16_64(torch.randn(4, 128, generator=_g(3))).float()
    head = bf16_64(torch.randn(64, 128, generator=_g(4)) * 128 ** -0.5).float()
    got = logits_shard(rows, head)
    # the linears' FP32 sum in its written order, within FP32 summation's bound of the exact logits
    # (BF16 x BF16 products have 16 significant bits: these 128 sum exactly in FP64)
    assert got.dtype == torch.float32 and torch.equal(got, defined_sum(rows, head))
    assert within_fp32_bound(got, rows, head)


def test_greedy_lowest_id_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0], [-1.0, -5.0, -1.0, -2.0]])
    assert greedy(logits).tolist() == [1, 0, 0]
    big = torch.zeros(1, FLASH.vocab_size)
    big[0, [70000, 129279, 300]] = 7.0
    assert greedy(big).tolist() == [300]


def test_vocab_shards_concatenate_to_full():
    vocab, d = 96, 32
    rows = bf16_64(torch.randn(3, d, generator=_g(5))).float()
    head = bf16_64(torch.randn(vocab, d, generator=_g(6))).float()
    want = defined_sum(rows, head)          # each logit's sum over the whole hidden, in its order
    cfg = SimpleNamespace(vocab_size=vocab)
    for tp in (1, 2, 4, 8):
        shards = [Topology(tp, 1, tp).vocab_rows(cfg, r) for r in range(tp)]
        assert [s.start for s in shards] == [r * vocab // tp for r in range(tp)]
        assert shards[-1].stop == vocab
        full = torch.cat([logits_shard(rows, head[s.start:s.stop]) for s in shards], 1)
        assert full.shape == (3, vocab)
        assert torch.equal(full, want)
        assert torch.equal(greedy(full), torch.argmax(want, -1))
    assert Topology(8, 1, 8).vocab_rows(FLASH, 1) == range(16160, 32320)
