"""Tie-aware selection asserts for golden comparisons (see dsv41/kernels/ties.py)."""
import torch

from dsv41.kernels.ties import block_selection, tie_mismatch_rows


def assert_same_selection(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, what: str = "selection"):
    """got/want [T, k] ids (-1 = none); equal up to swaps among equal `scores` [T, n]."""
    assert got.shape[0] == want.shape[0], (got.shape, want.shape)
    bad = tie_mismatch_rows(got, want, scores)
    assert not bad, f"{what}: rows {bad[:8]} differ beyond ties: {got[bad[0]].tolist()} vs {want[bad[0]].tolist()}"


def assert_same_blocks(got_mask: torch.Tensor, want_mask: torch.Tensor, block_scores: torch.Tensor, block: int,
                       what: str = "candidate blocks"):
    """Candidate masks [T, P] whose kept blocks agree up to swaps among equal block scores [T, nb]."""
    assert got_mask.shape == want_mask.shape, (got_mask.shape, want_mask.shape)
    assert_same_selection(block_selection(got_mask, block), block_selection(want_mask, block), block_scores, what)
