"""Every argument of ``python -m dsv41.run`` checked before any work is done.

Two tables keep the rules in one place:
- ``APPLIES``: per flag, the modes it applies to (a mode is ``--plan`` or an ``--executor``) and any
  flag it needs. A flag the user gave outside them is a usage error naming both flags.
- ``CHECKS``: value checks, in order; each returns what is wrong with the allowed range, or None.
  They run on every value that applies, given or default, so a default that cannot work is caught too.

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

PLAN, REFERENCE = "plan", "reference"
EXECUTOR_ORDER = ("reference", "sync", "threads", "distributed")
GRAPH = frozenset(("sync", "threads", "distributed"))
RUN = GRAPH | {REFERENCE}
ALL = RUN | {PLAN}
DIST = frozenset(("distributed",))
GRAPH_OR_PLAN = GRAPH | {PLAN}

MAX_SEED = 2 ** 32 - 1
MAX_CONNECT_TIMEOUT_S = 600.0
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")


class UsageError(Exception):
    """A bad command line; the message starts with the flag it is about."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line and exit status 2 (argparse prints the whole usage first, which buries the line)."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def mode(a) -> str:
    return PLAN if a.plan else a.executor


def mode_flag(m: str) -> str:
    return "--plan" if m == PLAN else f"--executor {m}"


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

Needs = tuple[str, Callable] | None
APPLIES: dict[str, tuple[frozenset, Needs]] = {
    "--graph": (ALL, None),
    "--config": (ALL, None),
    "--batch": (ALL, None),
    "--prompt-len": (RUN, None),
    "--new-tokens": (RUN, ("--graph decode", lambda a: a.graph == "decode")),
    "--seed": (RUN, None),
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
    "--hold": (DIST, ("--dashboard", lambda a: a.dashboard)),
    "--show-graph": (GRAPH, None),
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
            raise UsageError(f"{flag}: needs {needs[0]}")


# ---- values ------------------------------------------------------------------------------------------

def groups(a) -> int:
    """DP groups the run's requests are spread over (the reference is one group)."""
    return 1 if mode(a) == REFERENCE else a.dp


def per_group(a) -> int:
    return -(-a.batch // groups(a))


def _tp(a, cfg):
    ok = [t for t in (1, 2, 4, 8) if cfg.num_attention_heads % t == 0 and cfg.o_groups % t == 0]
    if a.tp not in ok:
        return (f"must be one of {', '.join(map(str, ok))} on --config {cfg.name} (it splits the "
                f"{cfg.num_attention_heads} heads and {cfg.o_groups} output groups), got {a.tp}")


def _dp(a, cfg):
    e = cfg.n_routed_experts
    ok = [d for d in range(1, e // a.tp + 1) if e % (a.tp * d) == 0]
    if a.dp not in ok:
        return (f"must be one of {', '.join(map(str, ok))} with --tp {a.tp} on --config {cfg.name} "
                f"(tp x dp cards split its {e} routed experts), got {a.dp}")


def _ep(a, cfg):
    if a.ep != a.tp * a.dp:
        return f"must equal --tp x --dp = {a.tp * a.dp} (EP = TP x DP; leave it out for that), got {a.ep}"


def _batch(a, cfg):
    cap = cfg.max_batch_per_dp
    if mode(a) == PLAN:
        if a.batch % a.dp or not 1 <= a.batch // a.dp <= cap:
            return (f"must be a multiple of --dp {a.dp} in [{a.dp}, {cap * a.dp}] (requests in total, "
                    f"{cap} per DP group at most on --config {cfg.name}), got {a.batch}")
        return None
    g = groups(a)
    if not 1 <= a.batch <= cap * g:
        where = f"{g} DP groups" if g > 1 else "one DP group"
        return (f"must be in [1, {cap * g}] requests in total ({cap} per DP group on --config {cfg.name}, "
                f"{where}), got {a.batch}")


def max_context(a) -> int:
    """Tokens a request of the run reaches: its prompt, the generated tokens and one spare row."""
    return a.prompt_len + (a.new_tokens if a.graph == "decode" else 0) + 1


def _prompt_len(a, cfg):
    rows = per_group(a)
    top = min(cfg.prefill_max_tokens // rows, cfg.max_position_embeddings - 1)
    if not 1 <= a.prompt_len <= top:
        return (f"must be in [1, {top}] with {rows} prompt(s) per DP group on --config {cfg.name} "
                f"(a prefill step holds {cfg.prefill_max_tokens} rows per DP group), got {a.prompt_len}")


def _new_tokens(a, cfg):
    if a.graph != "decode":
        return None
    top = cfg.max_position_embeddings - a.prompt_len - 1
    if not 0 <= a.new_tokens <= top:
        return (f"must be in [0, {top}] with --prompt-len {a.prompt_len} on --config {cfg.name} "
                f"(context limit {cfg.max_position_embeddings} tokens), got {a.new_tokens}")


def _seed(a, cfg):
    if not 0 <= a.seed <= MAX_SEED:
        return f"must be in [0, {MAX_SEED}], got {a.seed}"


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
    return traces_writable()


def _backend(a, cfg):
    if a.backend == "pypto-npu":
        from dsv41.kernels.pypto_env import check_npu
        try:
            check_npu()
        except RuntimeError as e:
            return f"{e}; --backend pypto-sim runs the cost model on this CPU"
    if a.backend == "pypto-sim":
        import importlib.util
        if importlib.util.find_spec("pypto") is None:
            return "pypto-sim needs the pypto package (pip install pypto==0.2.0)"
        return traces_writable()


def _dashboard(a, cfg):
    if a.dashboard and a.hold is None and not (sys.stdin is not None and not sys.stdin.closed and _isatty(sys.stdin)):
        return "waits for Enter after the run, but stdin is not a terminal; add --hold SECONDS"


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def traces_writable() -> str | None:
    """None when ./traces exists (or can be made) and is writable."""
    folder = os.path.join(os.getcwd(), "traces")
    probe = folder if os.path.isdir(folder) else os.getcwd()
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"{folder} exists and is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"cannot write {folder}: {probe} is not writable"
    return None


def _budget(a, cfg):
    from dsv41.cli.budget import check_budget
    return check_budget(a, cfg)


Check = tuple[str, Callable]
CHECKS: list[Check] = [
    ("--tp", _tp), ("--dp", _dp), ("--ep", _ep), ("--batch", _batch), ("--prompt-len", _prompt_len),
    ("--new-tokens", _new_tokens), ("--seed", _seed), ("--hold", _hold), ("--connect-timeout", _connect_timeout),
    ("--address", _address), ("--show-graph", _show_graph), ("--backend", _backend), ("--dashboard", _dashboard),
]
LAST: list[Check] = [("--config", _budget)]   # after every cheaper check: it sizes the model


def run_checks(a, cfg, checks: list[Check], applies: dict) -> None:
    m = mode(a)
    for flag, fn in checks:
        if m not in applies[flag][0]:
            continue
        problem = fn(a, cfg)
        if problem:
            raise UsageError(f"{flag}: {problem}")


# ---- the parser ----------------------------------------------------------------------------------------

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


def unknown_rows(p, applies: dict) -> list[str]:
    """Flags of the parser without an APPLIES row (kept empty by a test)."""
    flags = {o for act in p._actions for o in act.option_strings if o.startswith("--")}
    return sorted(flags - set(applies))
