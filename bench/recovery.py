"""What recovering a lost card costs, measured in one run.

    python bench/recovery.py --config tiny
    python bench/recovery.py --config small --prompt-len 64

A TP2/DP1 engine on a LocalCluster (two single-threaded workers) prefills --batch prompts of
--prompt-len tokens and decodes one step; then card 1's worker is SIGKILLed (between steps) and the
next decode is timed: detection, waiting for the nanny's new worker, rebuilding the group's States,
replaying the requests' histories, and the retried step. A plain decode step is timed for scale.
With ``--executor threads`` the card's State is dropped in-process instead (no worker restart).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

from dsv41.cluster import registry
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.config import PRESETS, Topology


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--executor", default="distributed", choices=("distributed", "threads"))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    a = p.parse_args()
    cfg = PRESETS[a.config]
    engine = GraphEngine(cfg, Topology(2, 1, 2), EngineConfig(seed=0, executor=a.executor, max_batch=a.batch,
                                                              max_context=a.prompt_len + 4))
    try:
        g = torch.Generator().manual_seed(1)
        logits = engine.prefill(torch.randint(0, cfg.vocab_size, (a.batch, a.prompt_len), generator=g).tolist()).logits
        t0 = time.perf_counter()
        logits = engine.decode(torch.argmax(logits, -1).tolist()).logits
        plain_ms = (time.perf_counter() - t0) * 1e3
        if engine.runner is None:
            registry.find(engine.id).states.pop(1)
        else:
            addr = engine.runner.address_of[1]
            os.kill(engine.runner.client.run(os.getpid, workers=[addr])[addr], signal.SIGKILL)
        t0 = time.perf_counter()
        engine.decode(torch.argmax(logits, -1).tolist())
        recovered_ms = (time.perf_counter() - t0) * 1e3
        rec = engine.last_stats["recovered"][0]
    finally:
        engine.close()
    print(json.dumps({
        "config": cfg.name, "executor": a.executor, "topology": "tp2-dp1-ep2", "batch": a.batch,
        "prompt_len": a.prompt_len, "plain_decode_ms": round(plain_ms), "recovered_decode_ms": round(recovered_ms),
        **{k: round(v) if isinstance(v, float) else v for k, v in rec.items()},
    }))


if __name__ == "__main__":
    main()
