"""The latency model against hand-worked cases, its monotonicity, and its totals against its parts."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from dsv41.cli import run
from dsv41.config import TINY, Topology
from dsv41.capacity import CAPACITIES
from dsv41.graph.graph import Graph
from dsv41.kernels.kinds import KINDS
from dsv41.plan.latency import FIXED_TERMS, PARTS, step_latency
from dsv41.plan.primitives import AlphaBeta, ByRanks, all_reduce_alpha
from dsv41.plan.profiles import CONSTANTS, PROFILES, DeviceProfile, Link
from dsv41.plan.sizing import NodeCost
from dsv41.plan.step import run_plan

G, T = 1e9, 1e12
# Round numbers so every case is worked by hand: 1 TB/s HBM at 50% (matmul), 100 TFLOPS dense at 50%;
# a collective costs 2 µs + bytes at 50 GB/s inside a node, 10 µs + bytes at 5 GB/s across nodes; an
# all-to-all 30 µs (2 ranks) to 50 µs (8 ranks) + bytes at 50 / 5 GB/s.
INTRA = Link(100 * G, 0.5, AlphaBeta(2.0, 50 * G), ByRanks(((2, AlphaBeta(30.0, 50 * G)), (8, AlphaBeta(50.0, 50 * G)))))
INTER = Link(10 * G, 0.5, AlphaBeta(10.0, 5 * G), ByRanks(((2, AlphaBeta(40.0, 5 * G)),)))
DEV = DeviceProfile(
    "test", "hand-worked", 64 * G, 1 * T, {"mx": 200 * T, "dense": 100 * T, "vector": 10 * T},
    {"matmul": (0.5, 0.5), "gather": (0.25, 0.5), "vector": (0.5, 0.5)}, INTRA, INTER, 2,
    launch_us=1.0, host_launch_us=4.0, graph_launch_us=20.0, host_step_us=30.0, token_sync_us=0.0)


def cost(read=0, written=0, flops=None, link=0) -> NodeCost:
    return NodeCost(read, written, flops or {}, link, written)


def one_node(kernel: str, c: NodeCost):
    g = Graph("decode")
    g.add("n", kernel, (), 0)
    return step_latency(g, {"n": c}, DEV)


def test_kernel_at_the_bandwidth_bound():
    # 1 MB at 1 TB/s x 0.5 = 2 µs; 10 MFLOP dense at 100 TFLOPS x 0.5 = 0.2 µs: memory-bound
    lat = one_node("norm.rms", cost(read=900_000, written=100_000, flops={"dense": 1e7}))
    p = lat.parts["n"]
    assert p.bound == "memory" and p.body == pytest.approx(2.0) and p.launch == 1.0 and p.collectives == 0
    assert lat.step_us == pytest.approx(30 + 20 + 1 + 2)      # host step, graph replay, launch, body
    assert lat.on_path() == pytest.approx({"compute": 0, "memory": 2.0, "launch": 1.0, "sync": 0, "collectives": 0,
                                           "host": 50.0, "idle": 0, "cores": 0})
    # a projection is several kernels in a real stack (quant + GEMM, norm, quant + GEMM): 5 launch gaps
    assert KINDS["attn.q_proj"].kernels == 5
    assert one_node("attn.q_proj", cost(read=1)).parts["n"].launch == pytest.approx(5 * 1.0)


def test_kernel_at_the_compute_bound():
    # 1 TFLOP of FP8-weight matmul at 200 TFLOPS x 0.5 = 10 ms; 1 MB of bytes = 2 µs: compute-bound
    p = one_node("moe.experts", cost(read=1_000_000, flops={"mx": 1e12})).parts["n"]
    assert p.bound == "compute" and p.body == pytest.approx(10_000.0)
    # the same bytes as a gather kernel (0.25 of bandwidth) take twice as long
    assert KINDS["attn.leaf.swa"].latency == "gather"
    assert one_node("attn.leaf.swa", cost(read=1_000_000)).parts["n"].body == pytest.approx(4.0)


def test_weight_use_adds_its_decode_per_value_to_the_compute_side():
    # 1 M FP8 values at 20 ns and 0.5 M FP4 values at 10 ns on a part that decodes per use: 25 ms of
    # compute on top of 10 MFLOP (0.2 µs); the bytes (2 µs) no longer bound it. A part whose kernels read
    # the stored formats (every accelerator profile: no weight_use_ns) pays nothing for it.
    c = NodeCost(1_000_000, 0, {"dense": 1e7}, 0, 0, {"fp8": 1_000_000, "fp4": 500_000})
    g = Graph("decode")
    g.add("n", "attn.q_proj", (), 0)
    cpu = replace(DEV, weight_use_ns={"fp8": 20.0, "fp4": 10.0})
    p = step_latency(g, {"n": c}, cpu).parts["n"]
    assert p.bound == "compute" and p.body == pytest.approx(25_000.0 + 0.2)
    assert one_node("attn.q_proj", c).parts["n"].body == pytest.approx(2.0)
    assert all(not p.weight_use_ns for name, p in PROFILES.items() if not name.startswith("cpu"))


def test_cards_sharing_host_cores_take_at_least_their_summed_work_over_the_cores():
    # four cards, each one 100 µs node in parallel: 100 µs on four devices, 200 µs on two shared cores
    g = Graph("decode")
    for c in range(4):
        g.add(f"n@c{c}", "norm.rms", (), c)
    costs = {k: cost(read=50_000_000) for k in g.nodes}     # 50 MB at 1 TB/s x 0.5 = 100 µs
    own = step_latency(g, costs, DEV)
    shared = step_latency(g, costs, replace(DEV, shared_cores=2))
    assert own.cores_us == 0 and shared.cores_us == pytest.approx(4 * 101 / 2 - 101)
    assert shared.step_us == pytest.approx(own.step_us + shared.cores_us) and shared.on_path()["cores"] == shared.cores_us
    assert step_latency(g, costs, replace(DEV, shared_cores=8)).cores_us == 0     # enough cores: the timeline


def test_plan_counts_the_values_each_node_decodes_on_its_card():
    """TP2: a card decodes its half of wq_b (head-parallel) and all of wq_a; the routed experts it
    reads are its own EP slice's."""
    from dsv41.plan.sizing import card_values
    from dsv41.weights import checkpoint_specs
    topo = Topology(2, 1, 2)
    _, planned = run_plan(TINY, topo, requests=1, context=16, phase="decode")
    specs = checkpoint_specs(TINY)
    values = card_values(TINY, topo, 0)
    n = lambda name: math.prod(specs[name][0])
    wq_b = n("layers.3.attn.wq_b.weight") // 2
    assert values["layers.3.attn.wq_b"] == ("fp8", wq_b)
    assert values["layers.3.attn.wq_a"] == ("fp8", n("layers.3.attn.wq_a.weight"))
    assert values["head.weight"] == ("bf16", n("head.weight") // 2)
    q = next(k for k, node in planned.plan.graph.nodes.items() if node.kernel == "attn.q_proj" and node.layer == 3
             and node.card == 0)
    assert planned.costs[q].decoded["fp8"] == values["layers.3.attn.wq_a"][1] + wq_b


def test_a_part_that_decodes_per_use_holds_no_decoded_weight():
    """The CPU decodes each weight in a register next to its multiply (``cpu.fused_product``): its
    step's transient peak is the device's, whose kernels read weights as stored."""
    topo = Topology(1, 1, 1)
    device, _ = run_plan(TINY, topo, requests=1, context=16, phase="decode", device="a5")
    cpu, _ = run_plan(TINY, topo, requests=1, context=16, phase="decode", device="cpu")
    assert cpu["cards"][0]["transient_peak_bytes"] == device["cards"][0]["transient_peak_bytes"]


def all_gather(cards, link_bytes):
    g = Graph("decode")
    for c in cards:
        g.add(f"x@c{c}", "norm.rms", (), c)
    for c in cards:
        g.add(f"ag@c{c}", "tp.all_gather", [f"x@c{r}" for r in cards], c)
    costs = {k: cost(link=link_bytes if k.startswith("ag") else 0) for k in g.nodes}
    return step_latency(g, costs, DEV).parts["ag@c0"]


def test_all_gather_of_known_size_on_known_links():
    mb = 1_000_000
    # cards 0, 1 share a node (2 per node), cards 2, 3 do not: the call runs on the inter-node link
    inter = all_gather([0, 1, 2, 3], 3 * mb)
    assert (inter.sync, inter.collectives) == pytest.approx((10.0, 3 * mb / (5 * G) * 1e6))      # 10 + 600 µs
    intra = all_gather([0, 1], mb)
    assert (intra.sync, intra.collectives) == pytest.approx((2.0, mb / (50 * G) * 1e6))           # 2 + 20 µs
    g = Graph("decode")
    for c in range(2):
        g.add(f"x@c{c}", "norm.rms", (), c)
    g.add("ar", "tp.all_reduce", ["x@c0", "x@c1"], 0)
    lat = step_latency(g, {k: cost(link=mb if k == "ar" else 0) for k in g.nodes}, DEV)
    assert lat.parts["ar"].sync == pytest.approx(2 * 2.0)      # reduce-scatter + all-gather: two calls


def test_all_to_all_alpha_by_rank_count_and_imbalance():
    # 4 intra-node cards (4 per node): 4 ranks sit halfway (log2) between the 2- and 8-rank fits
    dev = replace(DEV, cards_per_node=4)
    g = Graph("decode")
    for c in range(4):
        g.add(f"d@c{c}", "moe.dispatch", (), c)
    g.add("e", "moe.experts", [f"d@c{c}" for c in range(4)], 0)
    mb = 1_000_000
    costs = {k: cost(link=3 * mb if k == "e" else 0, flops={"mx": 1e9} if k == "e" else None) for k in g.nodes}
    p = step_latency(g, costs, dev).parts["e"]
    assert p.sync == pytest.approx(30.0 + (50.0 - 30.0) * (2 - 1) / (3 - 1))                 # 40 µs
    assert p.collectives == pytest.approx(3 * mb / (50 * G) * 1e6)                             # 60 µs
    assert p.body == pytest.approx(1e9 / (100 * T) * 1e6)                                      # 10 µs
    heavy = step_latency(g, costs, dev, imbalance=1.5).parts["e"]
    assert heavy.collectives == pytest.approx(1.5 * p.collectives) and heavy.body == pytest.approx(1.5 * p.body)
    assert heavy.sync == p.sync


def test_all_reduce_alpha_follows_nccls_ring_model():
    # NCCL's ring LL model: 6.6 µs + 0.6 µs a step, n - 1 steps for a gather, 2 (n - 1) for an all-reduce
    assert all_reduce_alpha(6.6 + 7 * 0.6, 8) == pytest.approx(6.6 + 14 * 0.6)      # 10.8 -> 15.0 µs
    assert all_reduce_alpha(6.6 + 3 * 0.6, 4) == pytest.approx(6.6 + 6 * 0.6)       # 8.4 -> 10.2 µs
    assert all_reduce_alpha(2.0, 2) == pytest.approx(2.0 * 7.8 / 7.2)


def test_the_all_reduce_scheme_prices_a_tp_deployments_hand_offs():
    """Two cards of one TP group (one node): under ``all_reduce`` the rows are on both cards, so the
    all-gather and the experts' receive cost nothing, and the combine and the reduce-scatter are one
    all-reduce each (NCCL's all-reduce alpha, a ring's 2 (n - 1) times the rows a card outputs)."""
    g = Graph("decode")
    for c in range(2):
        g.add(f"x@c{c}", "norm.rms", (), c)
    for c in range(2):
        g.add(f"ag@c{c}", "tp.all_gather", ["x@c0", "x@c1"], c)
        g.add(f"d@c{c}", "moe.dispatch", [f"ag@c{c}"], c)
    for c in range(2):
        g.add(f"e@c{c}", "moe.experts", ["d@c0", "d@c1"], c)
    for c in range(2):
        g.add(f"cb@c{c}", "moe.combine", ["e@c0", "e@c1"], c)
        g.add(f"rs@c{c}", "tp.reduce_scatter", ["cb@c0", "cb@c1"], c)
    mb = 1_000_000
    costs = {k: NodeCost(mb, 0, {"mx": 1e9} if k.startswith("e@") else {}, 3 * mb if k[:2] in ("ag", "e@", "cb", "rs")
                         else 0, mb) for k in g.nodes}
    a2a, red = step_latency(g, costs, DEV), step_latency(g, costs, DEV, scheme="all_reduce")
    assert a2a.parts["ag@c0"].sync == pytest.approx(2.0) and a2a.parts["e@c0"].sync == pytest.approx(30.0)
    assert red.parts["ag@c0"].total == 0.0
    assert (red.parts["e@c0"].sync, red.parts["e@c0"].collectives) == (0.0, 0.0)
    assert red.parts["e@c0"].body == pytest.approx(a2a.parts["e@c0"].body)
    for k in ("cb@c0", "rs@c1"):
        assert red.parts[k].sync == pytest.approx(all_reduce_alpha(2.0, 2))
        assert red.parts[k].collectives == pytest.approx(2 * 1 * mb / (50 * G) * 1e6)     # 40 µs
    assert red.step_us < a2a.step_us
    with pytest.raises(ValueError, match="--scheme"):
        step_latency(g, costs, DEV, scheme="ring")


def test_the_all_reduce_scheme_needs_one_dp_group(capsys):
    with pytest.raises(ValueError, match="--scheme all_reduce: needs one DP group"):
        run_plan(TINY, Topology(1, 2, 2), 2, 256, device="h200", scheme="all_reduce")
    tp = Topology(2, 1, 2)
    a2a, red = (run_plan(TINY, tp, 2, 256, device="h200", scheme=s)[0] for s in ("all_to_all", "all_reduce"))
    assert red["scheme"] == "all_reduce" and red["breakdown_us"]["sync"] < a2a["breakdown_us"]["sync"]
    with pytest.raises(SystemExit):
        run.main(["--config", "tiny", "--plan", "--tp", "1", "--dp", "2", "--batch", "2", "--context", "256",
                  "--scheme", "all_reduce"])
    err = capsys.readouterr().err
    assert "--scheme" in err and "--dp 1" in err and "Traceback" not in err


def test_two_card_critical_path_with_a_wait():
    g = Graph("decode")
    g.add("a", "norm.rms", (), 0)           # card 0: 10 µs body
    g.add("b", "norm.rms", (), 1)           # card 1: 30 µs body
    g.add("c", "hc.post", ("a", "b"), 0)    # card 0 needs b: waits 20 µs on its peer
    mb = 1_000_000
    costs = {"a": cost(read=5 * mb), "b": cost(read=15 * mb), "c": cost(read=mb)}
    lat = step_latency(g, costs, DEV)
    start = 30 + 20
    assert lat.times["a"] == pytest.approx((start, start + 11))
    assert lat.times["b"] == pytest.approx((start, start + 31))
    assert lat.times["c"] == pytest.approx((start + 31, start + 31 + 3))
    assert lat.path == ["b", "c"]
    assert lat.step_us == pytest.approx(start + 34)
    cards = lat.per_card(g)
    assert cards[0]["idle"] == pytest.approx(20.0) and cards[0]["memory"] == pytest.approx(12.0)
    assert cards[1]["idle"] == pytest.approx(3.0)   # card 1 is done and waits for card 0 to finish the step
    for b in list(cards.values()) + [lat.on_path()]:
        assert sum(b.values()) == pytest.approx(lat.step_us)


def test_eager_dispatch_starves_short_kernels():
    g = Graph("decode")
    prev = ()
    for i in range(10):
        prev = (g.add(f"n{i}", "norm.rms", prev, 0),)
    costs = dict.fromkeys(g.nodes, cost(read=500_000))     # 1 µs body + 1 µs launch < 4 µs host issue
    graph_mode, eager = step_latency(g, costs, DEV, "graph"), step_latency(g, costs, DEV, "eager")
    synced = step_latency(g, costs, replace(DEV, token_sync_us=7.0))
    assert synced.step_us == pytest.approx(graph_mode.step_us + 7.0) and synced.on_path()["sync"] == 7.0
    assert graph_mode.step_us == pytest.approx(50 + 10 * 2)
    assert eager.step_us == pytest.approx(30 + 10 * 4 + 2)     # the last issue at 70 µs, then its 2 µs
    assert eager.on_path()["host"] == pytest.approx(70.0)
    with pytest.raises(ValueError, match="--dispatch"):
        step_latency(g, costs, DEV, "lazy")
    with pytest.raises(ValueError, match="unknown terms"):
        step_latency(g, costs, DEV, scale={"hops": 2})
    # every fixed cost scales the step in its own direction: halving never lengthens it
    for term in FIXED_TERMS:
        half, double = (step_latency(g, costs, DEV, "eager", 1.2, {term: k}).step_us for k in (0.5, 2))
        assert half <= eager.step_us <= double


@pytest.fixture(scope="module")
def tiny_plans():
    topo = Topology(2, 1, 2)
    by_context = [run_plan(TINY, topo, 2, c, device="h200")[0] for c in (64, 512, 4096)]
    by_batch = [run_plan(TINY, topo, b, 1024, device="h200")[0] for b in (1, 2, 4, 8)]
    return by_context, by_batch


def test_more_context_or_batch_never_predicts_less(tiny_plans):
    for reports in tiny_plans:
        steps = [r["predicted_step_us"] for r in reports]
        assert steps == sorted(steps) and steps[0] < steps[-1]


def test_plan_total_is_the_sum_of_its_parts(tiny_plans):
    for r in tiny_plans[0] + tiny_plans[1]:
        assert set(r["breakdown_us"]) == set(PARTS) and r["breakdown_us"]["idle"] == 0
        assert math.isclose(sum(r["breakdown_us"].values()), r["predicted_step_us"], rel_tol=1e-9)
        for card in r["cards"]:
            assert math.isclose(sum(card["breakdown_us"].values()), r["predicted_step_us"], rel_tol=1e-9)
        assert r["predicted_step_us"] > r["roofline_step_us"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_s_per_request"] * r["requests_per_dp_group"])


def test_every_constant_cites_its_source():
    assert set(PROFILES) >= {"a2", "a3", "a5", "h200", "h20"}
    for p in PROFILES.values():
        optional = {k for k in ("weight_use_ns", "shared_cores") if getattr(p, k)}
        assert set(p.sources) == set(CONSTANTS) | optional, p.name
        assert all(len(text) > 20 for text in p.sources.values())
        assert set(p.efficiency) == {"matmul", "gather", "vector"}
        assert all(0 < f <= 1 for pair in p.efficiency.values() for f in pair)
        for link in (p.intra, p.inter):
            assert 0 < link.efficiency <= 1 and link.collective.alpha_us > 0
            # the fitted beta is a bandwidth the link can carry, not more than its peak
            assert 0 < link.collective.bytes_per_s <= link.bytes_per_s * 1.01
            assert all(0 < ab.bytes_per_s <= max(link.bytes_per_s, 200 * G) for _, ab in link.a2a.fits)


def test_cli_plan_json_carries_prediction_and_breakdown(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run.main(["--config", "tiny", "--plan", "--tp", "2", "--dp", "1", "--batch", "2", "--context", "256",
                     "--device-profile", "a3", "--dispatch", "eager", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["plan"]
    assert "traces" not in out and not (tmp_path / "traces").exists()     # files only with --trace
    assert out["device_profile"] == "a3" and out["dispatch"] == "eager"
    assert out["predicted_step_us"] > 0 and set(out["breakdown_us"]) == set(PARTS)
    assert [c["card"] for c in out["cards"]] == [0, 1] and all("breakdown_us" in c for c in out["cards"])
    with pytest.raises(SystemExit):
        run.main(["--config", "tiny", "--dispatch", "eager"])      # a --plan option
    with pytest.raises(SystemExit):
        run.main(["--config", "tiny", "--plan", "--device-profile", "tpu-v5"])


def test_cli_explain_and_a_profile_file(capsys, tmp_path, monkeypatch):
    """--device-profile FILE times the plan with the user's constants; --explain prints and returns the
    sensitivity of the step to every fixed cost; a bad field is one usage line naming it."""
    monkeypatch.chdir(tmp_path)
    base = ["--config", "tiny", "--plan", "--tp", "2", "--dp", "1", "--batch", "2", "--context", "256", "--json"]
    assert run.main(base + ["--device-profile", "a3"]) == 0
    builtin = json.loads(capsys.readouterr().out)["plan"]
    (tmp_path / "slow.toml").write_text('base = "a3"\nlaunch_us = 40.0\n')
    assert run.main(base + ["--device-profile", "slow.toml", "--explain"]) == 0
    mine = json.loads(capsys.readouterr().out)["plan"]
    assert mine["predicted_step_us"] > builtin["predicted_step_us"]   # a slower launch gap, nothing else
    terms = {r["term"]: r for r in mine["sensitivity"]}
    assert set(terms) == set(FIXED_TERMS)
    assert terms["launch"]["half_us"] < mine["predicted_step_us"] < terms["launch"]["double_us"]
    (tmp_path / "bad.toml").write_text('base = "a3"\nlaunch_us = -1\n')
    with pytest.raises(SystemExit) as e:
        run.main(base + ["--device-profile", "bad.toml"])
    assert e.value.code == 2
    assert "--device-profile: bad.toml: launch_us: must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.main(["--config", "tiny", "--explain"])                 # a --plan option


@pytest.mark.parametrize("experts, k, ep, tokens", [(8, 6, 1, 1), (8, 6, 8, 3), (384, 6, 8, 192), (64, 6, 4, 5)])
def test_expected_experts_hit_match_a_monte_carlo_of_top_k_routing(experts, k, ep, tokens):
    """On meta inputs a card reads the expected share of its experts: each token picks k distinct
    experts of E uniformly (one token on 8 experts, top-6: exactly 6 hit)."""
    import torch
    from dsv41.kernels.nodes.moe import _experts_read
    local = experts // ep
    pairs = tokens * k * local / experts                      # expected pairs on card 0
    frac = _experts_read([torch.empty(0, device="meta")], pairs, 0, local, k, experts)[0]
    g = torch.Generator().manual_seed(0)
    trials = max(100, 4000 // tokens)
    picks = torch.rand(trials, tokens, experts, generator=g).argsort(-1)[..., :k]     # k distinct per token
    hit = torch.zeros(trials, experts, dtype=torch.bool).scatter_(1, picks.reshape(trials, -1), True)
    assert frac * local == pytest.approx(hit[:, :local].sum(1).float().mean().item(), rel=0.03)


def test_verify_rows_and_acceptance_set_the_tokens_per_step():
    from dsv41.plan.step import expected_tokens
    assert expected_tokens(0.0, 5) == 1 and expected_tokens(1.0, 5) == 6
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    topo = Topology(1, 1, 1)
    plain, _ = run_plan(TINY, topo, requests=2, context=64,
                        capacity=replace(CAPACITIES["tiny"], decode_rows_per_request=1))
    spec, _ = run_plan(TINY, topo, requests=2, context=64, acceptance=0.5)
    assert plain["rows_per_dp_group"] == 2 and spec["rows_per_dp_group"] == 12
    assert plain["tokens_per_request_step"] == 1 and spec["tokens_per_request_step"] == expected_tokens(0.5, 5)
    # six rows cost more than one, and the tokens they make are counted
    assert spec["predicted_step_us"] > plain["predicted_step_us"]
    assert spec["tokens_per_s"] == spec["tokens_per_request_step"] * 2 * 1e6 / spec["predicted_step_us"]
