"""Per-operator device profiles (``dsv41.plan.operators``): the fit through measured points, every
node kind priced from a measured entry or reported unmeasured, a profile file's round trip, and a
bad entry refused in one line that names it."""
from __future__ import annotations

import json

import pytest

from dsv41.cli import run
from dsv41.config import TINY, Topology
from dsv41.kernels.kinds import KINDS
from dsv41.plan.operators import Point, fit
from dsv41.plan.profile_file import load_profile, profile_dict
from dsv41.plan.profiles import PROFILES
from dsv41.plan.step import run_plan

ROOF = (1e-6, 1e-9, 0.0)        # µs per byte, per FLOP, per value: what unpinned terms fall back to


def _pt(calls, nbytes, flops, us, values=0.0):
    return Point(calls, nbytes, flops, values, us, f"{nbytes:g} B", "a test's own numbers")


def test_the_fit_recovers_known_terms_from_enough_shapes():
    fixed, per_byte, per_flop = 7.0, 2e-6, 5e-9
    pts = [_pt(c, b, f, c * fixed + b * per_byte + f * per_flop)
           for c, b, f in ((1, 1e6, 1e9), (2, 3e6, 1e9), (4, 1e6, 8e9), (3, 5e6, 2e9))]
    op = fit("attn.q_proj", pts, ROOF)
    assert op.fixed_us == pytest.approx(fixed) and op.us_per_byte == pytest.approx(per_byte)
    assert op.us_per_flop == pytest.approx(per_flop)
    assert set(op.pinned) >= {"calls", "bytes", "flops"}
    assert op.us(2e6, 3e9, 0.0)[0] == pytest.approx(fixed + 2e6 * per_byte + 3e9 * per_flop)


def test_one_point_fixes_the_fixed_part_and_the_roofline_extrapolates():
    # 14.83 µs for a call moving 4 MB (4 µs at the fallback's 1 TB/s) and 8 MFLOP (8 ns): fixed 10.82 µs
    op = fit("attn.kv_proj", [_pt(1, 4e6, 8e6, 14.83)], ROOF)
    assert op.pinned == ("calls",)
    assert op.fixed_us == pytest.approx(14.83 - 4.0 - 0.008)
    assert op.us_per_byte == ROOF[0] and op.us_per_flop == ROOF[1]
    assert op.us(8e6, 8e6, 0.0)[0] == pytest.approx(op.fixed_us + 8.0 + 0.008)
    # a point of half a node (the node runs two such calls): the node's fixed part is twice the call's
    two = fit("attn.q_proj", [_pt(0.5, 4e6, 8e6, 14.83)], ROOF)
    assert two.fixed_us == pytest.approx(2 * (14.83 - 4.008))
    # never negative: a point faster than the roofline leaves no fixed part
    assert fit("norm.rms", [_pt(1, 4e6, 0, 1.0)], ROOF).fixed_us == 0.0


def _profile_file(tmp_path, operators: dict, base: str = "a5") -> str:
    f = tmp_path / "ops.json"
    f.write_text(json.dumps({"base": base, "operators": operators}))
    return str(f)


def _point(**kw):
    row = {"calls": 1, "bytes": 1e6, "flops": 1e6, "values": 0, "us": 500.0, "shape": "[1, 64]", "source": "measured"}
    return {**row, **kw}


def test_every_node_kind_is_priced_from_an_entry_or_reported_unmeasured(tmp_path, capsys, monkeypatch):
    path = _profile_file(tmp_path, {"attn.q_proj": [_point()], "moe.gate": [_point(us=80.0, source="bench X")]})
    report, planned = run_plan(TINY, Topology(2, 1, 2), 2, 64, device=path)
    kinds = {n.kernel for n in planned.plan.graph.nodes.values()}
    assert set(report["operators"]) == kinds and kinds <= set(KINDS)
    assert report["operators"]["attn.q_proj"] == "measured: measured"
    assert report["operators"]["moe.gate"] == "measured: bench X"
    assert all(v == "unmeasured: roofline fallback" for k, v in report["operators"].items()
               if k not in ("attn.q_proj", "moe.gate"))
    # the measured entry prices its nodes: 500 µs at its own shape, less the roofline's share of it
    op = planned.device.operators["attn.q_proj"]
    for key, node in planned.plan.graph.nodes.items():
        if node.kernel == "attn.q_proj":
            c = planned.costs[key]
            body = op.us(c.bytes_read + c.bytes_written, sum(c.flops.values()), 0.0)[0]
            assert planned.latency.parts[key].body == pytest.approx(body) and body > 490
    # --explain names every kind, the unmeasured ones marked
    monkeypatch.chdir(tmp_path)
    assert run.main(["--config", "tiny", "--plan", "--tp", "2", "--dp", "1", "--batch", "2", "--context", "64",
                     "--device-profile", path, "--explain"]) == 0
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert f"operators: 2 of {len(kinds)} node kinds priced from measured entries" in text
    assert "measured   attn.q_proj" in text and "UNMEASURED norm.rms" in text
    for kind in kinds:
        assert f" {kind} " in text


@pytest.mark.parametrize("name, base", [("a5-pr", None), ("a5-pr", "a5"), ("h100", None), ("cpu", "cpu-avx2")])
def test_a_profile_file_round_trips(tmp_path, name, base):
    dev = PROFILES[name]
    f = tmp_path / "p.json"
    f.write_text(json.dumps(profile_dict(dev, base)))
    back = load_profile(f)
    assert back == dev
    f.write_text(json.dumps(profile_dict(back, base)))      # and again: the file is a fixed point
    assert load_profile(f) == dev


def test_a5_pr_prices_the_linears_from_1054_and_leaves_the_rest_marked():
    dev = PROFILES["a5-pr"]
    assert set(dev.operators) == {"attn.q_proj", "attn.kv_proj", "attn.o_proj", "moe.shared"}
    assert all("pypto-lib issue #1054" in op.source for op in dev.operators.values())
    # one matmul of the measured shape: its 14.83 µs back
    qbmm = 4096 + 1024 * 4096 + 1024 * 64 * 2 + 1024 * 2
    assert dev.operators["attn.kv_proj"].us(qbmm, 2 * 4096 * 1024, 0.0)[0] == pytest.approx(14.83)
    assert dev.intra.a2a.at(8).alpha_us == 43.03


@pytest.mark.parametrize("operators, named", [
    ({"attn.q_proj": [_point(us=-3)]}, r"operators\.attn\.q_proj\[0\]\.us: must be a number in \[0, 1e\+09\]"),
    ({"attn.q_proj": [_point(us=0)]}, r"operators\.attn\.q_proj\[0\]\.us: must be a number in \(0, 1e\+09\]"),
    ({"attn.q_proj": [_point(), _point(bytes="big")]}, r"operators\.attn\.q_proj\[1\]\.bytes: must be a number"),
    ({"attn.q_proj": [_point(source="")]}, r"operators\.attn\.q_proj\[0\]\.source: must be a non-empty string"),
    ({"attn.q_proj": [{"calls": 1, "us": 3.0}]}, r"operators\.attn\.q_proj\[0\]: missing keys"),
    ({"attn.q_proj": []}, r"operators\.attn\.q_proj: must be a non-empty list"),
    ({"attn.qproj": [_point()]}, r"operators\.attn\.qproj: unknown node kind"),
    ({"attn.q_proj": [_point(speed=2)]}, r"operators\.attn\.q_proj\[0\]: unknown keys \['speed'\]"),
])
def test_a_bad_entry_is_one_line_naming_it(tmp_path, operators, named):
    path = _profile_file(tmp_path, operators)
    with pytest.raises(ValueError, match=named) as e:
        load_profile(path)
    assert "\n" not in str(e.value)


def test_the_cli_refuses_a_bad_entry_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _profile_file(tmp_path, {"moe.gate": [_point(calls=0)]})
    with pytest.raises(SystemExit) as e:
        run.main(["--config", "tiny", "--plan", "--device-profile", path])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert "operators.moe.gate[0].calls: must be a number in [0.001, 1e+09], got 0" in err[0]
