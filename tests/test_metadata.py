"""Forward-metadata lowering (spec 01 §2) on a hand-worked TINY example (block_size 16, window 16).

Request 0: fresh prefill of 19 tokens (positions 0..18). Request 1: one decode token at position 37
(37 tokens already cached). Physical blocks are chosen by hand so every slot below is a literal.
"""
import pytest
import torch

from dsv41.config import TINY
from dsv41.ops.metadata import lower

I32 = torch.int32
R2, R1 = (2, 8, 14), 20


def _inputs(**over):
    d = dict(
        query_start_loc=torch.tensor([0, 19, 20], dtype=I32),
        kv_seq_lens=torch.tensor([0, 37], dtype=I32),
        window_block_table=torch.tensor([[5, 9, -1], [-1, 3, 7]], dtype=I32),
        compressed_block_tables={**{s: torch.tensor([[4, -1], [2, 6]], dtype=I32) for s in R2},
                                 R1: torch.tensor([[1, 8, -1], [0, 3, 5]], dtype=I32)},
        state_block_tables={s: torch.tensor([[1], [0]], dtype=I32) for s in R2},
        prompt_lens=torch.tensor([19, 30], dtype=I32),
    )
    d.update(over)
    return d


def _lower(**over):
    return lower(TINY, **_inputs(**over))


def L(t):
    return t.tolist()


def test_request_level_fields():
    md = _lower()
    assert L(md.query_start_loc) == [0, 19, 20]
    assert L(md.query_lens) == [19, 1]
    assert L(md.logit_row_indices) == [18, 19]
    assert L(md.kv_seq_lens) == [0, 37]
    assert md.num_tokens == 20 and md.num_requests == 2
    for f in ("query_start_loc", "query_lens", "logit_row_indices", "kv_seq_lens", "token_to_req_indices",
              "position_ids", "window_lens", "window_indices", "window_list_widths"):
        assert getattr(md, f).dtype == I32, f
    assert md.window_slots.dtype == torch.int64


def test_token_level_fields():
    md = _lower()
    assert L(md.token_to_req_indices) == [0] * 19 + [1]
    assert L(md.position_ids) == list(range(19)) + [37]
    # window table row 0 = [5, 9]: positions 0..15 -> block 5 (80 + p), 16..18 -> block 9 (144..146)
    # row 1 = [-, 3, 7]: position 37 -> page 2, offset 5 -> 7*16 + 5 = 117
    assert L(md.window_slots) == list(range(80, 96)) + [144, 145, 146] + [117]
    assert L(md.window_lens) == list(range(1, 17)) + [16, 16, 16] + [16]


def test_window_indices_ascending_truncated_and_paged():
    md = _lower()
    w = md.window_indices
    assert w.shape == (20, 16)
    assert L(w[0]) == [80] + [-1] * 15
    assert L(w[4]) == [80, 81, 82, 83, 84] + [-1] * 11
    assert L(w[15]) == list(range(80, 96))
    assert L(w[18]) == list(range(83, 96)) + [144, 145, 146]       # positions 3..18, across blocks 5 -> 9
    assert L(w[19]) == list(range(54, 64)) + list(range(112, 118))  # positions 22..37, blocks 3 -> 7


def test_window_list_widths_come_from_the_whole_prompt():
    """min(prompt, window) window slots on a prompt's rows, the window (16) on generated rows, whatever
    rows the step holds: request 0 is the hand-worked 19-token prompt, request 1 decodes at 37."""
    md = _lower()
    assert L(md.window_list_widths) == [16] * 19 + [16]
    # the same 19 rows as the chunk 0..18 of a 12-token prompt's recompute (positions 12.. generated),
    # then as a chunk of a 40-token prompt: the step's rows never size the list
    assert L(_lower(prompt_lens=torch.tensor([12, 30], dtype=I32)).window_list_widths) == [12] * 12 + [16] * 8
    assert L(_lower(prompt_lens=torch.tensor([40, 30], dtype=I32)).window_list_widths) == [16] * 20
    # a 7-row chunk of a 10-token prompt after 3 rows (a cached prefix or an earlier chunk), and a
    # 5-token prompt in one step: 10 and 5, as their one-step prefills list
    md = lower(TINY, torch.tensor([0, 7, 12], dtype=I32), torch.tensor([3, 0], dtype=I32),
               torch.tensor([[2], [3]], dtype=I32),
               {**{s: torch.tensor([[0], [1]], dtype=I32) for s in R2}, R1: torch.tensor([[4], [5]], dtype=I32)},
               {s: torch.tensor([[0], [1]], dtype=I32) for s in R2}, torch.tensor([10, 5], dtype=I32))
    assert L(md.position_ids) == list(range(3, 10)) + list(range(5))
    assert L(md.window_list_widths) == [10] * 7 + [5] * 5


def test_ratio2_source_fields():
    md = _lower()
    for s in R2:
        # table [[4], [2, 6]]; only odd positions publish row p // 2; position 37 -> row 18 -> 6*16 + 2
        want = [(64 + p // 2) if p % 2 else -1 for p in range(19)] + [98]
        assert L(md.compressed_slots[s]) == want
        assert md.compressed_slots[s].dtype == torch.int64
        assert L(md.compressed_lens[s]) == [(p + 1) // 2 for p in range(19)] + [19]
        assert L(md.compressed_rope_position_ids[s]) == [(p - 1) if p % 2 else -1 for p in range(19)] + [36]
        assert L(md.state_block_tables[s]) == [[1], [0]]
        assert L(md.compressed_block_tables[s]) == [[4, -1], [2, 6]]
    assert R1 not in md.state_block_tables


def test_ratio1_source_fields():
    md = _lower()
    # table [[1, 8], [0, 3, 5]]: positions 0..15 -> 16 + p, 16..18 -> 128..130; 37 -> 5*16 + 5
    want = [16 + p for p in range(16)] + [128, 129, 130] + [85]
    assert L(md.compressed_slots[R1]) == want
    assert L(md.compressed_lens[R1]) == list(range(1, 20)) + [38]
    assert L(md.compressed_rope_position_ids[R1]) == list(range(19)) + [37]


def test_even_decode_position_publishes_nothing_for_ratio2():
    md = _lower(kv_seq_lens=torch.tensor([0, 36], dtype=I32))
    assert md.position_ids[-1].item() == 36
    assert md.compressed_slots[2][-1].item() == -1
    assert md.compressed_rope_position_ids[2][-1].item() == -1
    assert md.compressed_slots[R1][-1].item() == 5 * 16 + 4


def test_inactive_state_block_forces_ratio2_slots_to_minus_one():
    md = _lower(state_block_tables={s: torch.tensor([[1], [-1]], dtype=I32) for s in R2})
    for s in R2:
        assert md.compressed_slots[s][-1].item() == -1
        assert L(md.compressed_slots[s][:19]) == [(64 + p // 2) if p % 2 else -1 for p in range(19)]
    assert md.compressed_slots[R1][-1].item() == 85                   # ratio 1 has no state


def test_empty_request_gets_logit_row_minus_one():
    md = lower(TINY, torch.tensor([0, 3, 3], dtype=I32), torch.tensor([0, 5], dtype=I32),
               torch.tensor([[2], [-1]], dtype=I32),
               {**{s: torch.tensor([[0], [-1]], dtype=I32) for s in R2}, R1: torch.tensor([[1], [-1]], dtype=I32)},
               {s: torch.tensor([[0], [1]], dtype=I32) for s in R2}, torch.tensor([3, 5], dtype=I32))
    assert L(md.query_lens) == [3, 0]
    assert L(md.logit_row_indices) == [2, -1]
    assert L(md.token_to_req_indices) == [0, 0, 0]


# ---- validation: every bad input raises ValueError naming the field -------------------------------

def _raises(field, **over):
    with pytest.raises(ValueError) as e:
        _lower(**over)
    assert field in str(e.value), str(e.value)


def test_prompt_lens_errors():
    _raises("prompt_lens", prompt_lens=torch.tensor([19], dtype=I32))
    _raises("prompt_lens", prompt_lens=torch.tensor([19, -1], dtype=I32))
    _raises("prompt_lens", prompt_lens=torch.tensor([19.0, 30.0]))


def test_query_start_loc_errors():
    _raises("query_start_loc", query_start_loc=torch.tensor([1, 19, 20], dtype=I32))
    _raises("query_start_loc", query_start_loc=torch.tensor([0, 19, 18], dtype=I32))
    _raises("query_start_loc", query_start_loc=torch.tensor([0.0, 19.0, 20.0]))
    _raises("query_start_loc", query_start_loc=torch.tensor([[0, 19, 20]], dtype=I32))


def test_kv_seq_lens_errors():
    _raises("kv_seq_lens", kv_seq_lens=torch.tensor([0, -1], dtype=I32))
    _raises("kv_seq_lens", kv_seq_lens=torch.tensor([0], dtype=I32))
    _raises("kv_seq_lens", kv_seq_lens=torch.tensor([[0, 37]], dtype=I32))


def test_position_beyond_max_position_embeddings():
    big = TINY.max_position_embeddings
    _raises("position_ids", kv_seq_lens=torch.tensor([0, big], dtype=I32))
    _raises("position_ids", kv_seq_lens=torch.tensor([big - 18, 37], dtype=I32))


def test_window_block_table_errors():
    _raises("window_block_table", window_block_table=torch.tensor([[5, 9], [-1, 3]], dtype=I32))       # too narrow
    _raises("window_block_table", window_block_table=torch.tensor([[5, 9, -1], [-1, -1, 7]], dtype=I32))  # page 1 < 0
    _raises("window_block_table", window_block_table=torch.tensor([[5, 9, -1]], dtype=I32))           # rows != B
    _raises("window_block_table", window_block_table=torch.tensor([5, 9, -1], dtype=I32))             # 1-D


def test_compressed_block_table_errors():
    base = _inputs()["compressed_block_tables"]
    _raises("compressed_block_tables", compressed_block_tables={s: t for s, t in base.items() if s != R1})
    _raises("compressed_block_tables", compressed_block_tables={s: t for s, t in base.items() if s != 8})
    unequal = dict(base)
    unequal[8] = torch.tensor([[4, -1], [2, 7]], dtype=I32)
    _raises("compressed_block_tables[8]", compressed_block_tables=unequal)
    narrow = {**{s: torch.tensor([[4], [2]], dtype=I32) for s in R2}, R1: base[R1]}
    _raises("compressed_block_tables[2]", compressed_block_tables=narrow)
    negative = {**base, R1: torch.tensor([[1, 8, -1], [0, -1, 5]], dtype=I32)}
    _raises("compressed_block_tables[20]", compressed_block_tables=negative)
    rows = {**base, R1: torch.tensor([[1, 8, -1]], dtype=I32)}
    _raises("compressed_block_tables[20]", compressed_block_tables=rows)


def test_state_block_table_errors():
    def st(rows):
        return {s: torch.tensor(rows, dtype=I32) for s in R2}
    _raises("state_block_tables[2]", state_block_tables=st([[-2], [0]]))      # < -1
    _raises("state_block_tables[2]", state_block_tables=st([[3], [3]]))       # duplicate live block
    _raises("state_block_tables[2]", state_block_tables=st([[0, 1], [2, 3]]))  # wrong shape
    _raises("state_block_tables[2]", state_block_tables=st([0, 1]))           # wrong ndim
    _raises("state_block_tables", state_block_tables={8: torch.tensor([[1], [0]], dtype=I32)})  # missing 2
    # -1 may repeat (inactive), only live blocks must be distinct
    md = _lower(state_block_tables=st([[-1], [-1]]))
    assert md.compressed_slots[2][1].item() == -1


def test_bad_input_leaves_inputs_untouched():
    inp = _inputs(kv_seq_lens=torch.tensor([0, -1], dtype=I32))
    snap = {k: (v.clone() if torch.is_tensor(v) else {s: t.clone() for s, t in v.items()}) for k, v in inp.items()}
    with pytest.raises(ValueError):
        lower(TINY, **inp)
    for k, v in inp.items():
        if torch.is_tensor(v):
            assert torch.equal(v, snap[k])
        else:
            assert all(torch.equal(v[s], snap[k][s]) for s in v)
