"""DSpark's window rings (``model.dspark.DSparkWindow``): what a verify loop relies on to keep
rejected positions out (a new window per publication, positions published one step at a time
giving the rings a whole span gives) and the refusals, one line naming the argument."""
import pytest
import torch

from dsv41.config import TINY
from dsv41.model.dspark import DSpark, DSparkWindow
from dsv41.ops.rope import PLAIN, precompute_rope_tables
from dsv41.weights import decode_checkpoint, init_checkpoint

W, S, HD = TINY.sliding_window, TINY.n_mtp_layers, TINY.head_dim


def _rows(n, seed=0):
    return torch.randn(S, n, HD, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


def _rings(window):
    return [window.keys(s) for s in range(S)]


def test_publishing_step_by_step_equals_publishing_the_span_and_leaves_the_old_window_alone():
    rows = _rows(40)
    whole = DSparkWindow(TINY).published(rows, torch.arange(40))
    w = DSparkWindow(TINY).published(rows[:, :9], torch.arange(9))
    before = [r.clone() for r, _ in _rings(w)]
    nxt = w.published(rows[:, 9:12], torch.arange(9, 12))
    assert [r for r, _ in _rings(w)] and all(torch.equal(a, b) for a, (b, _) in zip(before, _rings(w)))
    assert w.length == 9 and nxt.length == 12
    for a in range(12, 40, 5):    # accepted prefixes of several lengths, a step at a time
        nxt = nxt.published(rows[:, a:min(a + 5, 40)], torch.arange(a, min(a + 5, 40)))
    for (a, fa), (b, fb) in zip(_rings(nxt), _rings(whole)):
        assert fa == fb == W and torch.equal(a, b)
    # ring slot p % window holds position p's FP8-rounded row (error below one E4M3 step of its block)
    ring, _ = whole.keys(1)
    for p in range(40 - W, 40):
        assert torch.allclose(ring[p % W], rows[1, p], rtol=2 ** -3, atol=1e-2)


def test_a_partly_filled_window_lists_only_its_positions():
    w = DSparkWindow(TINY).published(_rows(5), torch.arange(5))
    assert [f for _, f in _rings(w)] == [5] * S


@pytest.mark.parametrize("rows, positions, message", [
    (_rows(3), torch.tensor([0, 2, 3]), "positions: must be consecutive"),
    (_rows(2), torch.arange(12, 14), "positions: must continue the window (next position 10)"),
    (_rows(2), torch.arange(3, 5), "positions: must reach the window's end (next position 10)"),
    (_rows(2)[:, :1], torch.arange(10, 12), "rows: must be [3, 2, 64]"),
])
def test_bad_publications_are_refused_in_one_line(rows, positions, message):
    w = DSparkWindow(TINY).published(_rows(10), torch.arange(10))
    with pytest.raises(ValueError) as e:
        w.published(rows, positions)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_drafting_needs_a_seeded_window_and_a_token_per_window():
    model = DSpark(TINY, decode_checkpoint(TINY, init_checkpoint(TINY, 0)))
    tables = {PLAIN: precompute_rope_tables(TINY, 64, PLAIN)}
    with pytest.raises(ValueError, match="windows: each must be seeded"):
        model.draft(torch.tensor([3]), [DSparkWindow(TINY)], tables)
    w = DSparkWindow(TINY).published(_rows(4), torch.arange(4))
    with pytest.raises(ValueError, match=r"last_tokens: must hold one token per window \(1\), got 2"):
        model.draft(torch.tensor([3, 4]), [w], tables)
    with pytest.raises(ValueError, match=r"taps: must hold every DSpark target layer \[37, 38, 39\], missing \[38\]"):
        model.seed({37: torch.zeros(1, 64), 39: torch.zeros(1, 64)}, torch.tensor([4]), tables)
