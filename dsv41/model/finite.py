"""The non-finite guard: a step whose residual stream or logits hold NaN/Inf stops there.

A zero or negative eps, a NaN theta or an overflowing weight (finite in the file, Inf once
multiplied) turns every later value into NaN/Inf, and a greedy argmax over NaN logits still
returns a token (id 0). So the stream is checked where each layer's sites hand it on (one
``isfinite().all()`` reduction per site) and the logits where they are made; the first place it
fails raises ``NonFiniteError`` and the engine aborts the step (nothing is committed or served).
A logits row whose values are all equal (a zero head or final norm, weights too small to tell
tokens apart) is as useless, and its argmax as arbitrary: it raises ``ConstantLogitsError``, a
``NonFiniteError`` so every place that stops a step for one stops it for the other.
"""
from __future__ import annotations

import torch

ATTN, FFN, LOGITS = "attn", "ffn", "logits"   # where: a layer's attention or FFN site, or the head
_WHERE = {ATTN: "attention site", FFN: "FFN site"}


class NonFiniteError(RuntimeError):
    """NaN/Inf in a step. Raised where it is found with (layer, site, counts) and, for a DSpark stage,
    the backbone's layer count (the stages' official layer ids follow the backbone's: 40-42 on
    FLASH); the engine adds the step, its phase and the checkpoint tensors that feed the site (``at``). Pickles by its args, so
    it crosses from a dask worker unchanged."""

    def __init__(self, layer: int | None, site: str, counts: str, step: int | None = None,
                 phase: str | None = None, tensors: tuple[str, ...] = (), backbone: int | None = None):
        super().__init__(layer, site, counts, step, phase, tuple(tensors), backbone)
        self.layer, self.site, self.counts = layer, site, counts
        self.step, self.phase, self.tensors, self.backbone = step, phase, tuple(tensors), backbone

    def at(self, step: int, phase: str, tensors) -> "NonFiniteError":
        return type(self)(self.layer, self.site, self.counts, step, phase, tuple(tensors), self.backbone)

    def _block(self) -> str:
        if self.backbone is not None and self.layer >= self.backbone:
            return f"DSpark stage {self.layer - self.backbone} (layer id {self.layer})"
        return f"layer {self.layer}"

    def __str__(self) -> str:
        where = "the logits" if self.site == LOGITS else \
            f"the residual stream after {self._block()}'s {_WHERE.get(self.site, self.site)}"
        step = f"step {self.step} ({self.phase})" if self.step is not None else "a step"
        fed = f"; the tensors that feed it: {', '.join(self.tensors)}" if self.tensors else ""
        return f"{step}: non-finite values first in {where} ({self.counts}); nothing of this step is kept{fed}"


class ConstantLogitsError(NonFiniteError):
    """Every value of a logits row equal: no token is more likely than another."""

    def __str__(self) -> str:
        step = f"step {self.step} ({self.phase})" if self.step is not None else "a step"
        fed = f"; the tensors that feed it: {', '.join(self.tensors)}" if self.tensors else ""
        return f"{step}: the logits cannot tell tokens apart ({self.counts}); nothing of this step is kept{fed}"


def ensure_finite(x: torch.Tensor, layer: int | None, site: str, backbone: int | None = None) -> torch.Tensor:
    """x, or NonFiniteError naming where it was found (at the logits: ConstantLogitsError for a row
    of equal values); ``backbone``: the backbone's layer count, so that a DSpark stage is named as one."""
    if not x.numel():
        return x
    # one pass for both checks: a NaN is every reduction's min and max, an Inf its max or min
    rows = x.reshape(-1, x.shape[-1]) if site == LOGITS else x.reshape(1, -1)
    lo, hi = torch.aminmax(rows, dim=-1)
    if not bool((torch.isfinite(lo) & torch.isfinite(hi)).all()):
        raise NonFiniteError(layer, site, f"{int(torch.isnan(x).sum())} NaN, {int(torch.isinf(x).sum())} Inf "
                                          f"of {x.numel()} values", backbone=backbone)
    if site == LOGITS and x.shape[-1] > 1:
        flat = lo == hi
        if bool(flat.any()):
            row = int(flat.nonzero()[0])
            raise ConstantLogitsError(layer, site, f"row {row}: all {rows.shape[1]} values equal "
                                                   f"{float(rows[row, 0]):g}; {int(flat.sum())} of "
                                                   f"{rows.shape[0]} rows so")
    return x
