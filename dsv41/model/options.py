"""Named alternatives for points the sources leave open (defaults follow the official code)."""
from __future__ import annotations

from dataclasses import dataclass

FULL_PREFILL, BOUNDED_REPLAY = "full", "bounded_replay"


@dataclass(frozen=True)
class Options:
    fp4_index_query: bool = True   # False: the pypto C2A kernel's unquantized index query
    # "full": the official forward, every layer on every row with full causal windows.
    # "bounded_replay": the tech report's approximate SWA bounded replay for fresh prompts: layers up
    # to the candidate source (20) run on all rows (20 keeps full windows and publishes its
    # compressed/index caches for every row, the vLLM rule); layers 21-39 run only on each
    # request's last min(len, window) rows with windows cut to those rows. Exact for prompts no
    # longer than the window; approximate beyond. Only the reference engine implements it.
    prefill_mode: str = FULL_PREFILL

    def __post_init__(self):
        if self.prefill_mode not in (FULL_PREFILL, BOUNDED_REPLAY):
            raise ValueError(f"prefill_mode: must be {FULL_PREFILL!r} or {BOUNDED_REPLAY!r}, got {self.prefill_mode!r}")
