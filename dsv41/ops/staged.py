"""Copy-on-write tensor store: a step's cache writes are staged and applied all at once.

Readers see the staged copy once a step has written a tensor, so rows published earlier in the
step are visible; ``abort`` drops every staged write (and undoes a commit of the same step),
leaving the committed bytes as they were.
"""
from __future__ import annotations

import threading

import torch


class StagedTensors:
    def __init__(self, tensors: dict[str, tuple[torch.Tensor, ...]]):
        self.committed = tensors
        self.staged: dict[str, tuple[torch.Tensor, ...]] = {}
        self._lock = threading.Lock()
        self._undo: tuple[int | None, dict] = (None, {})   # (step, what its commit replaced)

    def read(self, name: str) -> tuple[torch.Tensor, ...]:
        return self.staged.get(name) or self.committed[name]

    def write(self, name: str) -> tuple[torch.Tensor, ...]:
        """The staged tensors of name, cloned from the committed ones on first write in the step."""
        with self._lock:
            if name not in self.staged:
                self.staged[name] = tuple(t.clone() for t in self.committed[name])
            return self.staged[name]

    def commit(self, step: int | None = None):
        """Apply the staged writes; remember what they replaced so ``abort(step)`` can undo them."""
        self._undo = (step, {name: self.committed[name] for name in self.staged})
        self.committed.update(self.staged)
        self.staged = {}

    def abort(self, step: int | None = None):
        """Drop staged writes, and undo this step's commit if it already happened on this store."""
        undo_step, previous = self._undo
        if step is not None and undo_step == step:
            self.committed.update(previous)
            self._undo = (None, {})
        self.staged = {}
