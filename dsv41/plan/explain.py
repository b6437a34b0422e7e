"""Which assumption a predicted step rests on (``--plan --explain``): the step with each fixed cost
halved and doubled, on the same planned graph and costs (only the latency model is rerun), and the
calibrated step split into its first-principles and fitted parts."""
from __future__ import annotations

from dataclasses import dataclass

from dsv41.plan.calibration import TERMS
from dsv41.plan.latency import FIXED_TERMS, step_latency


@dataclass(frozen=True)
class Sensitivity:
    term: str
    what: str
    half_us: float
    double_us: float


def sensitivity(planned) -> list[Sensitivity]:
    """One row per fixed-cost term, largest swing first."""
    g, costs, dev = planned.plan.graph, planned.costs, planned.device
    rows = []
    for term, what in FIXED_TERMS.items():
        half, double = (step_latency(g, costs, dev, planned.dispatch, planned.imbalance, {term: k},
                                     planned.scheme).step_us
                        for k in (0.5, 2.0))
        rows.append(Sensitivity(term, what, half, double))
    return sorted(rows, key=lambda r: r.half_us - r.double_us)


def explain_lines(rows: list[Sensitivity], step_us: float) -> list[str]:
    """The sensitivity table as printed lines (ms and the change against the predicted step)."""
    out = [f"  sensitivity of the predicted step ({step_us / 1e3:.2f} ms) to each fixed cost:",
           f"  {'term':<11} {'x0.5 (ms)':>10} {'change':>8} {'x2 (ms)':>9} {'change':>8}  what it scales"]
    for r in rows:
        out.append(f"  {r.term:<11} {r.half_us / 1e3:>10.2f} {(r.half_us / step_us - 1) * 100:>+7.1f}% "
                   f"{r.double_us / 1e3:>9.2f} {(r.double_us / step_us - 1) * 100:>+7.1f}%  {r.what}")
    return out


def calibration_lines(cal: dict, detail: bool = False) -> list[str]:
    """The calibrated step (``calibration.calibrated``) as printed lines; ``detail``: one line per
    fitted term with what it stands for."""
    fitted = sum(cal["fitted_us"].values())
    out = [f"  calibrated step {cal['step_us'] / 1e3:.2f} ms = first principles {cal['first_principles_us'] / 1e3:.2f}"
           f" + fitted {fitted / 1e3:.2f} (model {cal['model']}, fitted on {len(cal['fitted_on'])} published "
           f"deployments, docs/plan-validation.md)"]
    if detail:
        for term, us in cal["fitted_us"].items():
            out.append(f"    fitted {term:<6} {us / 1e3:>8.2f} ms  {TERMS[term][3]}")
    return out


def operator_lines(operators: dict[str, str], on_path_us: dict[str, float]) -> list[str]:
    """Where each node kind's time comes from (``operators.coverage``), unmeasured kinds marked, with
    the time each spends on the critical path."""
    unmeasured = [k for k, v in operators.items() if v.startswith("unmeasured")]
    out = [f"  operators: {len(operators) - len(unmeasured)} of {len(operators)} node kinds priced from measured "
           f"entries; {len(unmeasured)} by the roofline fallback (UNMEASURED)"]
    for kind, where in sorted(operators.items(), key=lambda kv: -on_path_us.get(kv[0], 0.0)):
        mark = "UNMEASURED" if where.startswith("unmeasured") else "measured  "
        out.append(f"    {mark} {kind:<22} {on_path_us.get(kind, 0.0) / 1e3:>8.3f} ms on the path  "
                   f"{where.split(': ', 1)[1]}")
    return out
