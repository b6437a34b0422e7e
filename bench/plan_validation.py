"""The plan's predicted decode step against published measured deployments (docs/plan-validation.md).

    python bench/plan_validation.py --features [--replan]  # plan the new rows (every row: 10 s)
    python bench/plan_validation.py --fit [--write] # models compared leaving one deployment out, the best one's
                                                    # constants fitted on every row (--write: calibration.json)
    python bench/plan_validation.py                 # the leave-one-out table of docs/plan-validation.md

The rows are dsv41/plan/deployments.toml (each cited). Each is planned as the model it measured
(its ``card``): DeepSeek-V4.1-Flash on the graph builder (at a layout class the graph can be built
at), DeepSeek-V3/R1 and V4-Flash on their model cards (``dsv41.plan.cards``, at the deployment's own
layout: ``dsv41.plan.card_step`` prices the kernels of one card). Deployments with
speculative decoding (``draft`` tokens verified per step) run 1 + draft rows per request, and the
time per output token is the step over the expected accepted tokens (``calibration.ACCEPT``).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import replace

from dsv41.config import FLASH
from dsv41.capacity import Capacity
from dsv41.plan import calibration as cb
from dsv41.plan.card_step import plan_card
from dsv41.plan.cards import CARDS
from dsv41.plan.roofline import profile
from dsv41.plan.step import run_plan

PARTS = ("compute", "memory", "launch", "sync", "collectives", "host")


def plan_row(m: cb.Deployment) -> dict:
    """The first-principles plan of one row: the features the terms scale, and what the table shows.
    A V4.1-Flash row is planned on its graph, any other on its model card (``dsv41.plan.card_step``)."""
    t0 = time.perf_counter()
    card = CARDS[m.card]
    if card is None:
        cfg, capacity = FLASH, Capacity(decode_rows_per_request=1 + m.draft, max_batch_per_dp=128)
        r, planned = run_plan(cfg, m.topo, m.batch, m.context, device=m.profile, dispatch=m.dispatch,
                              scheme=m.scheme, capacity=capacity)
        dev, layers, hbm = planned.device, cfg.num_hidden_layers, max(c["total_bytes"] for c in r["cards"])
        extra = {"roofline_us": round(r["roofline_step_us"], 3)}
    else:
        dev = profile(m.profile)
        r = plan_card(card, m.tp, m.dp, m.ep, m.batch, m.context, dev, m.draft, m.dispatch, m.scheme, m.precision,
                      m.a2a_format, m.overlap, m.experts_per_rank, m.kv_format)
        layers, hbm = card.layers, int(r["weights_bytes"] + r["cache_bytes"])
        extra = {"kernels": r["kernels"]}
    return {**cb.features(r, layers),
            "critical_path_us": {k: round(r["breakdown_us"][k], 3) for k in PARTS},
            **extra, "moe_imbalance": round(r["moe_imbalance"], 4),
            "hbm_bytes": hbm, "fits_hbm": hbm <= dev.hbm_bytes,
            "device": dev.description, "planned_in_s": round(time.perf_counter() - t0)}


def write_features(rows, replan: bool) -> None:
    """Plan the rows not planned yet (a new measurement), or every row (``replan``: the planner changed)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    old = {} if replan or not cb.PLANNED.exists() else json.loads(cb.PLANNED.read_text())["rows"]
    out = {"note": "first-principles parts of each row's planned step (bench/plan_validation.py --features); "
                   "after any change to the planner: --features --replan, then --fit --write",
           "planner_commit": commit, "rows": {}}
    for m in rows:
        out["rows"][m.label] = old[m.label] if m.label in old else plan_row(m)
        print(f"{m.label}: step {out['rows'][m.label]['step_us'] / 1e3:.2f} ms", flush=True)
    cb.PLANNED.write_text(json.dumps(out, indent=1) + "\n")


def model_lines(rows, planned) -> list[str]:
    """Every model's held-out error (the table that picks the committed model)."""
    out = ["| model | constants | fitted on all (per-token RMS log error) | held out: RMS log error | "
           "held out within ±30% |", "|---|---|---|---|---|"]
    for name, terms in cb.MODELS.items():
        cal = cb.fit(rows, planned, name)
        preds = [cb.predict(r, planned[r.label], cal) for r in rows]
        in_rms = (sum(math.log(p.ratio) ** 2 for p in preds) / len(preds)) ** 0.5
        rms, hits = cb.loo_error(rows, planned, name)
        out.append(f"| {name} | {len(terms)} | {in_rms:.3f} | {rms:.3f} | {hits} of {len(rows)} |")
    return out


def robustness_lines(rows, planned, model: str) -> list[str]:
    """The held-out count under other readings of the data: the sources' own per-token figures where
    a row's is derived otherwise (the best model refitted), and each deployment dropped from the data."""
    out = ["| data | best model (held-out RMS log error) | its held out within ±30% | committed model's held out "
           "within ±30% | committed model's held-out deployments with every row within |", "|---|---|---|---|---|"]
    stated = [replace(r, measured_ms=r.stated_ms) if r.stated_ms else r for r in rows]
    cases = [("as committed", rows), ("stated per-token figures (" + ", ".join(
        f"{r.label} {r.stated_ms:g} ms" for r in rows if r.stated_ms) + ")", stated)]
    cases += [(f"without {d}", [r for r in rows if r.deployment != d])
              for d in dict.fromkeys(r.deployment for r in rows)]
    for name, data in cases:
        best = cb.best_model(data, planned)
        rms, hits = cb.loo_error(data, planned, best)
        mine = [p for p, _ in cb.leave_one_out(data, planned, model)]
        deps, n = cb.deployments_within(mine)
        out.append(f"| {name} | {best} ({rms:.3f}) | {hits} of {len(data)} | {sum(cb.within(p.ratio) for p in mine)} "
                   f"of {len(data)} | {deps} of {n} |")
    return out


def sources_lines(rows) -> list[str]:
    """Where every measured figure was read, and the arithmetic where it is derived."""
    return [f"- **{r.label}** ({r.model}, planned as `{r.card}`{f' {r.precision}' if r.precision else ''}, {r.layout}"
            f"{f', {r.draft} drafts' if r.draft else ''}): {r.source}"
            + (f". Derived: {r.derived}" if r.derived else "")
            + (f". Scheme {r.scheme}: {r.scheme_source}" if r.scheme_source else "")
            + (f". Dispatch sent as {r.a2a_format}: {r.a2a_source}" if r.a2a_source else "")
            + (f". Overlap {r.overlap}: {r.overlap_source}" if r.overlap_source else "")
            + (f". {r.experts_per_rank:g} routed experts a rank: {r.experts_source}" if r.experts_source else "")
            + (f". KV cache {r.kv_format}: {r.kv_source}" if r.kv_source else "")
            for r in rows]


def constants_text(cal: cb.Calibration) -> str:
    return ", ".join(f"{t} {v:.4g} {cb.TERMS[t][1]}" for t, v in cal.constants.items()) or "none"


def alone(m: cb.Deployment, f: dict) -> float:
    """The ``body`` constant that would predict this row exactly: its measured step (per token times
    the tokens a step makes) less the first-principles step, over the body on the critical path."""
    return (m.measured_ms * 1e3 * m.accepted - f["step_us"]) / f["body_us"]


def table_lines(rows, planned, model: str) -> list[str]:
    """The leave-one-out table: every row predicted by constants fitted on the other deployments."""
    out = ["| deployment | stack | device (profile) | planned layout, dispatch, hand-offs | batch / DP group | tokens / step | context | measured per token "
           "| first principles per token | fitted per token (held out) | predicted per token | ratio | within ±30% "
           "| constants fitted without it | body multiplier the row alone needs | critical path, first principles (ms) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p, cal in cb.leave_one_out(rows, planned, model):
        m, f = p.row, planned[p.row.label]
        parts = ", ".join(f"{k} {v / 1e3:.1f}" for k, v in f["critical_path_us"].items() if v >= 50)
        out.append(f"| {m.label} | {m.stack} | {m.profile} | TP{m.tp}/DP{m.dp}/EP{m.ep}, {m.dispatch}, {m.scheme}{'' if m.a2a_format == 'bf16' else f' ({m.a2a_format} dispatch)'}{'' if m.overlap == 'none' else f', {m.overlap}'}{'' if m.kv_format == 'bf16' else f', {m.kv_format} KV'} | {m.batch} x {1 + m.draft} "
                   f"rows | {m.accepted:.2f}{'' if m.accept_length or not m.draft else ' (assumed)'} | {m.context} | {m.measured_ms:.1f} ms | {p.first_principles_ms:.1f} ms "
                   f"| {p.fitted_ms:.1f} ms | {p.predicted_ms:.1f} ms | {p.ratio:.2f} "
                   f"| {'yes' if cb.within(p.ratio) else 'no'} | {constants_text(cal)} | {alone(m, f):.2f} x | {parts} |")
    preds = [p for p, _ in cb.leave_one_out(rows, planned, model)]
    hits, n = cb.deployments_within(preds)
    out.append("")
    out.append(f"Held out within ±30%: **{sum(cb.within(p.ratio) for p in preds)} of {len(rows)} rows**, "
               f"**{hits} of {n} deployments** with every row within (model `{model}`).")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", action="store_true", help="plan every row and write deployments_planned.json")
    ap.add_argument("--replan", action="store_true", help="with --features: replan every row, not only new ones")
    ap.add_argument("--fit", action="store_true", help="compare the models and fit the best on every row")
    ap.add_argument("--write", action="store_true", help="with --fit: write dsv41/plan/calibration.json")
    a = ap.parse_args(argv)
    rows = cb.load_deployments()
    if a.features:
        write_features(rows, a.replan)
        return 0
    planned = cb.load_planned()
    if a.fit:
        print("\n".join(model_lines(rows, planned)))
        model = cb.best_model(rows, planned)
        cal = cb.fit(rows, planned, model)
        cal = cb.Calibration(cal.model, cal.constants, cal.fitted_on, {
            t: f"{cb.TERMS[t][3]}; fitted (bench/plan_validation.py --fit) on dsv41/plan/deployments.toml, "
               f"{len(rows)} rows of {len(cal.fitted_on)} deployments" for t in cal.constants})
        print(json.dumps(cal.to_json(), indent=1))
        if a.write:
            cb.CALIBRATION.write_text(json.dumps(cal.to_json(), indent=1) + "\n")
        return 0
    model = cb.load_calibration().model
    for lines in (table_lines(rows, planned, model), model_lines(rows, planned), robustness_lines(rows, planned, model),
                  sources_lines(rows)):
        print("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
