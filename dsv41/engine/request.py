"""A request: one record with one id from arrival to end.

The id is drawn once, process-wide (``new_id``), when the request arrives; the engine's request
tables hold its cache state (its ``Sequence``: pages, history fed, sampling state, DSpark's
drafts) under the same id while it holds blocks, and a request that is preempted or recovered
comes back under it. The scheduler keeps the rest here: what it asked for, what it made, what it
still has to feed and the sampling state it holds while it holds no blocks.
"""
from __future__ import annotations

import itertools
from dataclasses import KW_ONLY, dataclass, field

import torch

from dsv41.engine.sequence import Sequence
from dsv41.ops.sampling import SamplingParams
from dsv41.ops.stopping import Stops

new_id = itertools.count().__next__      # request ids, process-wide: engines and schedulers share them


@dataclass(eq=False)
class Request:
    """One request's generation. Subclasses route what ``emit`` hears (the server's queues)."""
    prompt: list[int]
    params: SamplingParams
    stops: Stops
    _: KW_ONLY
    id: int = field(default_factory=new_id)
    made: list[int] = field(default_factory=list)      # every token made for it, a stop token included
    running: bool = False         # it holds blocks in the engine (admitted, not preempted or ended)
    last: int | None = None       # its newest token, fed at its next decode step
    feed: list[int] = field(default_factory=list)   # tokens still to feed before it decodes (prompt chunks)
    prefix: list[int] = field(default_factory=list)  # the cached prefix its first step reuses (prefix caching)
    cached: int = 0               # prompt tokens its first admission found cached (the answer's usage)
    cache_root: bytes = b""       # its prefix-cache root: its cache salt's (prefix_cache.root), b"" unsalted
    saved: Sequence | None = None  # the sampling state it holds while preempted or fed in chunks
    cancelled: bool = False
    finished: bool = False
    preemptions: int = 0
    final_logits: torch.Tensor | None = None   # the logits of its last token (Scheduler keep_logits)

    @property
    def history(self) -> list[int]:
        return self.prompt + self.made

    def emit(self, kind: str, **fields):
        """A token (token, text, logprob, kept), the end (finish) or an error (error)."""


def requests_for(prompts, sampling, max_new_tokens, decode_text, eos_id=None, cls=Request) -> list[Request]:
    """A request per prompt; sampling: one SamplingParams for all, or one per prompt (None: greedy)."""
    if sampling is None or isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    out = []
    for prompt, p in zip(prompts, sampling):
        p = p or SamplingParams()
        out.append(cls(list(prompt), p, Stops(p, max_new_tokens, eos_id, decode_text)))
    return out
