"""Replay one node saved by ``--check``: ``python -m dsv41.replay traces/check-NODE.pt [--rerun]``.

Rebuilds the node's card State (weights, caches as the node saw them, RoPE tables), recomputes the
Torch golden on the saved inputs and compares it with the saved value (``--rerun``: with the value
the backend gives now, pypto's for pypto-backed nodes). Exit status 1 when the node still fails.
"""
from __future__ import annotations

import torch

from dsv41.cli.args import Parser
from dsv41.cluster.state import CardState
from dsv41.kernels import check
from dsv41.kernels.kinds import KINDS
from dsv41.model.staged import StagedTensors


def load(path: str) -> tuple[CardState, dict]:
    saved = torch.load(path, weights_only=False)
    s = saved["state"]
    st = CardState(s["cfg"], s["topo"], s["card"], s["weights"], StagedTensors(s["caches"]), s["rope_tables"],
                   s["options"])
    return st, saved


def replay(path: str, rerun: bool = False) -> tuple[dict, check.Verdict]:
    st, saved = load(path)
    node, args = saved["node"], saved["args"]
    actual = saved["actual"]
    if rerun:
        mode = check.VALUE_MODES.get(saved["backend"])
        actual = (check.pypto_value(mode, st, node, args) if saved["source"] == "pypto"
                  else KINDS[node.kernel].run(st, node, *args))
    golden = KINDS[node.kernel].run(st, node, *args)
    return saved, check.compare_node(st, node, actual, golden)


def main(argv=None) -> int:
    p = Parser(prog="python -m dsv41.replay", description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--rerun", action="store_true", help="recompute the backend's value instead of the saved one")
    a = p.parse_args(argv)
    saved, v = replay(a.trace, a.rerun)
    node = saved["node"]
    status = "passes" if v.ok else f"FAILS: {v.why}"
    print(f"{node.key} ({node.kernel}, card {node.card}, values from {saved['source']}): {status}; "
          f"worst RMS ratio {v.rms_ratio:.3g}, worst max ratio {v.max_ratio:.3g}")
    return 0 if v.ok else 1
