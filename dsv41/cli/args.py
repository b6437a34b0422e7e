"""Every argument of ``python -m dsv41.run`` checked before any work is done.

Two tables keep the rules in one place:
- ``APPLIES``: per flag, the modes it applies to (a mode is ``--plan`` or an ``--executor``) and any
  rule on the other flags (what it needs, what it does not go with). A flag the user gave outside
  them is a usage error naming both flags.
- ``CHECKS``: value checks, in order; each returns what is wrong with the allowed range, or None.
  They run on every value that applies, given or default, so a default that cannot work is caught too.
  ``FIRST`` runs before the model config is known (it may come from ``--checkpoint``).

A new flag is one ``add_argument`` line, one ``APPLIES`` row and, when its value has a range, one
``CHECKS`` entry (``test_every_flag_has_a_row`` keeps the table complete). Errors follow argparse:
one line ``python -m dsv41.run: error: --flag: what is wrong``, exit status 2.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
from typing import Callable

from dsv41.cli.modes import (ALL, DIST, EXECUTOR_ORDER, GRAPH, GRAPH_OR_PLAN, LOCAL, PLAN, REFERENCE, RUN, groups,
                             max_context, mode, mode_flag, per_group)

PROG = "python -m dsv41.run"
MAX_SEED = 2 ** 32 - 1
MAX_CONNECT_TIMEOUT_S = 600.0
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")


class UsageError(Exception):
    """A bad command line; the message starts with the flag it is about."""


INTEGER = re.compile(r"-?[0-9]+")
# a decimal number in ASCII, or float()'s words for the values a range check then names (nan, inf)
DECIMAL = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?|-?(nan|inf|infinity)", re.IGNORECASE)


def ascii_int(text: str) -> int:
    """An integer written in ASCII digits: int() also takes other scripts' digits ('٣'), '1_0' and
    surrounding blanks, none of which a command line means as a number."""
    if not INTEGER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (expected ASCII digits 0-9, "
                                         "optionally after a minus sign)")
    return int(text)


def ascii_float(text: str) -> float:
    """A number written in ASCII (digits, one point, an exponent), as ``ascii_int`` for int."""
    if not DECIMAL.fullmatch(text):
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r} (expected a decimal number in ASCII "
                                         "digits, e.g. 0.5 or 1e-3)")
    return float(text)


class Parser(argparse.ArgumentParser):
    """Every dsv41 command's parser: one-line errors, no abbreviated flags (``--exec`` is not
    ``--executor``: a prefix that later became ambiguous would change meaning), and every ``type=int``
    or ``type=float`` argument parsed by ``ascii_int`` / ``ascii_float``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.register("type", int, ascii_int)
        self.register("type", float, ascii_float)

    def error(self, message):
        """One line and exit status 2 (argparse prints the whole usage first, which buries the line)."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def _where(modes) -> str:
    if modes == RUN:
        return "a run (leave out --plan: it runs nothing)"
    executors = [m for m in EXECUTOR_ORDER if m in modes]
    parts = []
    if executors:
        names = executors[0] if len(executors) == 1 else ", ".join(executors[:-1]) + " or " + executors[-1]
        parts.append(f"--executor {names}")
    if PLAN in modes:
        parts.append("--plan")
    return ", or ".join(parts)


# ---- which flag goes with which mode -----------------------------------------------------------------

def _no_prompts(a) -> bool:
    return not (a.prompt or a.prompt_file)


FROM_PROMPTS = "does not apply with --prompt/--prompt-file: "
Rule = tuple[str, Callable] | None     # (what is wrong when the predicate is false, predicate)
APPLIES: dict[str, tuple[frozenset, Rule]] = {
    "--graph": (ALL, None),
    "--config": (ALL, ("does not apply with --checkpoint: its config.json is the config",
                       lambda a: a.checkpoint is None)),
    "--checkpoint": (ALL, None),
    "--no-verify-checksums": (RUN, ("needs --checkpoint (it skips hashing the checkpoint's tensors)",
                                    lambda a: a.checkpoint is not None)),
    "--layers": (ALL, ("does not apply with --checkpoint: its config.json says what was reduced",
                       lambda a: a.checkpoint is None)),
    "--experts": (ALL, ("does not apply with --checkpoint: its config.json says what was reduced",
                        lambda a: a.checkpoint is None)),
    "--engram-rows": (ALL, ("does not apply with --checkpoint: its config.json says what was reduced",
                            lambda a: a.checkpoint is None)),
    "--prompt": (RUN, ("needs --checkpoint (the tokenizer comes from the checkpoint)",
                       lambda a: a.checkpoint is not None)),
    "--prompt-file": (RUN, ("needs --checkpoint (the tokenizer comes from the checkpoint)",
                            lambda a: a.checkpoint is not None)),
    "--chat": (RUN, ("needs --prompt or --prompt-file", lambda a: not _no_prompts(a))),
    "--allow-special-tokens": (RUN, ("needs --checkpoint and --prompt or --prompt-file",
                                     lambda a: a.checkpoint is not None and not _no_prompts(a))),
    "--batch": (ALL, (FROM_PROMPTS + "the batch is the number of prompts", _no_prompts)),
    "--prompt-len": (RUN, (FROM_PROMPTS + "the prompts set their lengths", _no_prompts)),
    "--new-tokens": (RUN, ("needs --graph decode", lambda a: a.graph == "decode")),
    "--max-num-batched-tokens": (RUN, None),
    "--max-total-tokens": (ALL, None),
    "--enable-prefix-caching": (RUN, None),
    "--no-enable-prefix-caching": (RUN, None),
    "--seed": (RUN, (FROM_PROMPTS + "the seed draws random prompts and weights, and --checkpoint gives both",
                     _no_prompts)),
    "--executor": (RUN, None),
    "--tp": (GRAPH_OR_PLAN, None),
    "--dp": (GRAPH_OR_PLAN, None),
    "--ep": (GRAPH_OR_PLAN, None),
    "--granularity": (GRAPH, None),
    "--backend": (GRAPH, None),
    "--wiring": (GRAPH_OR_PLAN, None),
    "--address": (DIST, None),
    "--connect-timeout": (DIST, None),
    "--dashboard": (DIST, None),
    "--hold": (DIST, ("needs --dashboard", lambda a: a.dashboard)),
    "--show-graph": (GRAPH, None),
    "--check": (LOCAL, None),
    "--pypto-per-shape": (LOCAL, ("needs --check and --backend pypto-sim or pypto-npu",
                                  lambda a: a.check and a.backend.startswith("pypto"))),
    "--json": (ALL, None),
    "--debug": (ALL, None),
    "--help": (ALL, None),
}


def check_modes(a, given: set[str], applies: dict) -> None:
    m = mode(a)
    for flag, (modes, needs) in applies.items():
        if flag not in given:
            continue
        if m not in modes:
            raise UsageError(f"{flag}: does not apply with {mode_flag(m)}; it goes with {_where(modes)}")
        if needs is not None and not needs[1](a):
            raise UsageError(f"{flag}: {needs[0]}")


# ---- values ------------------------------------------------------------------------------------------

def on(a, cfg) -> str:
    """Which model a range is for."""
    return f"on --config {cfg.name}" if a.checkpoint is None else f"on {cfg.name} (--checkpoint's config.json)"


def _length(a) -> str:
    return f"--prompt-len {a.prompt_len}" if _no_prompts(a) else f"prompts of up to {a.prompt_len} tokens"


def shown(a, flag: str) -> str:
    """The flag a value came from: the prompts stand for --batch and --prompt-len, and --checkpoint
    for --config."""
    if flag in ("--batch", "--prompt-len") and not _no_prompts(a):
        return "--prompt" if a.prompt else "--prompt-file"
    if flag == "--config" and a.checkpoint is not None:
        return "--checkpoint"
    return flag


def resolve_model(a, checkpoint=None):
    """The model a command serves, the one place it is decided (run, serve and the checkpoint writer
    call it, so a reduction is never dropped): the opened checkpoint's config, else the --config
    preset with --layers/--experts/--engram-rows applied; a reduction that breaks the schedule is a
    usage error naming its option. ``a.capacity`` becomes the limits it runs with (``dsv41.capacity``)."""
    from dsv41.capacity import capacity_of
    if checkpoint is not None:
        a.capacity = checkpoint.capacity
        return checkpoint.cfg
    from dsv41.config import PRESETS
    try:
        cfg = PRESETS[a.config].reduced(a.layers, a.experts, a.engram_rows)
    except ValueError as e:
        raise UsageError(str(e)) from None
    a.capacity = capacity_of(cfg)
    return cfg


def model_config(a):
    """The model to check against: the --config preset (reduced as asked), or --checkpoint's config.json. With a
    checkpoint the prompts are encoded here (``a.codec``, ``a.prompt_ids``); their count and longest
    length become --batch and --prompt-len; ``a.capacity`` its limits (config.json's ``dsv41`` section).
    A file that cannot be read or decoded is a UsageError naming the flag and the file."""
    a.codec, a.prompt_ids = None, []
    if a.checkpoint is None:
        return resolve_model(a)
    from dsv41.checkpoint.reader import read_config
    from dsv41.cli.prompts import PromptError, encode_prompts
    try:
        cfg, a.capacity = read_config(a.checkpoint)
        if mode(a) != PLAN:
            a.codec, a.prompt_ids = encode_prompts(a.checkpoint, a.prompt, a.prompt_file, a.chat,
                                                   a.allow_special_tokens)
    except PromptError as e:
        raise UsageError(str(e)) from e
    except OSError as e:          # permissions, a folder where a file should be: the folder's files
        raise UsageError(f"--checkpoint: {unreadable(e)}") from e
    except UnicodeDecodeError as e:
        raise UsageError(f"--checkpoint: {a.checkpoint}: a JSON file of the folder is not UTF-8 text "
                         f"({e.reason} at byte {e.start})") from e
    except ValueError as e:       # CheckpointError, and the codec's own '--chat: ...' refusal
        raise UsageError(str(e) if str(e).startswith("--") else f"--checkpoint: {e}") from e
    if a.prompt_ids:
        a.batch, a.prompt_len = len(a.prompt_ids), max(map(len, a.prompt_ids))
    return cfg


def warn_unverified(prog: str, a, ckpt) -> None:
    """One line on stderr when a checkpoint is served whose index lists no SHA-256 per tensor (the
    released one's, written by Hugging Face tools, has none): it is served, its tensors checked for
    shape, dtype and values as read but not for being the bytes that were written."""
    if a.verify_checksums and not ckpt.digests_listed:
        print(f"{prog}: warning: --checkpoint: {os.path.join(a.checkpoint, 'model.safetensors.index.json')} lists "
              "no sha256 per tensor, so damaged bytes that are still valid values cannot be told apart "
              "(python -m dsv41.checkpoint.write lists them)", file=sys.stderr)


def unreadable(e: OSError) -> str:
    """An OSError as 'FILE: cannot read (reason)'."""
    return f"{e.filename}: cannot read ({e.strerror or e})" if e.filename else f"cannot read ({e.strerror or e})"


def _tp(a, cfg):
    ok = [t for t in (1, 2, 4, 8) if cfg.num_attention_heads % t == 0 and cfg.o_groups % t == 0]
    if a.tp not in ok:
        return (f"must be one of {', '.join(map(str, ok))} {on(a, cfg)} (it splits the "
                f"{cfg.num_attention_heads} heads and {cfg.o_groups} output groups), got {a.tp}")


def _dp(a, cfg):
    e = cfg.n_routed_experts
    ok = [d for d in range(1, e // a.tp + 1) if e % (a.tp * d) == 0]
    if a.dp not in ok:
        return (f"must be one of {', '.join(map(str, ok))} with --tp {a.tp} {on(a, cfg)} "
                f"(tp x dp cards split its {e} routed experts), got {a.dp}")


def _experts(a, cfg):
    ep = 1 if mode(a) == REFERENCE else a.tp * a.dp    # what --ep must be; --tp and --dp are checked next
    if a.experts is not None and a.experts % ep:
        return f"must be a multiple of EP = {ep} (each card holds n_routed_experts / EP experts), got {a.experts}"


def _ep(a, cfg):
    if a.ep != a.tp * a.dp:
        return f"must equal --tp x --dp = {a.tp * a.dp} (EP = TP x DP; leave it out for that), got {a.ep}"


def _batch(a, cfg):
    cap = a.capacity.max_batch_per_dp
    if mode(a) == PLAN:
        if a.batch % a.dp or not 1 <= a.batch // a.dp <= cap:
            return (f"must be a multiple of --dp {a.dp} in [{a.dp}, {cap * a.dp}] (requests in total, "
                    f"{cap} per DP group at most {on(a, cfg)}), got {a.batch}")
        return None
    g = groups(a)
    if not 1 <= a.batch <= cap * g:
        where = f"{g} DP groups" if g > 1 else "one DP group"
        return (f"must be in [1, {cap * g}] requests in total ({cap} per DP group {on(a, cfg)}, "
                f"{where}), got {a.batch}")


def _prompt_len(a, cfg):
    top = cfg.max_position_embeddings - 1
    if not 1 <= a.prompt_len <= top:
        return (f"must be in [1, {top}] tokens {on(a, cfg)} (context limit {cfg.max_position_embeddings}, "
                f"a row left for the first token; longer prompts are fed in chunks), got {a.prompt_len}")


def _max_num_batched_tokens(a, cfg):
    top = a.capacity.prefill_max_tokens
    if a.max_num_batched_tokens is not None and not 1 <= a.max_num_batched_tokens <= top:
        return (f"must be in [1, {top}] rows per DP group per step {on(a, cfg)} (its prefill capacity, "
                f"the default), got {a.max_num_batched_tokens}")


def cache_tokens(a) -> int | None:
    """--max-total-tokens as the tokens each DP group's cache pools hold (None: every request at its
    context)."""
    return None if a.max_total_tokens is None else -(-a.max_total_tokens // groups(a))


def _max_total_tokens(a, cfg):
    if a.max_total_tokens is None:
        return None
    if mode(a) == PLAN:
        return None if a.max_total_tokens >= 1 else f"must be >= 1 tokens, got {a.max_total_tokens}"
    from dsv41.engine.blocks import least_cache_tokens
    g, context = groups(a), max_context(a)
    top = g * per_group(a) * context
    low = g * least_cache_tokens(cfg, per_group(a), context, a.capacity.prefill_max_tokens)
    if not low <= a.max_total_tokens <= top:
        return (f"must be in [{low}, {top}] tokens in the cache pools (at least one request of {context} tokens "
                f"per DP group; at most {per_group(a)} request(s) per DP group x {context} tokens each x {g} "
                f"DP group(s), the default), got {a.max_total_tokens}")


def _new_tokens(a, cfg):
    if a.graph != "decode":
        return None
    top = cfg.max_position_embeddings - a.prompt_len - 1
    if not 0 <= a.new_tokens <= top:
        return (f"must be in [0, {top}] with {_length(a)} {on(a, cfg)} "
                f"(context limit {cfg.max_position_embeddings} tokens), got {a.new_tokens}")


def _checkpoint(a, cfg):
    if a.checkpoint is None:
        return None
    if not a.checkpoint:
        return "got an empty path; expected a checkpoint folder"
    if not os.path.isdir(a.checkpoint):
        found = "a file" if os.path.exists(a.checkpoint) else "nothing"
        return f"{a.checkpoint}: expected a checkpoint folder, found {found}"
    if not os.path.isfile(os.path.join(a.checkpoint, "config.json")):
        return f"{os.path.join(a.checkpoint, 'config.json')}: expected the model config, found no file"


def _prompt_file(a, cfg):
    if a.prompt_file is not None and not os.path.isfile(a.prompt_file):
        found = "a folder" if os.path.isdir(a.prompt_file) else "nothing"
        return f"{a.prompt_file}: expected a file of prompts (one per line), found {found}"


def _seed(a, cfg):
    if not 0 <= a.seed <= MAX_SEED:
        return f"must be in [0, {MAX_SEED}], got {a.seed}"


def _pypto_per_shape(a, cfg):
    if a.pypto_per_shape < 0:
        return f"must be >= 0 (0: pypto computes every node), got {a.pypto_per_shape}"


def _hold(a, cfg):
    if a.hold is not None and not (math.isfinite(a.hold) and a.hold >= 0):
        return f"must be a number of seconds >= 0, got {a.hold:g}"


def _connect_timeout(a, cfg):
    if not (math.isfinite(a.connect_timeout) and 0 < a.connect_timeout <= MAX_CONNECT_TIMEOUT_S):
        return f"must be in (0, {MAX_CONNECT_TIMEOUT_S:g}] seconds, got {a.connect_timeout:g}"


def _address(a, cfg):
    if a.address is not None:
        from dsv41.cluster.connect import check_address
        return check_address(a.address)


def _show_graph(a, cfg):
    if a.show_graph is None:
        return None
    if not FILE_NAME.fullmatch(a.show_graph) or not a.show_graph.endswith((".dot", ".svg")):
        return (f"must be a plain file name ending in .dot or .svg (written as traces/NAME), "
                f"got {a.show_graph!r}")
    if a.show_graph.endswith(".svg") and shutil.which("dot") is None:
        return "an .svg needs graphviz's 'dot' on PATH, which is missing; ask for a .dot file instead"
    return outputs_writable([a.show_graph])


def _backend(a, cfg):
    if a.backend == "pypto-npu":
        from dsv41.kernels.pypto.env import check_npu
        try:
            check_npu()
        except RuntimeError as e:
            return f"{e}; --backend pypto-sim runs the cost model on this CPU"
    if a.backend == "pypto-sim":
        import importlib.util
        if importlib.util.find_spec("pypto") is None:
            return "pypto-sim needs the pypto package (pip install pypto==0.2.0)"
        return traces_writable() or _sim_cache_writable()


def _sim_cache_writable() -> str | None:
    """pypto-sim keeps the simulated times in a file under the user's cache, written as kernels are
    simulated: a folder that cannot be written would fail the run after its work."""
    from dsv41.kernels.pypto.env import cache_file
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)     # made now, as the run would make it
    except OSError as e:
        return (f"cannot make the simulated-times cache's folder {path.parent} ({e.strerror}); "
                "set DSV41_PYPTO_CACHE to a writable file")
    if path.is_dir() or not os.access(path if path.exists() else path.parent, os.W_OK):
        return f"cannot write the simulated-times cache {path}; set DSV41_PYPTO_CACHE to a writable file"
    return None


def _dashboard(a, cfg):
    if a.dashboard and a.hold is None and not (sys.stdin is not None and not sys.stdin.closed and isatty(sys.stdin)):
        return "waits for Enter after the run, but stdin is not a terminal; add --hold SECONDS"


def isatty(stream) -> bool:
    """The stream's isatty(); False where it cannot answer (None, closed, a stand-in without a file)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def traces_writable() -> str | None:
    """None when ./traces exists (or can be made) and is writable."""
    folder = os.path.join(os.getcwd(), "traces")
    probe = folder if os.path.isdir(folder) else os.getcwd()
    if os.path.islink(folder):
        return f"{folder} is a symbolic link; outputs are written only into a real folder, never through a link"
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"{folder} exists and is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"cannot write {folder}: {probe} is not writable"
    return None


def outputs_writable(names: list[str]) -> str | None:
    """None when ./traces is writable and each traces/NAME can be written (absent, or a writable file):
    checked before the run so that nothing computed is lost to a file that cannot be written."""
    problem = traces_writable()
    if problem:
        return problem
    for name in names:
        path = os.path.join("traces", name)
        if os.path.islink(path):
            return f"{path} is a symbolic link; the run writes a plain file there and never follows a link"
        if os.path.isdir(path):
            return f"{path} is a folder; the run writes a file there"
        if os.path.exists(path) and not os.access(path, os.W_OK):
            return f"cannot write {path}: permission denied"
    return None


def _budget(a, cfg):
    from dsv41.cli.budget import check_budget
    return check_budget(a, cfg)


Check = tuple[str, Callable]
FIRST: list[Check] = [("--checkpoint", _checkpoint), ("--prompt-file", _prompt_file)]
CHECKS: list[Check] = [
    ("--experts", _experts), ("--tp", _tp), ("--dp", _dp), ("--ep", _ep), ("--batch", _batch), ("--prompt-len", _prompt_len),
    ("--new-tokens", _new_tokens), ("--max-num-batched-tokens", _max_num_batched_tokens),
    ("--max-total-tokens", _max_total_tokens), ("--seed", _seed), ("--hold", _hold), ("--connect-timeout", _connect_timeout),
    ("--address", _address), ("--show-graph", _show_graph), ("--backend", _backend), ("--dashboard", _dashboard),
    ("--pypto-per-shape", _pypto_per_shape),
]
LAST: list[Check] = [("--config", _budget)]   # after every cheaper check: it sizes the model


def check_environment() -> None:
    """The OTEL_* variables that name a collector (a malformed address would lose every span silently)."""
    from dsv41.telemetry.spans import endpoint_problem
    problem = endpoint_problem()
    if problem:
        raise UsageError(problem)


def check_kernels() -> None:
    """DSV41_KERNELS: a value ``cpu.dispatch`` knows, and ``compiled`` only where this CPU runs the x86
    kernels (else the first weight product would fail, mid-run)."""
    from dsv41.cpu import dispatch
    try:
        dispatch.lanes()
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None


def run_checks(a, cfg, checks: list[Check], applies: dict) -> None:
    m = mode(a)
    for flag, fn in checks:
        if m not in applies[flag][0]:
            continue
        problem = fn(a, cfg)
        if problem:
            raise UsageError(f"{shown(a, flag)}: {problem}")


# ---- the parser ----------------------------------------------------------------------------------------

def add_reductions(p):
    """What memory may force smaller (``ModelConfig.reduced``); run, --plan, the budget check and the
    checkpoint writer take the same three."""
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="keep the first N layers of the schedule (the head after the last)")
    p.add_argument("--experts", type=int, default=None, metavar="E", help="routed experts per layer (top-k kept)")
    p.add_argument("--engram-rows", type=int, default=None, metavar="R",
                   help="rows per Engram table (each the smallest unused prime >= R)")


def given_flags(p: argparse.ArgumentParser, argv) -> set[str]:
    """The long flags the user typed (argparse keeps no record): a second parse with no defaults."""
    saved = [(act, act.default) for act in p._actions]
    try:
        for act, _ in saved:
            act.default = argparse.SUPPRESS
        ns, _ = p.parse_known_args(argv)
    finally:
        for act, default in saved:
            act.default = default
    present = set(vars(ns))
    return {next(o for o in act.option_strings if o.startswith("--"))
            for act in p._actions if act.dest in present and act.option_strings}


def parse_checked(p: argparse.ArgumentParser, argv, applies: dict, checks) -> argparse.Namespace:
    """Parse, default --ep to tp * dp, check which flags apply (``applies``), then ``checks(a)``; a
    UsageError ends the program with one line and exit status 2 (raised as it is with --debug)."""
    a = p.parse_args(argv)
    if a.ep is None:
        a.ep = a.tp * a.dp
    try:
        check_modes(a, given_flags(p, argv), applies)
        check_kernels()
        checks(a)
    except UsageError as e:
        if a.debug:
            raise
        p.error(str(e))
    return a


def unknown_rows(p, applies: dict) -> list[str]:
    """Flags of the parser without an APPLIES row (kept empty by a test)."""
    flags = {o for act in p._actions for o in act.option_strings if o.startswith("--")}
    return sorted(flags - set(applies))
