"""A step's cache writes, logged per row so that a step can publish a prefix of its rows.

Writes land in place (readers later in the step see them: a layer's attention reads the window
rows its own step published) and each is logged with the rows it replaced and the token row that
made it. ``commit`` keeps the writes of the rows it is told to keep and puts every other written
row back as it was; ``abort`` puts back all of them. Only the rows a step writes are ever copied,
never a whole cache: a speculative step's rejected rows cost their own bytes to undo.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Write:
    name: str
    slots: torch.Tensor            # i64 [N] cache rows written (a slot may repeat: the last write wins)
    old: tuple                     # the rows' bytes before the write, one tensor per part of the cache
    new: tuple                     # what was written
    rows: torch.Tensor             # i64 [N] the step's token row that made each write


def _last_writer(slots: torch.Tensor) -> torch.Tensor:
    """Indices of the last occurrence of each distinct slot, in order (index_put with repeated
    indices leaves the winner unspecified)."""
    n = slots.shape[0]
    uniq, inverse = torch.unique(slots, return_inverse=True)
    if uniq.shape[0] == n:
        return torch.arange(n)
    last = torch.full((uniq.shape[0],), -1, dtype=torch.long).scatter_reduce(0, inverse, torch.arange(n), "amax")
    return last.sort().values


class StagedTensors:
    def __init__(self, tensors: dict[str, tuple[torch.Tensor, ...]]):
        self.committed = tensors       # the live tensors (between steps: exactly what was published)
        self.log: list[Write] = []     # this step's writes, oldest first
        self._lock = threading.Lock()
        self._undo: tuple[int | None, list[Write]] = (None, [])   # (step, its committed writes)

    @property
    def pending(self) -> int:
        """Writes of the running step not yet committed or aborted."""
        return len(self.log)

    def read(self, name: str) -> tuple[torch.Tensor, ...]:
        return self.committed[name]

    def put(self, name: str, slots: torch.Tensor, values: tuple, rows: torch.Tensor):
        """Write values (one tensor per part of the cache, [N, ...]) at slots, made by token rows."""
        if not slots.numel():
            return
        slots = slots.long()
        parts = self.committed[name]
        if int(slots.min()) < 0 or int(slots.max()) >= parts[0].shape[0]:
            raise ValueError(f"slots: must be in [0, {parts[0].shape[0] - 1}] for cache {name}, got "
                             f"[{int(slots.min())}, {int(slots.max())}]")
        last = _last_writer(slots)
        with self._lock:
            old = tuple(t[slots] for t in parts)
            for t, v in zip(parts, values):
                t[slots[last]] = v[last].to(t.dtype)
            self.log.append(Write(name, slots, old, tuple(values), rows.long()))

    def _restore(self, writes: list[Write]):
        for w in reversed(writes):
            for t, o in zip(self.committed[w.name], w.old):
                t[w.slots] = o           # repeated slots hold the same old bytes

    def commit(self, step: int | None = None, keep_rows: torch.Tensor | None = None):
        """Publish the step. keep_rows (bool [T] over the step's token rows; None keeps all): the
        rows whose writes stay; every other row's writes are undone, in the order they were made.
        ``abort(step)`` can still undo the whole commit until the next step writes."""
        with self._lock:
            log, self.log = self.log, []
            if keep_rows is not None and not bool(keep_rows.all()):
                self._restore(log)
                for w in log:
                    keep = keep_rows[w.rows]
                    if bool(keep.any()):
                        slots = w.slots[keep]
                        last = _last_writer(slots)
                        for t, v in zip(self.committed[w.name], w.new):
                            t[slots[last]] = v[keep][last].to(t.dtype)
            self._undo = (step, log)

    def abort(self, step: int | None = None):
        """Undo the running step's writes, and this step's commit if it already happened here."""
        with self._lock:
            self._restore(self.log)
            self.log = []
            undo_step, committed = self._undo
            if step is not None and undo_step == step:
                self._restore(committed)
                self._undo = (None, [])
