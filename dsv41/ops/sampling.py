"""Drawing the next token from one row of logits: the golden definition of sampling.

Order, as vLLM applies it: the request's own edits of the row (``logit_bias`` added, and while
fewer than ``min_tokens`` tokens are out its stop ids and EOS masked), penalties on the logits
(repetition, then frequency, then presence), temperature, top-k, top-p, min-p, then one draw.
Temperature 0 is greedy: ``argmax`` of the (edited, penalised) logits, lowest id on ties; with no
edits and the penalties at their neutral values nothing touches the row, so greedy is exactly
``torch.argmax`` of the raw logits, bit for bit. The edits act on
the whole row the head gathers, so a request's tokens stay the same on every layout.

The draw takes one uniform number from a generator made from (request seed, index of the draw),
so a request replayed, resumed or moved to another executor draws the same tokens; the
probability arithmetic is FP64 so the token a uniform number selects does not hinge on FP32
rounding of the row.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0             # OpenAI's range for logit_bias values: [-100, 100]
_SEED_LIMIT = 2 ** 63


def _number(name: str, value, low: float, high: float, low_open=False, high_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, found {value!r}")
    if (value < low or (low_open and value == low)) or (value > high or (high_open and value == high)):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name}: expected a value in {interval}, found {value!r}")
    return float(value)


def _integer(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, found {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}: expected an integer {bound}, found {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings; construction checks every field against its range."""
    temperature: float = 0.0           # 0 = greedy
    top_p: float = 1.0                 # (0, 1]; 1 = off
    top_k: int = 0                     # 0 = off
    min_p: float = 0.0                 # [0, 1]; 0 = off
    seed: int | None = None            # None: the request's generator picks one
    presence_penalty: float = 0.0      # [-2, 2]
    frequency_penalty: float = 0.0     # [-2, 2]
    repetition_penalty: float = 1.0    # > 0; 1 = off
    logprobs: int = 0                  # top-n alternatives to report, [0, 20]
    logprob: bool = False              # report the drawn token's logprob (implied by logprobs > 0)
    stop_token_ids: tuple = ()
    stop: tuple = ()                   # stop strings
    max_tokens: int = 16
    logit_bias: tuple = ()             # ((token id, bias), ...), bias in [-100, 100], added to the row
    min_tokens: int = 0                # stop ids and EOS cannot be drawn before this many tokens
    ignore_eos: bool = False           # EOS neither ends the request nor is kept from being drawn
    include_stop_str_in_output: bool = False   # a stop string ends the text after itself, not before
    eos_token_id: int | None = None    # the tokenizer's EOS: a stop id unless ignore_eos
    grammar: object = None             # the rows' masks (``engine.grammar.Constraint``): the host's, see __getstate__

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("temperature", _number("temperature", self.temperature, 0.0, math.inf))
        set_("top_p", _number("top_p", self.top_p, 0.0, 1.0, low_open=True))
        _integer("top_k", self.top_k, 0)
        set_("min_p", _number("min_p", self.min_p, 0.0, 1.0))
        if self.seed is not None:
            _integer("seed", self.seed, 0, _SEED_LIMIT - 1)
        set_("presence_penalty", _number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_("frequency_penalty", _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        set_("repetition_penalty", _number("repetition_penalty", self.repetition_penalty,
                                           0.0, math.inf, low_open=True))
        _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.logprob, bool):
            raise ValueError(f"logprob: expected true or false, found {self.logprob!r}")
        set_("logprob", self.logprob or self.logprobs > 0)
        _integer("max_tokens", self.max_tokens, 1)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids: expected a list of token ids, found {ids!r}")
        set_("stop_token_ids", tuple(_integer(f"stop_token_ids[{i}]", t, 0)
                                     for i, t in enumerate(ids)))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop: expected a string or a list of strings, found {stop!r}")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}]: expected a non-empty string, found {s!r}")
        set_("stop", tuple(stop))
        bias = list(self.logit_bias.items()) if isinstance(self.logit_bias, dict) else self.logit_bias
        if not (isinstance(bias, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in bias)):
            raise ValueError(f"logit_bias: expected a map of token id to bias, found {self.logit_bias!r}")
        set_("logit_bias", tuple(sorted((_integer(f"logit_bias[{t!r}]", t, 0),
                                         _number(f"logit_bias[{t!r}]", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS))
                                        for t, b in bias)))
        _integer("min_tokens", self.min_tokens, 0, self.max_tokens)
        for flag in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag}: expected true or false, found {getattr(self, flag)!r}")
        if self.eos_token_id is not None:
            _integer("eos_token_id", self.eos_token_id, 0)

    def __getstate__(self):
        """A grammar's matcher is host state (``engine.sequence``): what reaches a card is each
        row's mask (``RowDraw.allowed``), so the settings cross to a card without it."""
        return {**self.__dict__, "grammar": None}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_ids(self) -> frozenset:
        """The ids that end the request: stop_token_ids, and EOS unless ignore_eos."""
        eos = {self.eos_token_id} if self.eos_token_id is not None and not self.ignore_eos else set()
        return frozenset(self.stop_token_ids) | eos

    def edits_row(self, generated: int) -> bool:
        """Whether the row is edited before the draw that follows ``generated`` tokens."""
        return bool(self.logit_bias) or (generated < self.min_tokens and bool(self.stop_ids))


class RequestGenerator:
    """A request's source of randomness: draw ``n`` uses a torch.Generator seeded from
    (seed, n) alone, so the tokens depend on the seed and the draw's index, never on what else
    shared the card or which executor ran the step. ``drawn`` is what to carry when the request
    moves or is replayed."""

    def __init__(self, seed: int | None = None, drawn: int = 0):
        self.seed = int.from_bytes(os.urandom(8), "little") % _SEED_LIMIT if seed is None \
            else _integer("seed", seed, 0, _SEED_LIMIT - 1)
        self.drawn = _integer("drawn", drawn, 0)

    @staticmethod
    def draw_seed(seed: int, index: int) -> int:
        digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % _SEED_LIMIT

    def next(self) -> torch.Generator:
        g = torch.Generator(device="cpu")
        g.manual_seed(self.draw_seed(self.seed, self.drawn))
        self.drawn += 1
        return g


def allowed_tokens(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [vocab] from a packed token bitmask (int32 words, token t is bit t % 32 of word t // 32,
    the layout grammar libraries fill)."""
    bits = (mask.to(torch.int32).unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


def apply_edits(logits: torch.Tensor, params: SamplingParams, generated: int,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The request's own edits of the row (OpenAI's logit_bias added; vLLM's min_tokens: the stop
    ids and EOS at -inf while fewer than min_tokens tokens are out; a grammar's mask ``allowed``:
    every token it does not allow at -inf). Returns the row itself when there is nothing to edit,
    so a plain greedy row stays bit for bit the argmax of the logits."""
    if not params.edits_row(generated) and allowed is None:
        return logits
    x = logits.to(torch.float64).clone()
    vocab = x.numel()
    for token, bias in params.logit_bias:
        if token < vocab:        # the server checks ids against the vocabulary; a direct caller may not
            x[token] += bias
    keep = None if allowed is None else allowed_tokens(allowed, vocab)
    if generated < params.min_tokens:
        masked = [t for t in params.stop_ids if t < vocab]
        # a complete grammar allows only a stop: it ends the answer (nothing else could be drawn)
        if keep is None or bool(keep.clone().index_fill_(0, torch.tensor(masked, dtype=torch.long), False).any()):
            x[masked] = -math.inf
    if keep is not None:
        x.masked_fill_(~keep, -math.inf)
    return x


def processed(logits: torch.Tensor, params: SamplingParams, output_ids=(), prompt_ids=(),
              generated: int = 0, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """A row as a draw sees it: the request's edits, then the penalties (the plain draw and the
    speculative-sampling rule of ``ops/verify.py`` both take it from here)."""
    return apply_penalties(apply_edits(logits, params, generated, allowed), params, output_ids, prompt_ids)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, output_ids,
                    prompt_ids=()) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt and output tokens (positive logits divided,
    others multiplied), then frequency (per occurrence) and presence (once) over output tokens.
    Returns the row itself when every penalty is neutral."""
    rep, freq, pres = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    if rep == 1.0 and freq == 0.0 and pres == 0.0:
        return logits
    x = logits.to(torch.float64).clone()
    out = torch.as_tensor(list(output_ids), dtype=torch.long, device=x.device)
    if rep != 1.0:
        seen = torch.unique(torch.cat([out, torch.as_tensor(list(prompt_ids), dtype=torch.long,
                                                              device=x.device)]))
        v = x[seen]
        x[seen] = torch.where(v > 0, v / rep, v * rep)
    if out.numel() and (freq != 0.0 or pres != 0.0):
        counts = torch.bincount(out, minlength=x.numel()).to(torch.float64)
        x -= freq * counts + pres * (counts > 0).to(torch.float64)
    return x


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """FP64 probabilities after temperature, top-k, top-p and min-p (zeros outside the kept
    set, renormalised). Top-k keeps exactly k tokens and top-p the most probable tokens until
    their mass reaches top_p, both taking the lower id first among equal values (as argmax does,
    so top_k=1 is greedy)."""
    x = logits.to(torch.float64) / params.temperature
    if 0 < params.top_k < x.numel():
        keep = torch.sort(x, descending=True, stable=True).indices[:params.top_k]
        x = torch.full_like(x, -math.inf).index_copy_(0, keep, x[keep])
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        order = torch.sort(probs, descending=True, stable=True).indices
        before = torch.cumsum(probs[order], 0) - probs[order]   # mass strictly above each token
        drop = before >= params.top_p
        drop[0] = False
        probs = probs.clone()
        probs[order[drop]] = 0.0
        probs /= probs.sum()
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs /= probs.sum()
    return probs


def draw_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from FP64 probabilities with one uniform draw: the inverse CDF (u < 1: never past
    the end)."""
    cdf = torch.cumsum(probs, 0)
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    target = torch.tensor([u * cdf[-1].item()], dtype=torch.float64, device=cdf.device)
    return int(torch.searchsorted(cdf, target, right=True))


def sample(logits: torch.Tensor, params: SamplingParams, generator: RequestGenerator | None,
           history_token_ids=(), prompt_token_ids=(), generated: int = 0, allowed: torch.Tensor | None = None):
    """One token from one row of logits.

    ``history_token_ids``: the tokens generated so far (frequency/presence/repetition);
    ``prompt_token_ids``: the prompt (repetition only); ``generated``: how many tokens the request
    has already produced (min_tokens); ``allowed``: the grammar's packed mask (``allowed_tokens``). Returns (token id, its logprob,
    top alternatives as [(id, logprob)] best first, lower id first among equals); logprobs are those of the raw row, as
    vLLM reports them by default. Greedy needs no generator and draws nothing from it."""
    if logits.dim() != 1 or not logits.is_floating_point():
        raise ValueError(f"logits: expected one floating-point row, found "
                         f"{tuple(logits.shape)} {logits.dtype}")
    x = processed(logits, params, history_token_ids, prompt_token_ids, generated, allowed)
    if params.greedy:
        token = int(torch.argmax(x))
    else:
        if generator is None:
            raise ValueError("generator: a temperature > 0 draw needs the request's generator")
        token = draw_from(filtered_probs(x, params), generator.next())
    raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
    top = []
    if params.logprobs:
        ids = torch.sort(raw, descending=True, stable=True).indices[:params.logprobs]
        top = [(int(i), float(raw[i])) for i in ids]
    return token, float(raw[token]), top


@dataclass(frozen=True)
class RowDraw:
    """What drawing one row's token needs besides its logits: the request's settings, its seed and
    the index of this draw, (for the penalties) its generated and prompt token ids, how many
    tokens it has produced (min_tokens), and the tokens its grammar allows at this row (the
    request's structured output: a packed int32 bitmask, ``allowed_tokens``; None: every token)."""
    params: SamplingParams
    seed: int
    draw: int
    output_ids: tuple = ()
    prompt_ids: tuple = ()
    generated: int = 0
    allowed: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Greedy with neutral penalties, no edits of the row and no logprobs: exactly the row's argmax."""
        p = self.params
        return p.greedy and not p.logprob and p.repetition_penalty == 1.0 \
            and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 and not p.edits_row(self.generated) \
            and self.allowed is None


def sample_rows(logits: torch.Tensor, rows: list[RowDraw] | None):
    """Each row's token ([B] i64) and, when any row asks for logprobs, a list of (logprob, top)
    per row (None for rows that did not ask; see ``sample``). ``rows`` None, or every row plain:
    one batched argmax, bit for bit the greedy path."""
    if rows is None or all(r.plain for r in rows):
        return torch.argmax(logits, dim=-1), None
    if len(rows) != logits.shape[0]:
        raise ValueError(f"rows: expected one RowDraw per logits row ({logits.shape[0]}), found {len(rows)}")
    ids, logprobs = [], []
    for row, r in zip(logits, rows):
        token, lp, top = sample(row, r.params, RequestGenerator(r.seed, r.draw), r.output_ids, r.prompt_ids,
                                r.generated, r.allowed)
        ids.append(token)
        logprobs.append((lp, top) if r.params.logprob else None)
    return torch.tensor(ids, dtype=torch.int64), (logprobs if any(x is not None for x in logprobs) else None)
