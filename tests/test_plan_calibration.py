"""The plan's calibrated term: reproducible from the committed rows, its leave-one-out table the
doc's, known constants recovered from synthetic measurements, and the plan CLI showing both parts."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from dsv41.cli import run
from dsv41.plan import calibration as cb

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("plan_validation", ROOT / "bench" / "plan_validation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def data():
    return cb.load_deployments(), cb.load_planned()


def test_every_row_is_cited_and_planned(data):
    rows, planned = data
    assert len({r.label for r in rows}) == len(rows)
    for r in rows:
        assert r.source and r.measured_ms > 0 and r.label in planned
        assert {"step_us", "body_us", "fixed_us", "layers"} <= set(planned[r.label])


def test_the_fit_reproduces_the_committed_constants(data):
    """``bench/plan_validation.py --fit`` from the committed rows gives calibration.json: the model
    it picks and every constant."""
    rows, planned = data
    committed = cb.load_calibration()
    assert cb.best_model(rows, planned) == committed.model
    refit = cb.fit(rows, planned, committed.model)
    assert refit.fitted_on == committed.fitted_on
    assert refit.constants.keys() == committed.constants.keys()
    for term, value in refit.constants.items():
        assert round(value, 6) == pytest.approx(committed.constants[term], abs=1e-6)
        assert term in committed.sources


def test_the_leave_one_out_table_is_the_docs(data):
    """The leave-one-out table, the model comparison, the other readings and the sources in
    docs/plan-validation.md are what the committed data give."""
    rows, planned = data
    bench = _bench()
    doc = (ROOT / "docs" / "plan-validation.md").read_text()
    model = cb.load_calibration().model
    for lines in (bench.table_lines(rows, planned, model), bench.model_lines(rows, planned),
                  bench.robustness_lines(rows, planned, model), bench.sources_lines(rows)):
        block = "\n".join(lines)
        assert block in doc, f"docs/plan-validation.md is stale; regenerate with bench/plan_validation.py:\n{block}"


def test_a_held_out_row_never_sees_its_own_deployment(data):
    rows, planned = data
    for p, cal in cb.leave_one_out(rows, planned, "body+layer"):
        assert p.row.deployment not in cal.fitted_on
        assert set(cal.fitted_on) == {r.deployment for r in rows} - {p.row.deployment}


def test_a_deployment_counts_only_with_every_row_within(data):
    """A deployment is within when all its held-out rows are: 1.0 and 1.31 is out (one row past
    +30%), a lone 0.75 is in; ratio = (first principles + fitted) / measured."""
    rows, _ = data
    r = rows[0]
    preds = [cb.Prediction(cb.Deployment(**{**r.__dict__, "deployment": d, "measured_ms": 1.0}), fp, 0.0)
             for d, fp in (("a", 1.0), ("a", 1.31), ("b", 0.75))]
    assert cb.deployments_within(preds) == (1, 2)
    assert cb.deployments_within(preds[:1] + preds[2:]) == (2, 2)


@pytest.mark.parametrize("model, constants", [("body+layer", {"body": 0.8, "layer": 300.0}),
                                              ("launch+sync", {"launch": 2.5, "sync": 0.4}),
                                              ("body+host", {"body": 0.3, "host": 900.0})])
def test_synthetic_measurements_recover_known_constants(data, model, constants):
    """Measurements made from known constants are fitted back exactly without noise, and within a
    few percent with 2% log-normal noise over 400 rows (here within 2.2%: body and layer trade against each other)."""
    rows, planned = data
    exact = cb.fit(cb.synthetic(rows, planned, model, constants, 0.0, seed=0), planned, model)
    assert exact.constants == pytest.approx(constants, rel=1e-9)
    rng = np.random.default_rng(1)
    many_planned, many_rows = {}, []
    for i in range(400):
        r = rows[i % len(rows)]
        label = f"{r.label} #{i}"
        step = rng.uniform(5e3, 40e3)
        body = step * rng.uniform(0.2, 0.8)
        launch = (step - body) * rng.uniform(0.2, 0.8)
        many_planned[label] = {"step_us": step, "body_us": body, "fixed_us": step - body, "launch_us": launch,
                               "sync_us": step - body - launch, "steps": 1.0, "layers": float(rng.choice([40, 61]))}
        many_rows.append(cb.Deployment(**{**r.__dict__, "label": label, "deployment": label}))
    noisy = cb.fit(cb.synthetic(many_rows, many_planned, model, constants, 0.02, seed=2), many_planned, model)
    assert noisy.constants == pytest.approx(constants, rel=0.05)


def test_constants_stay_at_or_above_their_floors(data):
    """A stack measured at a tenth of the first-principles step: the terms that add (per step, per
    layer: floor 0) cannot go negative to get there, the multiplicative ones stop at a tenth of their part."""
    rows, planned = data
    fast = [cb.Deployment(**{**r.__dict__, "measured_ms": 0.1 * planned[r.label]["step_us"] / 1e3 / r.accepted})
            for r in rows]
    assert cb.fit(fast, planned, "layer").constants == {"layer": 0.0}
    assert cb.fit(fast, planned, "host").constants == {"host": 0.0}
    slow = cb.fit(fast, planned, "body+launch+sync").constants
    assert all(v >= cb.TERMS[t][2] - 1e-12 for t, v in slow.items())
    assert min(slow.values()) == pytest.approx(-0.9)


def test_no_term_scales_the_whole_step():
    """Every fitted term names one part of the step or a count (its physical cause), none the whole step."""
    for term, (feature, unit, _, cause) in cb.TERMS.items():
        assert feature != "step_us" and cause
        assert feature in {"body_us", "launch_us", "sync_us", "steps", "layers"}
    assert all(set(terms) <= set(cb.TERMS) for terms in cb.MODELS.values())


def _refused(tmp_path, text: str, match: str) -> None:
    """deployments.toml holding ``text`` is refused with a message matching ``match``."""
    (tmp_path / "d.toml").write_text(text)
    with pytest.raises(ValueError, match=match):
        cb.load_deployments(tmp_path / "d.toml")


def test_a_bad_row_names_its_field(tmp_path):
    _refused(tmp_path, '[[row]]\nlabel = "x"\n', r"row\[0\]: missing deployment")
    good = cb.DEPLOYMENTS.read_text().split("\n[[row]]\n")[1]
    _refused(tmp_path, "[[row]]\n" + good.replace("batch = 32", 'batch = "32"'), r"row\[0\]\.batch: must be int")
    _refused(tmp_path, "[[row]]\n" + good + 'dispatch = "cuda"\n',
             r"row\[0\]\.dispatch: must be one of \['graph', 'eager'\]")
    _refused(tmp_path, "[[row]]\n" + good.replace('card = "v4-flash"', 'card = "v5"'),
             r"row\[0\]\.card: must be one of")
    _refused(tmp_path, "[[row]]\n" + good.replace('precision = "fp8"\n', ''), r"row\[0\]\.precision: one of")
    dp16 = next(r for r in cb.DEPLOYMENTS.read_text().split("\n[[row]]\n")[1:] if "dp = 144" in r and "scheme" not in r)
    _refused(tmp_path, "[[row]]\n" + dp16 + 'scheme = "all_to_all"\n',
             r"row\[0\]: scheme and scheme_source go together")
    _refused(tmp_path, "[[row]]\n" + dp16 + 'scheme = "all_reduce"\nscheme_source = "x"\n',
             r"row\[0\]\.scheme: must be one of")


def test_a_stack_term_is_cited_and_on_a_row_that_has_it(tmp_path):
    """An overlap, a dispatch format or a stated expert count needs its source, and goes only on a
    model-card row under the all_to_all scheme (the graph path and the all_reduce scheme have no
    dispatch to split or to send in FP8)."""
    rows = cb.DEPLOYMENTS.read_text().split("\n[[row]]\n")[1:]
    deepseek = next(r for r in rows if 'deployment = "deepseek-h800"' in r)
    bare = "\n".join(line for line in deepseek.splitlines() if not line.startswith("overlap_source"))
    _refused(tmp_path, "[[row]]\n" + bare + "\n", r"row\[0\]: overlap needs overlap_source")
    bare = "\n".join(line for line in deepseek.splitlines() if not line.startswith("experts_source"))
    _refused(tmp_path, "[[row]]\n" + bare + "\n", r"row\[0\]\.experts_per_rank")
    tp_row = next(r for r in rows if 'scheme = "all_reduce"' in r and 'card = "v3"' in r)
    _refused(tmp_path, "[[row]]\n" + tp_row + 'a2a_format = "fp8"\na2a_source = "x"\n', r"row\[0\]\.a2a_format: one of")
    graph_row = next(r for r in rows if 'card = "v41-flash"' in r).replace('scheme = "all_reduce"\n', "")
    graph_row = "\n".join(line for line in graph_row.splitlines() if not line.startswith("scheme_source"))
    _refused(tmp_path, "[[row]]\n" + graph_row + '\noverlap = "tbo"\noverlap_source = "x"\n',
             r"row\[0\]\.overlap: one of \['none', 'tbo'\]")
    lambda_row = next(r for r in rows if 'card = "v4-flash"' in r)
    _refused(tmp_path, "[[row]]\n" + lambda_row + 'kv_format = "fp8"\nkv_source = "x"\n',
             r"row\[0\]\.kv_format: one of \['bf16', 'fp8'\], on a model-card row with MLA")
    _refused(tmp_path, "[[row]]\n" + tp_row + 'kv_format = "fp8"\n', r"row\[0\]\.kv_format")
    loaded = {r.deployment: r for r in cb.load_deployments()}
    assert (loaded["deepseek-h800"].overlap, loaded["deepseek-h800"].a2a_format) == ("tbo", "fp8")


def test_cli_shows_first_principles_and_fitted_parts(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = ["--config", "tiny", "--plan", "--tp", "2", "--dp", "1", "--batch", "2", "--context", "256",
            "--device-profile", "a3"]
    assert run.main(base + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)["plan"]
    cal, committed = out["calibrated"], cb.load_calibration()
    assert cal["first_principles_us"] == out["predicted_step_us"]
    assert cal["step_us"] == pytest.approx(cal["first_principles_us"] + sum(cal["fitted_us"].values()))
    assert set(cal["fitted_us"]) == set(cb.MODELS[committed.model]) and cal["model"] == committed.model
    assert run.main(base + ["--explain"]) == 0
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert "calibrated step" in text and "first principles" in text
    assert all(f"fitted {t}" in text for t in cal["fitted_us"])
    assert run.main(["--config", "tiny", "--plan", "--tp", "2", "--dp", "1", "--batch", "2", "--context", "256",
                     "--device-profile", "cpu", "--json"]) == 0
    assert "calibrated" not in json.loads(capsys.readouterr().out)["plan"]     # measured here, not fitted


def test_the_committed_card_features_are_what_the_card_step_gives(data):
    """Every row planned on a model card (milliseconds each) gives its committed features."""
    rows, planned = data
    bench = _bench()
    cards = [r for r in rows if r.card != "v41-flash"]
    assert {r.card for r in cards} == {"v3", "v4-flash"}
    for row in cards:
        fresh = bench.plan_row(row)
        for k in ("step_us", "body_us", "fixed_us", "layers"):
            assert fresh[k] == pytest.approx(planned[row.label][k], rel=1e-9), (row.label, k)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_committed_features_are_what_the_planner_gives(data):
    """deployments_planned.json is the current planner's (else replan and refit): one graph row replanned."""
    rows, planned = data
    row = min((r for r in rows if r.card == "v41-flash"), key=lambda r: r.tp * r.dp)
    fresh = _bench().plan_row(row)
    for k in ("step_us", "body_us", "fixed_us", "layers"):
        assert fresh[k] == pytest.approx(planned[row.label][k], rel=1e-6), k
    assert math.isfinite(fresh["step_us"])
