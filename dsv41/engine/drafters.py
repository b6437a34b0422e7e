"""Drafters: what proposes the tokens a verify step checks. A drafter only changes speed: the
tokens a request makes are the model's own whatever it proposes (``ops.verify``)."""
from __future__ import annotations

from typing import Callable

NGRAM, DSPARK, ORACLE = "ngram", "dspark", "oracle"
DRAFTERS = (NGRAM, DSPARK)        # what --speculative offers (the oracle is the tests')


class Drafter:
    """Proposes tokens for a batch of jobs; ``propose`` one job's (a drafter that also gives the
    distribution its drafts were drawn from overrides ``propose_batch``)."""
    reads_states = False      # drafts from the model's states of the last window rows (DSpark): a
    #                           request after a cached prefix feeds at least a window of rows


    def propose(self, job, room: int) -> list[int]:
        raise NotImplementedError

    def observe(self, phase: str, jobs, out):
        """What a step made (a drafter fed by the model's own states reads it here); jobs: one per
        request of the step, None for one that is not of this phase (a step that mixes both)."""

    def forget(self, job):
        """The job left the engine (finished or preempted)."""

    def propose_batch(self, jobs, rooms: list[int]) -> tuple[list[list[int]], list | None]:
        """(drafts per job, their distributions [k, V] per job or None: drafts without one)."""
        return [self.propose(j, r) if r > 0 else [] for j, r in zip(jobs, rooms)], None


# A proposal compares each suffix length up to max_n at every earlier position of the history: its cost
# grows with max_n squared times the history (--ngram-max 10^9: 17 s per proposal on 4,096 tokens).
# vLLM's prompt lookup uses up to 5; a longer suffix rarely recurs.
MAX_NGRAM = 32


class NgramDrafter(Drafter):
    """Prompt lookup, as vLLM's ``ngram`` method: find the latest earlier occurrence of the
    request's last n tokens (the longest n from max_n down to min_n that occurs) and propose the
    tokens that followed it there."""

    def __init__(self, k: int, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n <= MAX_NGRAM:
            raise ValueError(f"ngram: need 1 <= ngram_min <= ngram_max <= {MAX_NGRAM}, got {min_n} and {max_n}")
        if k < 1:
            raise ValueError(f"draft_tokens: must be >= 1, got {k}")
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, job, room: int) -> list[int]:
        history = job.prompt + job.made
        k = min(self.k, room)
        for n in range(min(self.max_n, len(history) - 1), self.min_n - 1, -1):
            tail = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):
                if history[start:start + n] == tail:
                    return history[start + n:start + n + k]
        return []


class OracleDrafter(Drafter):
    """Proposals supplied by the caller: ``propose(job, room)`` asks ``fn(job, room)`` (the tests
    force accept-all, accept-none and any prefix with it)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def propose(self, job, room: int) -> list[int]:
        return list(self.fn(job, room))[:room]
