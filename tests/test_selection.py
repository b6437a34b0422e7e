"""The tie-aware selection comparison on constructed ties."""
import pytest
import torch

from dsv41.kernels.ties import block_selection, tie_mismatch_rows
from selection import assert_same_blocks, assert_same_selection


def test_swaps_among_equal_scores_agree():
    scores = torch.tensor([[5.0, 0.0, 0.0, 0.0, 3.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0]])
    a = torch.tensor([[0, 4, 1], [0, 1, 2]])
    b = torch.tensor([[4, 3, 0], [2, 3, 4]])          # 1 <-> 3 (both 0.0); row 1 all tied
    assert tie_mismatch_rows(a, b, scores) == []
    assert_same_selection(a, b, scores)


def test_swap_of_unequal_scores_fails():
    scores = torch.tensor([[5.0, 0.0, 0.5, 0.0, 3.0]])
    a = torch.tensor([[0, 4, 2]])
    b = torch.tensor([[0, 4, 1]])                     # 2 (0.5) swapped for 1 (0.0)
    assert tie_mismatch_rows(a, b, scores) == [0]
    with pytest.raises(AssertionError, match="rows \\[0\\]"):
        assert_same_selection(a, b, scores)


def test_different_sizes_and_padding():
    scores = torch.tensor([[2.0, 2.0, -float("inf")], [1.0, 0.0, 0.0]])
    assert tie_mismatch_rows(torch.tensor([[0, 1, -1], [0, -1, -1]]),
                             torch.tensor([[1, 0, -1], [0, 1, -1]]), scores) == [1]
    assert tie_mismatch_rows(torch.tensor([[-1, 0]]), torch.tensor([[1, -1]]), scores[:1]) == []


def test_candidate_blocks_tie_aware():
    # 3 blocks of 2 positions; blocks 1 and 2 tie on score 4.0, block 0 is pinned (+inf)
    block_scores = torch.tensor([[float("inf"), 4.0, 4.0]])
    keep_01 = torch.tensor([[True, True, True, True, False, False]])
    keep_02 = torch.tensor([[True, True, False, False, True, True]])
    assert block_selection(keep_02, 2).tolist() == [[0, -1, 2]]
    assert_same_blocks(keep_01, keep_02, block_scores, 2)
    with pytest.raises(AssertionError):
        assert_same_blocks(keep_01, keep_02, torch.tensor([[float("inf"), 4.0, 3.0]]), 2)
