"""``--temperature``, ``--top-p``, ``--top-k``, ``--min-p``, ``--sample-seed`` and ``--stop`` of
``python -m dsv41.run``: their flags, their rows of the command line's rules (``dsv41.cli.args``)
and the run's ``SamplingParams``. The ranges are ``SamplingParams``' own, so the command line, the
server and the engine refuse the same values."""
from __future__ import annotations

from dsv41.cli.modes import RUN
from dsv41.ops.sampling import SamplingParams

FLAGS = {"--temperature": "temperature", "--top-p": "top_p", "--top-k": "top_k", "--min-p": "min_p",
         "--sample-seed": "seed", "--stop": "stop"}


def add_arguments(g):
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default) is greedy; above 0 each request draws its tokens on the card")
    g.add_argument("--top-p", type=float, default=1.0, help="keep the most probable tokens up to this mass, (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most probable tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the most probable one's probability, [0, 1]")
    g.add_argument("--sample-seed", type=int, default=None,
                   help="request i draws from seed + i: the same seed gives the same tokens on every executor "
                        "and layout (default: a random seed per request)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="with --checkpoint: a request ends where its text shows TEXT (repeatable)")


def _sampled(a) -> bool:
    return a.temperature > 0


GREEDY_ONLY = ("needs --temperature > 0 (a greedy run draws nothing)", _sampled)
APPLIES = {
    "--temperature": (RUN, None),
    "--top-p": (RUN, GREEDY_ONLY),
    "--top-k": (RUN, GREEDY_ONLY),
    "--min-p": (RUN, GREEDY_ONLY),
    "--sample-seed": (RUN, GREEDY_ONLY),
    "--stop": (RUN, ("needs --checkpoint (a stop string is text; the tokenizer comes from the checkpoint)",
                     lambda a: a.checkpoint)),
}


def _field(flag: str):
    field = FLAGS[flag]

    def check(a, cfg):
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is None:
            return None
        try:
            SamplingParams(**{field: value})
        except ValueError as e:          # "field: expected ...": the flag stands for the field
            return str(e).split(": ", 1)[1]
    return check


CHECKS = [(flag, _field(flag)) for flag in FLAGS]


def params(a, request: int = 0) -> SamplingParams:
    """The run's settings for its request number ``request`` (the seed counts up per request)."""
    seed = None if a.sample_seed is None else a.sample_seed + request
    return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, seed=seed,
                          stop=tuple(a.stop or ()))
