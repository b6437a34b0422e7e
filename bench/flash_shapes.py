"""FLASH shapes, run for real: graph executors against the reference, bit for bit, and memory per card
against ``--plan``.

    python bench/flash_shapes.py --checkpoint /tmp/flash-L2-E8 --batch 2 --prompt-len 8 --new-tokens 2 \
        --layouts reference sync:1:1 threads:4:2
    python bench/flash_shapes.py --checkpoint /tmp/flash-L3-E8 --batch 1 --prompt-len 1 --new-tokens 2 \
        --context 131072 --layouts reference sync:1:1      # decode at a long context (drawn history)

Each layout is one ``python -m dsv41.run ... --json`` in a child process of its own (so each peak is
its own): the child reports its peak RSS (``resource.getrusage``: the kernel's high-water mark, the
one figure that sees Torch's CPU allocations, which tracemalloc does not). Printed per layout: the
tokens and ``last_logits_sha256`` against the first layout's, prefill and decode step wall times, each
card's resident weight and cache bytes (the tensors its State holds) against the plan's for the same
topology and context, and the peak RSS. One JSON object per layout goes to stdout with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

PLAN_MATCH = 0.03      # resident bytes within 3% of the plan's


def _child(argv: list[str]) -> int:
    """Run the command line in this process, then say its peak RSS on stderr's last line."""
    from dsv41.cli.run import main
    rc = main(argv)
    print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}),
          file=sys.stderr)
    return rc


def _run(argv: list[str]) -> tuple[dict, dict]:
    proc = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), json.loads(proc.stderr.strip().splitlines()[-1])


def _layout(spec: str) -> list[str]:
    if spec == "reference":
        return ["--executor", "reference"]
    executor, tp, dp = spec.split(":")
    return ["--executor", executor, "--tp", tp, "--dp", dp]


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--config", default="flash")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--engram-rows", type=int, default=None)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=2)
    p.add_argument("--context", type=int, default=0, help="tokens of drawn history before each prompt (run's --context)")
    p.add_argument("--layouts", nargs="+", default=["reference", "sync:1:1", "threads:4:2"])
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    model = ["--checkpoint", a.checkpoint] if a.checkpoint else \
        ["--config", a.config] + [f for k, f in (("layers", "--layers"), ("experts", "--experts"),
                                                  ("engram_rows", "--engram-rows"))
                                  if getattr(a, k) is not None for f in (f, str(getattr(a, k)))]
    common = model + ["--batch", str(a.batch), "--prompt-len", str(a.prompt_len), "--new-tokens",
                      str(a.new_tokens), "--json"] + (["--context", str(a.context)] if a.context else [])
    first = None
    ok = True
    for spec in a.layouts:
        result, peak = _run(common + _layout(spec))
        tp, dp = (1, 1) if spec == "reference" else map(int, spec.split(":")[1:])
        context = a.context + a.prompt_len + a.new_tokens + 1
        plan, _ = _run(model + ["--plan", "--json", "--tp", str(tp), "--dp", str(dp), "--batch", str(dp),
                                "--context", str(context)])
        planned = {c["card"]: c["weights_bytes"] for c in plan["plan"]["cards"]}
        cards = result.get("cards") or []
        worst = max((abs(c["weights_bytes"] / planned[c["card"]] - 1) for c in cards), default=None)
        first = first or result
        same = (result["tokens"] == first["tokens"], result["last_logits_sha256"] == first["last_logits_sha256"])
        ok &= all(same) and (worst is None or worst <= PLAN_MATCH)
        row = {"layout": spec, "config": result["config"], "tokens_equal": same[0], "sha_equal": same[1],
               "sha": result["last_logits_sha256"], "prefill_ms": round(result["prefill_ms"], 1),
               "step_ms": [round(s, 1) for s in result["step_ms"]], "peak_rss_bytes": peak["peak_rss_bytes"],
               "cards": cards, "plan_weights_bytes": planned, "worst_plan_deviation": worst}
        if a.json:
            print(json.dumps(row))
        else:
            print(f"{spec:>12} {result['config']} tokens {'==' if same[0] else '!='} sha {'==' if same[1] else '!='} "
                  f"{result['last_logits_sha256'][:12]} prefill {row['prefill_ms']} ms steps {row['step_ms']} ms "
                  f"peak RSS {peak['peak_rss_bytes'] / 2**30:.2f} GiB")
            for c in cards:
                print(f"{'':>12} card {c['card']}: weights {c['weights_bytes'] / 2**30:.3f} GiB "
                      f"(plan {planned[c['card']] / 2**30:.3f}), caches {c['cache_bytes'] / 2**20:.1f} MiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
