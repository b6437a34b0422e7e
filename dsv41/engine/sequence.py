"""The cache side of a request while it holds blocks: its token history (append-only), how far its
caches reach, its pages, its DP group, its sampling state (with structured output, its grammar's
matcher, ``engine.grammar``) and the DSpark block its last step drafted. It lives in its DP group's
request table under the request's own id (``engine.request``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from dsv41.ops.sampling import RowDraw, SamplingParams

GREEDY = SamplingParams()


@dataclass
class Sequence:
    rid: int
    tokens: list[int]                       # every token fed and published so far (Engram hashing, penalties)
    kv_len: int = 0                         # positions its caches hold
    window_pages: dict[int, int] = field(default_factory=dict)      # logical page -> physical block
    compressed_pages: dict[int, list[int]] = field(default_factory=dict)  # ratio -> physical blocks
    state_block: int = -1
    sampling: SamplingParams = GREEDY
    seed: int = 0                           # the request's generator: draw n is seeded by (seed, n)
    drawn: int = 0                          # draws made so far (temperature > 0 tokens draw once each)
    prompt_len: int = 0                     # tokens of its prompt (the rest were generated)
    matcher: object = None                  # its grammar's state (made from sampling.grammar)
    group: int = 0                          # the DP group whose table and caches hold it
    # started at a drawn context: no history to recompute from, nothing to cache (not host state a
    # prefill of the same history would differ in)
    from_context: bool = field(default=False, compare=False)
    hashes: list = field(default_factory=list, compare=False)  # chain hashes of its completed prefix-cache spans
    cache_root: bytes = b""                 # their root: its cache salt's (prefix_cache.root), b"" unsalted
    drafted: tuple | None = field(default=None, compare=False)  # DSpark's block of its last step: (tokens, confidences, probs)

    def __post_init__(self):
        if self.matcher is None and self.sampling.grammar is not None:
            self.matcher = self.sampling.grammar.matcher()

    def __getstate__(self):
        """A step's new sequences travel with it to the cards, which read no grammar: the matcher
        stays on the host (as ``SamplingParams.grammar`` does)."""
        return {**self.__dict__, "matcher": None, "drafted": None}

    def settle(self, state: Sequence):
        """Take the sampling state ``state`` holds (settings, seed, draws made, prompt length): after
        a chunk of a prompt or a recompute, or a replay, whose tokens draw nothing."""
        self.sampling, self.seed, self.drawn, self.prompt_len = state.sampling, state.seed, state.drawn, state.prompt_len

    def row_draws(self, fed: list[int], drawing: int) -> list[RowDraw]:
        """The draws of a step that feeds ``fed`` and makes a token at its last ``drawing`` rows:
        row j's draw has index drawn + j and reads the history up to and including its own row
        (the penalties see the proposals before it, which equal the real tokens whenever the row's
        token is kept) and counts the tokens generated before it (min_tokens); with a grammar, it
        carries the mask of the tokens the grammar allows after that history (the drafts before it
        included)."""
        p = self.sampling
        penalties = p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0
        first = len(fed) - drawing
        masks = [None] * drawing
        if self.matcher is not None:
            masks = self.matcher.masks((self.tokens + fed[:first + 1])[self.prompt_len:], fed[first + 1:])
        draws = []
        for j in range(drawing):
            out = prompt = ()
            if penalties:     # only then is the history read (and copied)
                seen = self.tokens + fed[:first + j + 1]
                out = tuple(seen[self.prompt_len:])
                prompt = tuple(seen[:self.prompt_len]) if p.repetition_penalty != 1.0 else ()
            generated = len(self.tokens) + first + j + 1 - self.prompt_len
            draws.append(RowDraw(p, self.seed, self.drawn + j, out, prompt, generated, masks[j]))
        return draws

    def publish(self, fed: list[int], kept: int, emitted: int):
        """After a step: the first ``kept`` fed rows are part of the history now, and ``emitted``
        tokens were drawn from the generator."""
        self.tokens.extend(fed[:kept])
        self.kv_len += kept
        self.drawn += emitted if not self.sampling.greedy else 0
