"""The optional, approximate SWA bounded-replay prefill: exact up to the window, then approximate."""
import pytest
import torch

from dsv41.config import TINY
from dsv41.engine.reference import ReferenceEngine
from dsv41.model.options import Options


def _prompts(*lens):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in lens]


def _models():
    return (ReferenceEngine(TINY, seed=0, max_batch=2, max_context=64),
            ReferenceEngine(TINY, seed=0, max_batch=2, max_context=64, options=Options(prefill_mode="bounded_replay")))


def test_equal_to_full_forward_within_the_window():
    full, replay = _models()
    prompts = _prompts(TINY.sliding_window, 5)
    assert torch.equal(full.prefill(prompts).logits, replay.prefill(prompts).logits)


def test_longer_prompts_run_decoder_layers_on_replay_rows_only_and_decode_continues():
    full, replay = _models()
    prompts = _prompts(40, 23)
    a, b = full.prefill(prompts).logits, replay.prefill(prompts).logits
    assert a.shape == b.shape and torch.isfinite(b).all()
    assert not torch.equal(a, b)  # truncated windows on early replay rows change the result
    # layer 20 keeps full windows and publishes every row: its caches equal the full forward's
    for name in ("compressed.20", "index.20", "window.20", "window.2"):
        for x, y in zip(full.caches.committed[name], replay.caches.committed[name]):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 else torch.equal(x, y)
    nxt = replay.decode(torch.argmax(b, -1).tolist()).logits
    assert nxt.shape == a.shape and torch.isfinite(nxt).all()


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="prefill_mode"):
        Options(prefill_mode="ced")
