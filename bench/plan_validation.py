"""The plan's predicted decode step against published measured deployments (docs/plan.md, validation table).

    python bench/plan_validation.py

Every prediction uses the frozen profiles in dsv41/plan/profiles.py unchanged. The graph builder
sizes DeepSeek-V4.1-Flash (FLASH) only: rows measured on DeepSeek-V4-Flash or V3/R1 are predicted
for FLASH at the same device, batch per DP group, context and layout class, and docs/plan.md says
what differs. Deployments without speculative decoding run one row per request
(``decode_rows_per_request=1``); the measured figure is then the time per output token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from dsv41.config import FLASH, Topology
from dsv41.plan.step import run_plan


@dataclass(frozen=True)
class Measured:
    label: str
    model: str
    profile: str
    topo: Topology
    layout: str            # as deployed
    batch: int             # requests per DP group
    context: int
    measured_ms: float
    source: str


ROWS = (
    Measured("Lambda, 8x H100 SXM, vLLM", "V4-Flash (FP8 build)", "h100", Topology(8, 1, 8),
             "TP8 + EP (assumed: not stated)", 32, 8192 + 512, 60.0,
             "lambda.ai/inference-models/deepseek-ai/deepseek-v4-flash: 32 concurrent, 8192 in / 1024 out, "
             "mean ITL 60 ms"),
    Measured("Lambda, 8x B200, vLLM", "V4-Flash (FP4+FP8)", "b200", Topology(8, 1, 8),
             "TP8 + EP (assumed: not stated)", 32, 8192 + 512, 66.0,
             "same page: HGX B200 native FP4+FP8 build, mean ITL 66 ms"),
    Measured("DeepSeek online service, H800", "V3/R1", "h100", Topology(1, 16, 16),
             "DP144 attention / EP144 experts, 18 nodes", 88, 4989, 47.6,
             "DeepSeek Open Source Week day 6 (2025-03-01): 14.8k output tok/s per 8-GPU node, 20-22 tok/s per "
             "user -> ~88 requests per GPU, TPOT ~47.6 ms; mean KV length 4,989 per output token"),
    Measured("CloudMatrix384, Ascend 910C", "R1 (V3 shape), INT8", "a3", Topology(1, 16, 16),
             "DP/EP320 over 320 dies", 48, 4096, 49.4,
             "Zuo et al. arXiv 2506.12708: decode 1,943 tok/s per NPU at batch 96 per NPU (48 per die), 4K KV, "
             "TPOT < 50 ms -> 96 / 1943 = 49.4 ms"),
)


def main():
    cfg = replace(FLASH, decode_rows_per_request=1, max_batch_per_dp=128)
    print("| deployment | model | device (profile) | deployed layout | planned layout | batch / DP group | context "
          "| measured | predicted | ratio | fits HBM | predicted breakdown (critical path, ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in ROWS:
        t0 = time.perf_counter()
        r, planned = run_plan(cfg, m.topo, m.batch, m.context, device=m.profile)
        step = r["predicted_step_us"] / 1e3
        hbm = max(c["total_bytes"] for c in r["cards"])
        parts = ", ".join(f"{k} {v / 1e3:.1f}" for k, v in r["breakdown_us"].items() if v)
        planned_layout = f"TP{m.topo.tp}/DP{m.topo.dp}/EP{m.topo.ep}"
        print(f"| {m.label} | {m.model} | {planned.device.description} ({m.profile}) | {m.layout} | {planned_layout} "
              f"| {m.batch} | {m.context} | {m.measured_ms:.1f} ms | {step:.1f} ms | {step / m.measured_ms:.2f} "
              f"| {'yes' if hbm <= planned.device.hbm_bytes else 'no'} ({hbm / 1e9:.0f} GB) | {parts} |", flush=True)
        print(f"<!-- {m.source}; roofline {r['roofline_step_us'] / 1e3:.1f} ms, floor {r['floor_us'] / 1e3:.1f} ms, "
              f"planned in {time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
