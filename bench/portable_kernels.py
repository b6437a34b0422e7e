"""The portable weight kernels against the x86 ones on this CPU: ns per weight value of each, and
portable / x86, per format and activation row count, on one core and on all of them
(``bench/weight_kernels.py``'s FLASH-shaped matrices, larger than the cache).

    python bench/portable_kernels.py [--rows 1,3,8] [--repeats 3] [--json]

The x86 kernels are ``DSV41_KERNELS=compiled`` (this CPU must have AVX2, FMA and F16C), the portable
ones ``DSV41_KERNELS=portable``: the same IR with the generic decode, compiled for this CPU. The numba
passes (key passes, MX encoders, the mHC mix) have one form, the same in both, so no ratio.
"""
from __future__ import annotations

import argparse
import json
import os

from weight_kernels import measure          # bench/weight_kernels.py, beside this script


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,3,8", help="activation row counts, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = [int(n) for n in a.rows.split(",")]
    r = {}
    for kernels in ("compiled", "portable"):
        os.environ["DSV41_KERNELS"] = kernels
        r[kernels] = measure(rows, a.repeats)
    r["ratio"] = {fmt: {key: ns / r["compiled"]["formats"][fmt]["ns"][key] for key, ns in row["ns"].items()}
                  for fmt, row in r["portable"]["formats"].items()}
    lines = [f"ns per weight value, x86 -> portable (ratio); rows of x: {', '.join(map(str, rows))}"]
    for fmt, ratios in r["ratio"].items():
        for threads in ("one", "all"):
            cells = "  ".join(f"{n}: {r['compiled']['formats'][fmt]['ns'][f'{threads}:{n}']:.3f} -> "
                              f"{r['portable']['formats'][fmt]['ns'][f'{threads}:{n}']:.3f} "
                              f"({ratios[f'{threads}:{n}']:.2f}x)" for n in rows)
            lines.append(f"  {fmt:<5} {threads} core{'s' if threads == 'all' else ''}: {cells}")
    print(json.dumps(r) if a.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
