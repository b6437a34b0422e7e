"""Fixed-cost fits, the MoE imbalance bound, user profile files and the sensitivity table."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dsv41.config import TINY, Topology
from dsv41.plan.explain import explain_lines, sensitivity
from dsv41.plan.latency import FIXED_TERMS, link_us
from dsv41.plan.primitives import AlphaBeta, ByRanks, Point, fit, moe_imbalance
from dsv41.plan.profile_file import load_profile
from dsv41.plan.profiles import CONSTANTS, PROFILES
from dsv41.plan.roofline import profile
from dsv41.plan.step import run_plan

G = 1e9


def test_fit_recovers_a_line_and_falls_back_when_the_slope_is_not_pinned():
    true = AlphaBeta(12.0, 100 * G)
    got = fit([Point(b, true.us(b)) for b in (64, 4096, 1 << 20, 64 << 20)], 1 * G)
    assert got.alpha_us == pytest.approx(12.0) and got.bytes_per_s == pytest.approx(100 * G)
    # one size only: the fallback bandwidth is the slope, alpha the mean residual (here exact)
    one = fit([Point(1e6, 30.0)], 50 * G)
    assert one == AlphaBeta(pytest.approx(10.0), 50 * G)
    # a larger message that ran faster (a negative slope) also falls back
    neg = fit([Point(1e6, 100.0), Point(2e6, 90.0)], 1e12)
    assert neg.bytes_per_s == 1e12 and 90 < neg.alpha_us < 100


def test_by_ranks_interpolates_in_log2_and_holds_at_the_ends():
    br = ByRanks(((8, AlphaBeta(10.0, 100 * G)), (32, AlphaBeta(30.0, 50 * G))))
    assert br.at(2) == br.at(8) and br.at(512) == br.at(32)
    mid = br.at(16)
    assert mid.alpha_us == pytest.approx(20.0)
    assert 1 / mid.bytes_per_s == pytest.approx((1 / (100 * G) + 1 / (50 * G)) / 2)


def _busiest_over_mean(pairs, ranks):
    rng = np.random.default_rng(7)
    return np.mean([np.bincount(rng.integers(0, ranks, pairs), minlength=ranks).max() for _ in range(3000)]) * ranks / pairs


@pytest.mark.parametrize("pairs,ranks", [(192, 8), (1152, 8), (2000, 16), (384, 32)])
def test_moe_imbalance_matches_a_monte_carlo_of_uniform_routing(pairs, ranks):
    mc = _busiest_over_mean(pairs, ranks)
    assert moe_imbalance(pairs, ranks) == pytest.approx(mc, rel=0.05) and moe_imbalance(pairs, ranks) <= mc
    assert moe_imbalance(pairs, 1) == 1.0


def test_moe_imbalance_underestimates_below_ten_pairs_per_rank():
    # the normal approximation of a count of ~3 misses the discrete tail: a lower bound there
    assert moe_imbalance(96, 32) < _busiest_over_mean(96, 32)


def test_dispatch_and_combine_are_priced_by_where_the_ep_group_sits():
    """An EP group inside one NVLink domain pays DeepEP's intranode (NVLink) low-latency call, one
    with a peer on another node the RDMA call. The references are the published points themselves:
    the line through PR #173's EP8 NVLink dispatch (37 us at 203.2 GB/s) and combine (59 us at
    244.2 GB/s), and the RDMA table's EP16 alpha fit as the inter link's."""
    d_bytes, c_bytes = 37e-6 * 203.2 * G, 59e-6 * 244.2 * G
    us_per_byte = (59 - 37) / (c_bytes - d_bytes)
    nvlink_alpha = 37 - d_bytes * us_per_byte
    for name in ("h100", "h200", "b200", "h20"):
        dev = PROFILES[name]
        assert dev.cards_per_node == 8
        for ranks in (2, 4, 8):
            assert dev.intra.a2a.at(ranks).alpha_us == pytest.approx(nvlink_alpha)
            assert dev.intra.a2a.at(ranks).bytes_per_s == pytest.approx(1e6 / us_per_byte)
        combine = type("Node", (), {"card": 0, "kernel": "moe.combine"})()
        inside = link_us(combine, 1e5, [1, 2, 3], dev)
        across = link_us(combine, 1e5, [1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15], dev)
        assert inside[0] == pytest.approx(nvlink_alpha)
        assert across[0] == dev.inter.a2a.at(12).alpha_us > 2 * nvlink_alpha
    # the launch gap: the CUDA-graph figure on NVIDIA parts, the older assumption where none is published
    assert {PROFILES[n].launch_us for n in ("h100", "h200", "b200", "h20")} == {1.3}
    assert all(PROFILES[n].launch_us == 2.0 for n in ("a2", "a3", "a5"))


def test_builtin_profiles_cite_their_new_constants():
    for p in PROFILES.values():
        assert "token_sync_us" in p.sources and p.token_sync_us > 0
        assert "dispatch/combine" in p.sources["intra"] and "collective" in p.sources["intra"]


def test_profile_file_with_a_base_overrides_field_by_field(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('base = "h100"\nlaunch_us = 3.5\n[sources]\nlaunch_us = "our nsys trace"\n'
                 '[intra]\ncollective = {alpha_us = 20.0, bytes_per_s = 3e11}\n'
                 'a2a = [{ranks = 8, alpha_us = 50.0, bytes_per_s = 1e11}]\n')
    p = load_profile(f)
    base = PROFILES["h100"]
    assert p.name == "h100+mine" and p.launch_us == 3.5 and p.sources["launch_us"] == "our nsys trace"
    assert p.intra.collective == AlphaBeta(20.0, 3e11) and p.intra.a2a.at(64).alpha_us == 50.0
    assert p.intra.bytes_per_s == base.intra.bytes_per_s and p.inter == base.inter
    assert p.hbm_bytes == base.hbm_bytes and p.sources["hbm_bytes"] == base.sources["hbm_bytes"]
    assert profile(str(f)) == p


def test_profile_file_sets_the_weight_use_cost_per_format(tmp_path):
    f = tmp_path / "box.toml"
    f.write_text('base = "cpu"\n[weight_use_ns]\nfp8 = 7.5\n[sources]\nweight_use_ns = "bench/cpu_rates.py on box"\n')
    p = load_profile(f)
    assert p.weight_use_ns == {**PROFILES["cpu"].weight_use_ns, "fp8": 7.5}
    assert p.sources["weight_use_ns"] == "bench/cpu_rates.py on box"
    f.write_text('base = "h100"\n')
    assert load_profile(f).weight_use_ns == {}


def test_profile_file_in_json_without_a_base_needs_every_constant(tmp_path):
    h = PROFILES["h200"]
    link = {"bytes_per_s": 4.5e11, "efficiency": 0.8, "collective": {"alpha_us": 10, "bytes_per_s": 3.6e11},
            "a2a": [{"ranks": 8, "alpha_us": 40, "bytes_per_s": 1.8e11}]}
    full = {"name": "lab", "hbm_bytes": h.hbm_bytes, "hbm_bytes_per_s": h.hbm_bytes_per_s,
            "flops_per_s": h.flops_per_s, "efficiency": {k: list(v) for k, v in h.efficiency.items()},
            "intra": link, "inter": link, "cards_per_node": 8, "launch_us": 2, "host_launch_us": 5,
            "graph_launch_us": 20, "host_step_us": 100, "token_sync_us": 20}
    f = tmp_path / "lab.json"
    f.write_text(json.dumps(full))
    p = load_profile(f)
    assert p.name == "lab" and set(p.sources) == set(CONSTANTS) and p.intra.efficiency == 0.8
    del full["token_sync_us"]
    f.write_text(json.dumps(full))
    with pytest.raises(ValueError, match=r"missing \['token_sync_us'\]"):
        load_profile(f)


@pytest.mark.parametrize("body,field", [
    ('base = "h100"\nlaunch_us = -1', r"launch_us: must be a number in \[0, 1e\+07\]"),
    ('base = "h100"\ncards_per_node = 2.5', r"cards_per_node: must be an integer in \[1, 1024\]"),
    ('base = "h100"\n[efficiency]\nmatmul = [0.9, 1.5]', r"efficiency.matmul\[1\]: must be a number in \(0, 1\]"),
    ('base = "h100"\n[intra]\na2a = [{ranks = 16, alpha_us = 1, bytes_per_s = 1e11}, '
     '{ranks = 8, alpha_us = 1, bytes_per_s = 1e11}]', r"intra.a2a\[1\].ranks: must ascend"),
    ('base = "h100"\n[inter]\ncollective = {alpha_us = 5}', r"inter.collective: missing keys \['bytes_per_s'\]"),
    ('base = "tpu"', r"base: must be one of"),
    ('base = "h100"\nhop_us = 3', r"\(top level\): unknown keys \['hop_us'\]"),
    ('base = "h100"\n[flops_per_s]\nfp4 = 1e15', r"flops_per_s: unknown keys \['fp4'\]"),
    ('base = "cpu"\n[weight_use_ns]\nfp16 = 3', r"weight_use_ns: unknown keys \['fp16'\]"),
    ('base = "cpu"\n[weight_use_ns]\nfp8 = -1', r"weight_use_ns.fp8: must be a number in \[0, 1e\+06\]"),
])
def test_profile_file_errors_name_the_field_and_range(tmp_path, body, field):
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(ValueError, match=field):
        load_profile(f)


def test_profile_file_unreadable_or_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_profile(tmp_path / "none.toml")
    (tmp_path / "p.yaml").write_text("x: 1")
    with pytest.raises(ValueError, match=r"must end in \.json or \.toml"):
        load_profile(tmp_path / "p.yaml")
    (tmp_path / "p.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(tmp_path / "p.json")
    with pytest.raises(ValueError, match="--device-profile: must be one of"):
        profile("tpu-v5")


def test_sensitivity_brackets_the_step_and_prints_every_term():
    report, planned = run_plan(TINY, Topology(2, 1, 2), 2, 256, device="h200")
    rows = sensitivity(planned)
    step = report["predicted_step_us"]
    assert {r.term for r in rows} == set(FIXED_TERMS)
    for r in rows:
        assert r.half_us <= step <= r.double_us
    assert rows[0].double_us - rows[0].half_us >= rows[-1].double_us - rows[-1].half_us
    launch = next(r for r in rows if r.term == "launch")
    assert launch.double_us > step          # every node launches at least one kernel
    lines = explain_lines(rows, step)
    assert len(lines) == 2 + len(FIXED_TERMS) and all(f" {t} " in "".join(lines) for t in FIXED_TERMS)
