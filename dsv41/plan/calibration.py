"""The plan's calibrated term: what a serving stack spends that first principles do not see (host
scheduling, launch gaps, synchronisation, kernels under their roofline), fitted on published
measured deployments only (docs/plan-validation.md).

A deployment's calibrated step is the first-principles step (``dsv41.plan.latency``) plus a fitted
part, linear in a few of the first-principles step's own quantities (``TERMS``): each term is one
constant times one feature of the planned step. Which terms a calibration uses is its ``model``;
the constants are fitted by least squares on the log error of the time per output token,
each deployment weighing one (rows of one deployment share its weight), each constant at or above
its term's floor (``TERMS``). The measurements are data rows
(``deployments.toml``), their first-principles parts too (``deployments_planned.json``, written by
``bench/plan_validation.py --features``), the fitted constants ``calibration.json``; a new
measurement is a new row and a refit (``bench/plan_validation.py --fit --write``), not a code change.
"""
from __future__ import annotations

import itertools
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsv41.config import Topology
from dsv41.plan.card_step import A2A_FORMATS, KV_FORMATS, OVERLAPS, PRECISION
from dsv41.plan.cards import CARDS
from dsv41.plan.latency import DISPATCH, SCHEMES

HERE = Path(__file__).parent
DEPLOYMENTS = HERE / "deployments.toml"
PLANNED = HERE / "deployments_planned.json"
CALIBRATION = HERE / "calibration.json"

# a speculative row's drafts: each accepted with this chance given the ones before it were, the low
# end of the 85-90% second-token acceptance of the DeepSeek-V3 technical report (arXiv 2412.19437,
# section 5.4.3); the same chance for the later drafts is an assumption
ACCEPT = 0.85

# term -> (feature of the planned step, unit of its constant, its floor, the physical cause it stands for).
# Each term scales one named part of the first-principles step, so a fitted constant says which cost
# the stack pays more (or less) of than modelled; there is no term that scales the whole step. A
# multiplicative term may shrink its part (the first-principles fixed costs are assumptions a stack
# can beat) down to a tenth of it; the per-step and per-layer terms only add.
TERMS = {
    "body": ("body_us", "x", -0.9, "kernels off their modelled rate: the body (compute + memory) on the critical "
                                   "path, times the constant (1 / efficiency - 1)"),
    "launch": ("launch_us", "x", -0.9, "launch gaps between kernels against the modelled gap: the launch time on the "
                                       "critical path, times the constant"),
    "sync": ("sync_us", "x", -0.9, "synchronisation against the modelled: the hand-offs' fixed costs and the token "
                                   "sync on the critical path, times the constant"),
    "host": ("steps", "us", 0.0, "host scheduling per step that the stack does not overlap with the device"),
    "layer": ("layers", "us", 0.0, "fixed overhead per layer per step (scheduling, launch gaps, syncs not modelled)"),
}
# the models compared by leaving one deployment out (docs/plan-validation.md); the committed
# calibration's model is the one with the smallest held-out error among them
MODELS = {
    "none": (), "body": ("body",), "launch": ("launch",), "sync": ("sync",), "host": ("host",), "layer": ("layer",),
    "launch+sync": ("launch", "sync"), "body+host": ("body", "host"), "body+layer": ("body", "layer"),
    "launch+host": ("launch", "host"), "sync+host": ("sync", "host"), "body+launch": ("body", "launch"),
    "body+sync": ("body", "sync"), "launch+sync+host": ("launch", "sync", "host"),
    "body+launch+sync": ("body", "launch", "sync"),
}
_ROW_KEYS = {"label": str, "deployment": str, "model": str, "card": str, "stack": str, "profile": str, "layout": str,
             "tp": int, "dp": int, "ep": int, "batch": int, "context": int, "measured_ms": (int, float),
             "source": str}
_OPTIONAL = {"draft": int, "derived": str, "stated_ms": (int, float), "accept_length": (int, float), "dispatch": str,
             "scheme": str, "scheme_source": str, "precision": str, "a2a_format": str, "a2a_source": str,
             "overlap": str, "overlap_source": str, "experts_per_rank": (int, float), "experts_source": str,
             "kv_format": str, "kv_source": str}


@dataclass(frozen=True)
class Deployment:
    """One published measurement: what was deployed, the layout the plan uses for it, and the
    measured time per output token."""
    label: str
    deployment: str        # rows sharing it are one deployment, left out together
    model: str             # what the source says was served
    card: str              # the model it is planned as (dsv41.plan.cards.CARDS): "v41-flash" on its graph
    stack: str
    profile: str
    layout: str
    tp: int
    dp: int
    ep: int
    batch: int             # requests per DP group
    context: int
    measured_ms: float     # time per output token
    source: str
    draft: int = 0         # speculative tokens verified per step
    derived: str = ""
    stated_ms: float = 0.0  # the source's own per-token figure where measured_ms is derived otherwise
    accept_length: float = 0.0  # measured tokens a request makes per verify step (0: not published)
    dispatch: str = "graph"     # how the stack issues a step's kernels (dsv41.plan.latency.DISPATCH): "eager"
                                # where the source says it runs without a captured graph
    scheme: str = "all_to_all"  # how the stack hands data between cards (dsv41.plan.latency.SCHEMES): "all_reduce"
                                # for TP attention with the experts' sums all-reduced (no all-to-all backend)
    scheme_source: str = ""     # where the stack's code or command says so (required with a scheme)
    precision: str = ""         # a card's weight formats (dsv41.plan.card_step.PRECISION); the graph sizes its own
    a2a_format: str = "bf16"    # what the stack's dispatch sends a token as (dsv41.plan.card_step.A2A_FORMATS)
    a2a_source: str = ""        # where the stack's code or report says so (required with a format)
    overlap: str = "none"       # how the stack overlaps its all-to-all with compute (card_step.OVERLAPS)
    overlap_source: str = ""    # where the deployment's source says it runs so (required with an overlap)
    experts_per_rank: float = 0.0  # routed experts an EP rank holds where the source states it (replicas counted)
    experts_source: str = ""    # where it is stated (required with experts_per_rank)
    kv_format: str = "bf16"     # MLA's latent cache format (dsv41.plan.card_step.KV_FORMATS)
    kv_source: str = ""         # where the stack's command says so (required with a format)

    @property
    def topo(self) -> Topology:
        return Topology(self.tp, self.dp, self.ep)

    @property
    def accepted(self) -> float:
        """Tokens a request makes per step: the measured acceptance length where the source gives
        one, else the expected 1 + p + ... + p^draft."""
        return self.accept_length or sum(ACCEPT ** i for i in range(self.draft + 1))


def load_deployments(path: Path = DEPLOYMENTS) -> tuple[Deployment, ...]:
    """The measured rows, each field checked (a bad row names its index and field)."""
    rows = tomllib.loads(Path(path).read_text()).get("row", [])
    if not rows:
        raise ValueError(f"{path}: no [[row]] tables")
    out = []
    for i, row in enumerate(rows):
        extra = set(row) - set(_ROW_KEYS) - set(_OPTIONAL)
        if extra:
            raise ValueError(f"{path}: row[{i}]: unknown keys {sorted(extra)}; allowed {sorted({**_ROW_KEYS, **_OPTIONAL})}")
        for k, kind in {**_ROW_KEYS, **_OPTIONAL}.items():
            if k not in row and k in _ROW_KEYS:
                raise ValueError(f"{path}: row[{i}]: missing {k}")
            if k in row and (not isinstance(row[k], kind) or isinstance(row[k], bool)):
                raise ValueError(f"{path}: row[{i}].{k}: must be {getattr(kind, '__name__', 'a number')}, got {row[k]!r}")
        if not row["measured_ms"] > 0 or row.get("draft", 0) < 0:
            raise ValueError(f"{path}: row[{i}]: measured_ms must be > 0 and draft >= 0")
        if row.get("dispatch", "graph") not in DISPATCH:
            raise ValueError(f"{path}: row[{i}].dispatch: must be one of {list(DISPATCH)}, got {row['dispatch']!r}")
        if row.get("scheme", "all_to_all") not in SCHEMES or (row.get("scheme") == "all_reduce" and row["dp"] != 1):
            raise ValueError(f"{path}: row[{i}].scheme: must be one of {list(SCHEMES)} (all_reduce with dp = 1), "
                             f"got {row['scheme']!r}")
        if row["card"] not in CARDS:
            raise ValueError(f"{path}: row[{i}].card: must be one of {list(CARDS)}, got {row['card']!r}")
        if (CARDS[row["card"]] is None) == (row.get("precision") in PRECISION):
            raise ValueError(f"{path}: row[{i}].precision: one of {list(PRECISION)} for a card other than "
                             f"v41-flash (whose graph sizes its own formats), none for it; got {row.get('precision')!r}")
        if ("scheme" in row) != ("scheme_source" in row):
            raise ValueError(f"{path}: row[{i}]: scheme and scheme_source go together (the scheme is cited)")
        if ("experts_per_rank" in row) != bool(row.get("experts_source")) or (
                "experts_per_rank" in row and (CARDS[row["card"]] is None or row.get("scheme", "all_to_all") != "all_to_all"
                                               or row["experts_per_rank"] < CARDS[row["card"]].n_routed / row["ep"])):
            raise ValueError(f"{path}: row[{i}].experts_per_rank: the routed experts an EP rank holds, at least "
                             f"n_routed / ep, on a model-card row under all_to_all, with experts_source")
        for key, allowed in (("a2a_format", A2A_FORMATS), ("overlap", OVERLAPS)):
            if key not in row:
                continue
            source = "a2a_source" if key == "a2a_format" else "overlap_source"
            if row[key] not in allowed or CARDS[row["card"]] is None or row.get("scheme", "all_to_all") != "all_to_all":
                raise ValueError(f"{path}: row[{i}].{key}: one of {list(allowed)}, on a model-card row under the "
                                 f"all_to_all scheme; got {row[key]!r} (card {row['card']!r})")
            if not row.get(source):
                raise ValueError(f"{path}: row[{i}]: {key} needs {source} (where the deployment says it runs so)")
        for key, source in (("a2a_format", "a2a_source"), ("overlap", "overlap_source")):
            if source in row and key not in row:
                raise ValueError(f"{path}: row[{i}]: {source} without {key}")
        if ("kv_format" in row) != bool(row.get("kv_source")) or ("kv_format" in row and (
                row["kv_format"] not in KV_FORMATS or CARDS[row["card"]] is None
                or CARDS[row["card"]].attention != "mla")):
            raise ValueError(f"{path}: row[{i}].kv_format: one of {list(KV_FORMATS)}, on a model-card row with MLA's "
                             f"latent cache, with kv_source; got {row.get('kv_format')!r} (card {row['card']!r})")
        if not 0 <= row.get("accept_length", 0) <= row.get("draft", 0) + 1:
            raise ValueError(f"{path}: row[{i}].accept_length: must be in [1, draft + 1], got {row['accept_length']!r}")
        out.append(Deployment(**row))
    return tuple(out)


def features(report: dict, layers: int) -> dict[str, float]:
    """The first-principles quantities of one planned step the terms scale (µs, or a count)."""
    return _parts(report["predicted_step_us"], report["breakdown_us"], layers)


def _parts(step_us: float, b: dict, layers: int) -> dict[str, float]:
    return {"step_us": step_us, "body_us": b["compute"] + b["memory"], "launch_us": b["launch"],
            "sync_us": b["sync"], "fixed_us": b["launch"] + b["sync"] + b["host"], "layers": float(layers),
            "steps": 1.0}


def load_planned(path: Path = PLANNED) -> dict[str, dict[str, float]]:
    """Row label -> its planned step's features, as ``bench/plan_validation.py --features`` wrote them."""
    rows = json.loads(Path(path).read_text())["rows"]
    return {k: {**_parts(r["step_us"], r["critical_path_us"], int(r["layers"])), **r} for k, r in rows.items()}


@dataclass(frozen=True)
class Calibration:
    """The fitted term: ``model`` names the terms, ``constants`` their values (unit in ``TERMS``)."""
    model: str
    constants: dict
    fitted_on: tuple = ()
    sources: dict = field(default_factory=dict)

    def parts_us(self, feats: dict[str, float]) -> dict[str, float]:
        """Term -> its fitted µs for a step with these features."""
        return {t: self.constants[t] * feats[TERMS[t][0]] for t in MODELS[self.model]}

    def to_json(self) -> dict:
        return {"model": self.model, "constants": {k: round(v, 6) for k, v in self.constants.items()},
                "fitted_on": list(self.fitted_on), "sources": self.sources}


def load_calibration(path: Path = CALIBRATION) -> Calibration:
    raw = json.loads(Path(path).read_text())
    if raw.get("model") not in MODELS:
        raise ValueError(f"{path}: model: must be one of {list(MODELS)}, got {raw.get('model')!r}")
    missing = set(MODELS[raw["model"]]) - set(raw.get("constants", {}))
    if missing:
        raise ValueError(f"{path}: constants: missing {sorted(missing)} for model {raw['model']!r}")
    return Calibration(raw["model"], {k: float(v) for k, v in raw["constants"].items()},
                       tuple(raw.get("fitted_on", ())), raw.get("sources", {}))


def _bounded_lstsq(a: np.ndarray, b: np.ndarray, floor: np.ndarray) -> np.ndarray:
    """min |a x - b|^2 with x >= floor, by trying every set of constants left free (the others at
    their floor; a handful of constants at most)."""
    n = a.shape[1]
    rest = b - a @ floor
    best, best_err = floor.copy(), float(rest @ rest)
    for k in range(1, n + 1):
        for free in itertools.combinations(range(n), k):
            x = floor.copy()
            x[list(free)] += np.linalg.lstsq(a[:, free], rest, rcond=None)[0]
            if (x < floor).any():
                continue
            err = float(np.sum((a @ x - b) ** 2))
            if err < best_err - 1e-15:
                best, best_err = x, err
    return best


def fit(rows, planned: dict, model: str) -> Calibration:
    """Constants of ``model`` minimising the deployment-weighted squared log error of the predicted
    time per output token against the measured one (a prediction twice too slow weighs what one
    twice too fast does): Gauss-Newton from the least-squares fit on the relative error, each step
    kept within the floors and halved until the error falls."""
    terms = MODELS[model]
    if not rows:
        raise ValueError("fit: no rows")
    per = {}
    for r in rows:
        per[r.deployment] = per.get(r.deployment, 0) + 1
    if not terms:
        return Calibration(model, {}, tuple(sorted(per)))
    w = np.sqrt([1.0 / per[r.deployment] for r in rows])
    base = np.array([planned[r.label]["step_us"] for r in rows])
    feats = np.array([[planned[r.label][TERMS[t][0]] for t in terms] for r in rows])
    measured = np.array([r.accepted * r.measured_ms * 1e3 for r in rows])    # per step, µs
    floor = np.array([TERMS[t][2] for t in terms])
    x = _bounded_lstsq(w[:, None] * feats / measured[:, None], w * (1.0 - base / measured), floor)

    def residual(x):
        pred = base + feats @ x
        return w * np.log(pred / measured), pred

    r, pred = residual(x)
    for _ in range(100):
        jac = w[:, None] * feats / pred[:, None]
        step = _bounded_lstsq(jac, -r, floor - x)
        for _ in range(30):
            trial = x + step
            if (base + feats @ trial > 0).all():
                r_new, pred_new = residual(trial)
                if r_new @ r_new < r @ r - 1e-15:
                    x, r, pred = trial, r_new, pred_new
                    break
            step = step / 2
        else:
            break
    return Calibration(model, dict(zip(terms, map(float, x))), tuple(sorted(per)))


@dataclass(frozen=True)
class Prediction:
    row: Deployment
    first_principles_ms: float   # per output token
    fitted_ms: float             # per output token

    @property
    def predicted_ms(self) -> float:
        return self.first_principles_ms + self.fitted_ms

    @property
    def ratio(self) -> float:
        return self.predicted_ms / self.row.measured_ms


def predict(row: Deployment, feats: dict, cal: Calibration) -> Prediction:
    fitted = sum(cal.parts_us(feats).values())
    return Prediction(row, feats["step_us"] / row.accepted / 1e3, fitted / row.accepted / 1e3)


def leave_one_out(rows, planned: dict, model: str) -> list[tuple[Prediction, Calibration]]:
    """Each row predicted by the constants fitted on every other deployment (its own deployment's
    rows left out with it)."""
    fits = {}
    for r in rows:
        if r.deployment not in fits:
            fits[r.deployment] = fit([o for o in rows if o.deployment != r.deployment], planned, model)
    return [(predict(r, planned[r.label], fits[r.deployment]), fits[r.deployment]) for r in rows]


def loo_error(rows, planned: dict, model: str) -> tuple[float, int]:
    """RMS of log(predicted / measured) over the held-out rows, and how many are within ±30%."""
    preds = [p for p, _ in leave_one_out(rows, planned, model)]
    rms = math.sqrt(sum(math.log(p.ratio) ** 2 for p in preds) / len(preds))
    return rms, sum(within(p.ratio) for p in preds)


def deployments_within(preds) -> tuple[int, int]:
    """Of held-out predictions, how many deployments have every row within ±30%, and how many there are."""
    ok = {}
    for p in preds:
        ok[p.row.deployment] = ok.get(p.row.deployment, True) and within(p.ratio)
    return sum(ok.values()), len(ok)


def within(ratio: float, band: float = 0.3) -> bool:
    return 1 - band <= ratio <= 1 + band


def best_model(rows, planned: dict) -> str:
    """The model with the smallest held-out RMS log error (ties: fewer terms)."""
    return min(MODELS, key=lambda m: (round(loo_error(rows, planned, m)[0], 9), len(MODELS[m])))


def synthetic(rows, planned: dict, model: str, constants: dict, noise: float, seed: int):
    """Rows whose measurement is what ``constants`` would predict, times a log-normal error of
    ``noise`` (the synthetic check that the fit recovers known constants)."""
    rng = np.random.default_rng(seed)
    cal = Calibration(model, constants)
    out = []
    for r in rows:
        p = predict(r, planned[r.label], cal)
        out.append(Deployment(**{**r.__dict__, "measured_ms": p.predicted_ms * float(np.exp(rng.normal(0, noise)))}))
    return out


def calibrated(report: dict, layers: int, cal: Calibration | None = None) -> dict:
    """The first-principles step of a plan report, the fitted part by term, and their sum (µs)."""
    cal = cal or load_calibration()
    parts = cal.parts_us(features(report, layers))
    return {"first_principles_us": report["predicted_step_us"], "fitted_us": parts,
            "step_us": report["predicted_step_us"] + sum(parts.values()), "model": cal.model,
            "fitted_on": list(cal.fitted_on)}
