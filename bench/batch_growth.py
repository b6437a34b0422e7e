"""How much a decode step grows from batch 1 to a larger batch, measured in pairs run back to back:
on a VM whose speed drifts by tens of percent over minutes, a pair's two runs share a spell, where
runs minutes apart do not (docs/flash-shapes.md).

    python bench/batch_growth.py --checkpoint CKPT --context 16384 --batch 8 --pairs 3 [--json]

Each pair is two ``bench/cpu_roofline.py`` measurements (one ``python -m dsv41.run``, ``sync``, TP1,
``--steps`` decode steps, the median step): batch 1, then ``--batch``. Prints each pair's steps and
their ratio, and the median ratio over the pairs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

from cpu_roofline import add_run_args, default_engram_rows, measure    # bench/cpu_roofline.py, beside this script


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--batch", type=int, default=8, help="the batch compared with batch 1")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.batch < 2 or a.pairs < 1 or a.steps < 1 or a.context < 1:
        p.error("--batch must be at least 2, and --pairs, --steps and --context at least 1")
    default_engram_rows(a)
    pairs = []
    for i in range(a.pairs):
        step = {}
        for batch in (1, a.batch):
            run = measure(argparse.Namespace(**{**vars(a), "batch": batch}), tempfile.mkdtemp(prefix="batch_growth-"))
            step[batch] = statistics.median(run["step_ms"])
        pairs.append({"batch_1_ms": step[1], f"batch_{a.batch}_ms": step[a.batch], "ratio": step[a.batch] / step[1]})
        if not a.json:
            print(f"pair {i + 1}: batch 1 {step[1]:.0f} ms, batch {a.batch} {step[a.batch]:.0f} ms: "
                  f"{step[a.batch] / step[1]:.2f}x", flush=True)
    median = statistics.median(r["ratio"] for r in pairs)
    if a.json:
        print(json.dumps({"batch": a.batch, "context": a.context, "steps": a.steps, "pairs": pairs,
                          "median_ratio": median}))
    else:
        print(f"median of {len(pairs)} pairs: batch {a.batch} is {median:.2f}x batch 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
