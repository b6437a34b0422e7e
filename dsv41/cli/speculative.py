"""``--speculative``, ``--draft-tokens``, ``--ngram-min`` and ``--ngram-max`` of ``run`` and ``serve``:
their flags, their rows of the command line's rules (``dsv41.cli.args``) and the drafter they make."""
from __future__ import annotations

from dsv41.cli.modes import PLAN, RUN
from dsv41.engine.drafters import DRAFTERS, DSPARK, MAX_NGRAM, NGRAM, NgramDrafter

DEFAULT_DRAFTS = 5           # the seed's decode ABI: 1 target row + 5 draft rows per sequence
DEFAULT_NGRAM = (1, 3)


def add_arguments(g):
    g.add_argument("--speculative", choices=DRAFTERS, default=None,
                   help="decode steps verify drafted tokens and keep the accepted prefix (the same tokens as "
                        "without; fewer steps when drafts are accepted). ngram: prompt lookup in the request's "
                        "own tokens; dspark: the model's own DSpark stages (mtp.*), fed by the verify step")
    g.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help=f"with --speculative: tokens proposed per request and step (default: {DEFAULT_DRAFTS}); "
                        "--plan: draft rows per request of the decode step (0: plain decode; default: the config's)")
    g.add_argument("--confidence-threshold", type=float, default=None, metavar="C",
                   help="with --speculative dspark: a block ends at the first draft whose confidence is below C "
                        "(default: off)")
    g.add_argument("--ngram-min", type=int, default=DEFAULT_NGRAM[0], metavar="N",
                   help="with --speculative ngram: the shortest suffix matched (default: %(default)s)")
    g.add_argument("--ngram-max", type=int, default=DEFAULT_NGRAM[1], metavar="N",
                   help="with --speculative ngram: the longest suffix matched (default: %(default)s)")


def _speculating(a) -> bool:
    return a.speculative is not None


NEEDS = ("needs --speculative", _speculating)
NEEDS_NGRAM = ("needs --speculative ngram", lambda a: a.speculative == NGRAM)
APPLIES = {
    "--speculative": (RUN, ("needs --graph decode (a prefill makes one token per request)",
                            lambda a: a.graph == "decode")),
    "--draft-tokens": (RUN | {PLAN}, ("needs --speculative (or --plan)", lambda a: _speculating(a) or a.plan)),
    "--ngram-min": (RUN, NEEDS_NGRAM),
    "--confidence-threshold": (RUN, ("needs --speculative dspark", lambda a: a.speculative == DSPARK)),
    "--ngram-max": (RUN, NEEDS_NGRAM),
}


def _draft_tokens(a, cfg):
    if a.draft_tokens is None:
        return None
    top, low = a.capacity.max_drafts, 0 if a.plan else 1
    if not low <= a.draft_tokens <= top:
        rows = a.capacity.decode_rows_per_request
        return (f"must be in [{low}, {top}] (a decode step holds {rows} rows per request on {cfg.name}), "
                f"got {a.draft_tokens}")


def _ngram_min(a, cfg):
    if not 1 <= a.ngram_min <= MAX_NGRAM:
        return f"must be in [1, {MAX_NGRAM}], got {a.ngram_min}"


def _ngram_max(a, cfg):
    if not a.ngram_min <= a.ngram_max <= MAX_NGRAM:
        return f"must be in [--ngram-min {a.ngram_min}, {MAX_NGRAM}], got {a.ngram_max}"


def _speculative(a, cfg):
    if a.speculative != DSPARK:
        return None
    if not cfg.dspark:
        return f"dspark needs a model with DSpark stages; {cfg.name} has none (n_mtp_layers 0)"
    if getattr(a, "context", None):
        return "dspark does not go with --context: a drawn history has no taps to seed the drafter with"


def _confidence(a, cfg):
    if a.confidence_threshold is not None and not 0.0 <= a.confidence_threshold <= 1.0:
        return f"must be in [0, 1], got {a.confidence_threshold:g}"


CHECKS = [("--speculative", _speculative), ("--draft-tokens", _draft_tokens), ("--ngram-min", _ngram_min),
          ("--ngram-max", _ngram_max), ("--confidence-threshold", _confidence)]


def drafter(a, engine):
    """The drafter the flags ask for (None: plain decode steps)."""
    if a.speculative == NGRAM:
        return NgramDrafter(DEFAULT_DRAFTS if a.draft_tokens is None else a.draft_tokens, a.ngram_min, a.ngram_max)
    if a.speculative == DSPARK:
        from dsv41.engine.dspark import dspark_drafter
        return dspark_drafter(engine, a.draft_tokens, a.confidence_threshold)
    return None
