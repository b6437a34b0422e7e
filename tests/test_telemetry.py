"""Traces, HBM accounting, exports, signatures and the FLASH plan."""
import dataclasses
import json
import re
import statistics
import time
import urllib.request
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from dask.utils import key_split

from dsv41.cli import run
from dsv41.cluster.engine import GraphEngine
from dsv41.cluster.settings import EngineConfig
from dsv41.cluster import registry
from dsv41.config import FLASH, TINY, Topology
from dsv41.graph.build import REPLICATED, SHARDED
from dsv41.kernels.kinds import KINDS
from dsv41.engine.requests import StepInputs
from dsv41.telemetry.export import write_traces
from dsv41.telemetry.session import TraceSession
from dsv41.telemetry.tracer import NodeTracer
from dsv41.weights import checkpoint_specs, init_checkpoint

TOPO = Topology(2, 1, 2)
NODE_ATTRS = {"dsv41.node": str, "dsv41.kernel": str, "dsv41.layer": int, "dsv41.card": int, "dsv41.phase": str,
              "dsv41.step": int, "dsv41.bytes_read": int, "dsv41.bytes_written": int, "dsv41.flops": int,
              "dsv41.hbm.live_bytes": int, "dsv41.hbm.peak_bytes": int, "dsv41.device.sim_us": float}


def tensor_bytes(v) -> int:
    """The test's own count of a value's tensor bytes."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(map(tensor_bytes, v))
    if isinstance(v, dict):
        return sum(map(tensor_bytes, v.values()))
    if dataclasses.is_dataclass(v):
        return sum(tensor_bytes(getattr(v, f.name)) for f in dataclasses.fields(v))
    return 0


def to_meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_like(v, device="meta")
    if isinstance(v, (tuple, list)):
        return type(v)(to_meta(x) for x in v)
    if isinstance(v, dict):
        return {k: to_meta(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, StepInputs):
        return dataclasses.replace(v, **{f.name: to_meta(getattr(v, f.name)) for f in dataclasses.fields(v)})
    return v


@pytest.fixture(scope="module")
def engine():
    e = GraphEngine(TINY, TOPO, EngineConfig(seed=0, executor="sync", max_batch=2, max_context=24))
    e.dspark = True      # every node kind runs: DSpark's seed, draft and head nodes too
    logits = e.prefill([[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8]]).logits
    e.tokens = torch.argmax(logits, -1).tolist()
    yield e
    e.close()


def decode(e, wiring=SHARDED):
    settings = e.settings   # the wiring is a per-step build choice; both read and write the same caches
    e.settings = dataclasses.replace(settings, wiring=wiring)
    try:
        e.tokens = torch.argmax(e.decode(e.tokens, e.active).logits, -1).tolist()
    finally:
        e.settings = settings


class Capturing(NodeTracer):
    """The real tracer, also keeping each node's value bytes as the test counts them."""
    def __init__(self, tracer):
        super().__init__(tracer.recorder, tracer.device)
        self.values, self.step = {}, None

    def begin_submission(self, sub, st):
        super().begin_submission(sub, st)
        self.step = sub.step

    def run(self, st, node, kernel_fn, args, sim_us=None):
        value = super().run(st, node, kernel_fn, args, sim_us)
        self.values[(self.step, node.key)] = (node.card, tensor_bytes(value))
        return value


@pytest.fixture(scope="module")
def traced(engine):
    session = TraceSession(engine)
    hooks = registry.find(engine.id).hooks
    hooks.tracer = capture = Capturing(hooks.tracer)
    steps = []
    for wiring in (SHARDED, REPLICATED):
        decode(engine, wiring)
        steps.append((engine.step_id, engine.last_graph))
    records = session.collect()
    hbm = session.hbm()
    session.close()
    return records, steps, capture, hbm, session.resource


def nodes_of(records):
    return [r for r in records if r["attributes"].get("dsv41.span") == "node"]


def test_checkpoint_specs_size_init_checkpoint_exactly():
    ck = init_checkpoint(TINY, 0)
    assert checkpoint_specs(TINY) == {n: (tuple(t.shape), t.dtype) for n, t in ck.items()}


def test_signatures_predict_every_value_from_meta_inputs(engine):
    """Every node of a decode step (both wirings): the signature's meta output has the real bytes and shapes."""
    seen, wrong = set(), []

    def shapes(v):
        return [tuple(t.shape) for t in _tensors(v)]

    class Check:
        def begin_submission(self, sub, st): pass
        def end_submission(self, sub): pass

        def run(self, st, node, fn, args, sim_us=None):
            value = fn(st, node, *args)
            real_routing = node.kernel == "moe.dispatch"   # how many rows go where is data, not shape
            spec = KINDS[node.kernel].cost(st, node, *(args if real_routing else to_meta(args))).out
            seen.add(node.kernel)
            if tensor_bytes(spec) != tensor_bytes(value) or (node.kernel != "moe.experts" and shapes(spec) != shapes(value)):
                wrong.append(node.key)
            return value

    hooks = registry.find(engine.id).hooks
    hooks.tracer = Check()
    try:
        decode(engine, SHARDED)
        decode(engine, REPLICATED)
    finally:
        hooks.tracer = None
    assert wrong == []
    assert seen == set(KINDS)


def _tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (tuple, list)):
        for x in v:
            yield from _tensors(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _tensors(x)
    elif dataclasses.is_dataclass(v):
        for f in dataclasses.fields(v):
            yield from _tensors(getattr(v, f.name))


def test_every_kernel_traced_with_its_attributes(traced):
    records, steps, *_ = traced
    nodes = nodes_of(records)
    assert {r["attributes"]["dsv41.kernel"] for r in nodes} == set(KINDS)   # the whole vocabulary
    by_key = {(r["attributes"]["dsv41.step"], r["name"]): r for r in nodes}
    assert len(by_key) == len(nodes)
    for step, graph in steps:
        for n in graph.nodes.values():
            a = by_key[(step, n.key)]["attributes"]
            for name, kind in NODE_ATTRS.items():
                assert isinstance(a[name], kind), (n.key, name)
            assert (a["dsv41.kernel"], a["dsv41.card"], a["dsv41.layer"]) == \
                (n.kernel, n.card, -1 if n.layer is None else n.layer)
            assert a["dsv41.phase"] == "decode" and a["dsv41.hbm.peak_bytes"] >= a["dsv41.hbm.live_bytes"] > 0
    first = steps[0][0]
    q = by_key[(first, "L3/attn/q_proj@c1")]["attributes"]
    d, r, hd, heads = TINY.hidden_size, TINY.q_lora_rank, TINY.head_dim, TINY.num_attention_heads // 2
    rows = 2  # two requests, one decode row each, all-gathered
    assert q["dsv41.flops"] > 2 * rows * (d * r + r * heads * hd)
    assert q["dsv41.bytes_written"] == rows * (r + heads * hd) * 4
    assert q["dsv41.device.sim_us"] > 0
    assert by_key[(first, "L2/attn/publish.window@c0")]["attributes"]["dsv41.bytes_written"] == rows * (64 + 2)


def test_span_tree_one_trace_per_step(traced, engine):
    records, steps, *_ = traced
    assert registry.find(engine.id).hooks.tracer is None and engine.observers == []   # closed: no hooks left
    by_id = {r["span_id"]: r for r in records}
    kinds = defaultdict(int)
    for r in records:
        kind = r["attributes"]["dsv41.span"]
        kinds[kind] += 1
        parent = by_id.get(r["parent_id"])
        expected_parent = {"step": None, "submission": "step", "node": "submission", "verify": "step",
                           "draft": "step"}[kind]
        assert (parent["attributes"]["dsv41.span"] if parent else None) == expected_parent
        if parent:
            assert parent["trace_id"] == r["trace_id"] and parent["start_ns"] <= r["start_ns"] <= r["end_ns"]
    assert kinds["step"] == 2 and kinds["node"] == sum(len(g.nodes) for _, g in steps)
    assert kinds["draft"] == kinds["verify"] == 2       # the steps draft DSpark blocks: speculative steps


def test_a_speculative_step_traces_its_verify_and_its_draft_part(engine):
    """A step verifying DSpark's drafts and drafting the next: a ``verify`` span over its target
    nodes' spans and a ``draft`` span over its DSpark nodes', both children of the step span."""
    session = TraceSession(engine)
    try:
        drafts = [engine.sequence(r).drafted[0][:2].tolist() for r in engine.active]
        out = engine.decode(engine.tokens, engine.active, drafts)
        engine.tokens = out.last
        records = session.collect()
    finally:
        session.close()
    graph = engine.last_graph
    (step,) = [r for r in records if r["attributes"]["dsv41.span"] == "step"]
    assert step["attributes"]["dsv41.verify.drafts"] == 2 * len(drafts) == sum(out.proposed)
    assert step["attributes"]["dsv41.draft.rows"] == len(drafts) * TINY.dspark_block_size
    nodes = nodes_of(records)
    for part, name in (("verify", "target"), ("draft", "draft")):
        (span,) = [r for r in records if r["attributes"]["dsv41.span"] == part]
        mine = [r for r in nodes if r["attributes"]["dsv41.part"] == name]
        assert span["parent_id"] == step["span_id"] and span["trace_id"] == step["trace_id"]
        assert span["attributes"]["dsv41.nodes"] == len(mine) == \
            sum(n.attrs.get("part", "target") == name for n in graph.nodes.values()) > 0
        assert span["start_ns"] == min(r["start_ns"] for r in mine) and span["end_ns"] == max(r["end_ns"] for r in mine)
    kinds = {r["attributes"]["dsv41.kernel"] for r in nodes if r["attributes"]["dsv41.part"] == "draft"}
    assert {"dspark.tap", "dspark.seed", "dspark.attn", "dspark.head", "moe.experts", "hc.post"} <= kinds


def test_accounted_transients_are_the_real_tensors(traced):
    records, _, capture, _, _ = traced
    real, spans = defaultdict(int), defaultdict(int)
    for card, b in capture.values.values():
        real[card] += b
    for r in nodes_of(records):
        spans[r["attributes"]["dsv41.card"]] += r["attributes"]["dsv41.output_bytes"]
    assert real == spans == {c: led.allocated for c, led in capture.ledgers.items()}
    assert all(led.transient == 0 for led in capture.ledgers.values())   # all freed by the step's end


def _hand_weights(card: int) -> int:
    """Card 0 of TP2/EP2 by hand: experts 0-7, half of every TP-split tensor, half the Engram rows."""
    total = 0
    for name, t in init_checkpoint(TINY, 0).items():
        b = t.numel() * t.element_size()
        if ".ffn.experts." in name:
            total += b if int(name.split(".")[4]) < 8 else 0
        elif any(f".{s}" in name for s in ("attn.wq_b.", "attn.wo_a.", "attn.wo_b.", "attn.attn_sink", "engram.embed.")) \
                or name in ("embed.weight", "head.weight"):   # the indexer's wq_b is not head-parallel
            total += b // 2
        else:
            total += b
    return total


def _hand_transient_peak(records, steps, card: int) -> int:
    """Replay the card's node spans (sync executor: one at a time, in start order) with the rule spelled
    out: a value lives until its last consumer on the card, and until its submission ends if another
    card or the host reads it."""
    peak = 0
    for step, graph in steps:
        spans = sorted((r for r in nodes_of(records) if r["attributes"]["dsv41.card"] == card
                        and r["attributes"]["dsv41.step"] == step), key=lambda r: r["start_ns"])
        local = defaultdict(int)
        read_elsewhere = {k for k in graph.nodes if k.startswith(("final/argmax", "cache.commit"))}
        for n in graph.nodes.values():
            for i in n.inputs:
                if i in graph.nodes and graph.nodes[i].card == card:
                    if n.card == card:
                        local[i] += 1
                    else:
                        read_elsewhere.add(i)
        live = {}   # key -> [bytes, local readers left, waits to be sent, submission]
        for i, r in enumerate(spans):
            key, sub = r["name"], r["attributes"]["dsv41.submission"]
            live[key] = [r["attributes"]["dsv41.output_bytes"], local[key], key in read_elsewhere, sub]
            peak = max(peak, sum(v[0] for v in live.values()))
            for k in graph.nodes[key].inputs:
                if k in live:
                    live[k][1] -= 1
            if i + 1 == len(spans) or spans[i + 1]["attributes"]["dsv41.submission"] != sub:
                for v in live.values():
                    v[2] = v[2] and v[3] != sub
            live = {k: v for k, v in live.items() if v[1] > 0 or v[2]}
    return peak


def test_hbm_peak_of_card0_matches_a_hand_count(traced, engine):
    records, steps, _, hbm, _ = traced
    weights = _hand_weights(0)
    caches = sum(t.numel() * t.element_size() for ts in engine.states()[0].caches.committed.values() for t in ts)
    peak = _hand_transient_peak(records, steps, 0)
    card0 = next(h for h in hbm if h["card"] == 0)
    assert (card0["weights_bytes"], card0["cache_bytes"], card0["transient_peak_bytes"]) == (weights, caches, peak)
    assert max(r["attributes"]["dsv41.hbm.peak_bytes"] for r in nodes_of(records)
               if r["attributes"]["dsv41.card"] == 0) == weights + caches + peak


def test_otlp_and_perfetto_files(traced, tmp_path):
    records, _, _, _, resource = traced
    paths = write_traces("tiny", records, resource, tmp_path)
    lines = [json.loads(line) for line in open(paths["otlp"])]
    assert len(lines) == 2   # one line (one ExportTraceServiceRequest) per step
    spans = []
    for line in lines:
        (rs,) = line["resourceSpans"]
        res = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
        assert res["service.name"] == {"stringValue": "dsv41"} and res["dsv41.topology"] == {"stringValue": "tp2-dp1-ep2"}
        assert res["dsv41.config"] == {"stringValue": "tiny"}
        (scope,) = rs["scopeSpans"]
        ids = {s["spanId"] for s in scope["spans"]}
        assert len({s["traceId"] for s in scope["spans"]}) == 1
        for s in scope["spans"]:
            assert len(s["traceId"]) == 32 and len(s["spanId"]) == 16 and int(s["spanId"], 16) > 0
            assert s.get("parentSpanId", "") == "" or s["parentSpanId"] in ids
            assert int(s["endTimeUnixNano"]) >= int(s["startTimeUnixNano"]) > 1.6e18   # unix nanos
        spans += scope["spans"]
    assert len(spans) == len(records)
    index = next(s for s in spans if s["name"] == "L20/attn/index#0@c0")
    attrs = {a["key"]: a["value"] for a in index["attributes"]}
    assert attrs["dsv41.kernel"] == {"stringValue": "attn.index"}
    assert attrs["dsv41.layer"] == {"intValue": "20"} and attrs["dsv41.card"] == {"intValue": "0"}

    doc = json.load(open(paths["perfetto"]))
    events = doc["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {(0, "card 0"), (1, "card 1"), (2, "engine")} <= names
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"submissions", "compute", "comm", "steps"} <= threads
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(records) and all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    index = next(e for e in slices if e["name"] == "L20/attn/index#0@c0")
    assert index["pid"] == 0 and index["cat"] == "attn.index"
    gather = next(e for e in slices if e["name"].startswith("L3/attn/all_gather@c1"))
    assert gather["pid"] == 1 and gather["tid"] != index["tid"]
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == len(nodes_of(records))
    assert {c["args"]["live_bytes"] for c in counters if c["pid"] == 0} == \
        {r["attributes"]["dsv41.hbm.live_bytes"] for r in nodes_of(records) if r["attributes"]["dsv41.card"] == 0}


class Stopwatch:
    """The least a tracer can do: time each kernel call and keep nothing else (the untraced reference)."""
    def __init__(self):
        self.us = defaultdict(list)   # kernel -> µs per node

    def begin_submission(self, sub, st): pass
    def end_submission(self, sub): pass

    def run(self, st, node, fn, args, sim_us=None):
        t0 = time.perf_counter_ns()
        value = fn(st, node, *args)
        self.us[node.kernel].append((time.perf_counter_ns() - t0) / 1e3)
        return value


def test_a_node_span_lasts_what_the_untraced_kernel_takes(engine):
    """Per kernel kind, the median node span of traced decode steps against the median kernel time
    of the same steps timed bare, alternated so both see the same load. The recorder's own cost
    must stay outside the spans: its notes come after the stamps."""
    hooks = registry.find(engine.id).hooks
    bare, spans = Stopwatch(), defaultdict(list)
    for _ in range(2):
        hooks.tracer = bare
        try:
            decode(engine)
        finally:
            hooks.tracer = None
        session = TraceSession(engine)
        try:
            decode(engine)
            for r in nodes_of(session.collect()):
                spans[r["attributes"]["dsv41.kernel"]].append((r["end_ns"] - r["start_ns"]) / 1e3)
        finally:
            session.close()
    kinds = [k for k in bare.us if len(bare.us[k]) >= 40 and statistics.median(bare.us[k]) >= 20]
    assert len(kinds) >= 5
    ratios = {k: statistics.median(spans[k]) / statistics.median(bare.us[k]) for k in kinds}
    assert all(len(spans[k]) == len(bare.us[k]) for k in kinds)
    assert 0.67 <= statistics.median(ratios.values()) <= 1.5, ratios
    assert all(0.4 <= r <= 2.5 for r in ratios.values()), ratios


def test_a_failed_step_is_marked_in_its_spans(engine, tmp_path):
    from dsv41.cluster.runtime import NodeError
    session = TraceSession(engine)
    engine.inject_failure("L5/attn/q_proj@c1")
    try:
        with pytest.raises(NodeError):
            decode(engine)
    finally:
        engine.inject_failure(None)
        records = session.collect()
        session.close()
    errors = {r["attributes"]["dsv41.span"]: r["error"] for r in records if r["error"]}
    assert "L5/attn/q_proj@c1" in errors["step"] and re.fullmatch(r"stopped after 1 of \d+ nodes", errors["submission"])
    lines = open(write_traces("failed", records, session.resource, tmp_path)["otlp"]).readlines()
    statuses = [s.get("status") for line in lines for s in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]]
    assert {"code": 2, "message": errors["submission"]} in statuses


def test_submission_keys_read_as_kernel_layer_card():
    from dsv41.cluster.plan import make_plan, task_name
    from dsv41.graph.build import build
    from dsv41.plan.step import step_inputs
    steps = {0: step_inputs(TINY, 2, 1, 20, "decode")}
    plan = make_plan(build(TINY, TOPO, steps), TOPO, step=7)
    assert len(set(plan.submissions)) == len(plan.submissions)
    for sub in plan.submissions.values():
        assert key_split(sub.key) == task_name(sub.nodes[0])
    assert task_name(next(n for n in plan.graph.nodes.values() if n.key == "L3/attn/q_proj@c1")) == "attn.q_proj@L3@c1"


def test_plan_flash_reproduces_the_seed_figures(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run.main(["--graph", "decode", "--config", "flash", "--plan", "--tp", "4", "--dp", "2", "--ep", "8",
                     "--batch", "64", "--context", "1048576", "--trace", "plan-flash", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["plan"]
    assert len(out["cards"]) == 8 and out["rows_per_dp_group"] == 192 and out["nodes"] > out["submissions"] > 0

    def near(value, seed, tol=0.02):
        return abs(value / 1e9 - seed) <= tol * seed

    for card in out["cards"]:
        kinds = card["by_kind"]
        assert set(card) == {"card", "weights_bytes", "cache_bytes", "transient_peak_bytes", "total_bytes", "by_kind",
                             "breakdown_us"}
        assert near(kinds["weights.routed_experts"], 36.1) and near(kinds["weights.engram_tables"], 25.3)
        # the seed's figures are the backbone's; DSpark's 3 stages add ~1.36 GB by hand: per stage 16 of 128
        # experts (0.30 GB), the shared expert (0.035 GB), attention with TP4 splits and mHC (~0.045 GB);
        # main_proj (0.08 GB) and the two 129280x256 BF16 Markov tables (0.13 GB)
        backbone = card["weights_bytes"] - kinds["weights.dspark"]
        assert 1.3e9 <= kinds["weights.dspark"] <= 1.45e9
        assert near(backbone, 66.0) and near(card["cache_bytes"], 30.2)
        other = backbone - kinds["weights.routed_experts"] - kinds["weights.engram_tables"]
        assert 4.3e9 <= other <= 4.9e9   # spec 03 §9's range for the seed's "4.7 GB other TP4 weights"
        assert card["total_bytes"] == card["weights_bytes"] + card["cache_bytes"] + card["transient_peak_bytes"]
        assert 0 < card["transient_peak_bytes"] < 1e9
    assert near(out["cache_per_request_bytes"], 0.94) and near(out["cache_per_request_bf16_bytes"], 3.37)
    assert near(32 * out["cache_per_request_bf16_bytes"], 107.8)
    assert out["device_profile"] == "a5" and out["predicted_step_us"] > out["floor_us"] > 0
    perfetto = json.load(open(tmp_path / out["traces"]["perfetto"]))["traceEvents"]
    assert {e["pid"] for e in perfetto if e["ph"] == "C"} == set(range(8))


def test_plan_weights_equal_the_live_ledger(traced):
    """Plan mode and a traced run size a card's weights with one policy."""
    from dsv41.plan.sizing import weights_by_kind
    _, _, _, hbm, _ = traced
    assert [h["weights_bytes"] for h in hbm] == [sum(weights_by_kind(TINY, TOPO, c).values()) for c in TOPO.cards]
    assert sum(weights_by_kind(FLASH, Topology(4, 2, 8), 0).values()) > 6e10


def test_cli_trace_writes_both_files_and_hbm(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run.main(["--executor", "sync", "--tp", "2", "--dp", "1", "--batch", "1", "--prompt-len", "4",
                     "--new-tokens", "2", "--trace", "cli", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["traces"] == {"otlp": "traces/cli.otlp.jsonl", "perfetto": "traces/cli.perfetto.json"}
    assert len(open(tmp_path / out["traces"]["otlp"]).readlines()) == 2   # prefill and one decode step
    assert [h["card"] for h in out["hbm"]] == [0, 1] and all(h["peak_bytes"] > h["weights_bytes"] for h in out["hbm"])
    assert not any(registry.find(e).hooks.tracer for e in registry.engines())   # the CLI closed its engine


def test_distributed_trace_dashboard_and_report(tmp_path, monkeypatch):
    from distributed import get_task_stream
    from dsv41.cli import trace as cli
    monkeypatch.chdir(tmp_path)
    e = GraphEngine(TINY, TOPO, EngineConfig(seed=0, executor="distributed", dashboard=True, max_batch=1,
                                             max_context=12))
    try:
        tracing = cli.start(SimpleNamespace(trace="dist", report=True, device_profile="a5"), e)
        with get_task_stream(e.runner.client) as ts:
            logits = e.prefill([[1, 2, 3]]).logits
            e.decode(torch.argmax(logits, -1).tolist(), e.active)
        result = {}
        tracing.finish(result, say=lambda *_: None)
        with urllib.request.urlopen(e.runner.dashboard_link, timeout=30) as page:
            assert page.status == 200
    finally:
        e.close()
    prefixes = {key_split(t["key"]) for t in ts.data}
    assert {"rope.rows@c0", "tp.all_gather@L3@c0", "moe.experts@L39@c1", "cache.commit@c1"} <= prefixes
    assert "tp.all_gather@L3@c0" in open(result["traces"]["dask_report"]).read()
    spans = [s for line in open(result["traces"]["otlp"]) for s in
             json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]]
    attrs = {s["spanId"]: {a["key"]: a["value"] for a in s["attributes"]} for s in spans}
    parent = {s["spanId"]: s.get("parentSpanId", "") for s in spans}
    nodes = [i for i, a in attrs.items() if a["dsv41.span"] == {"stringValue": "node"}]
    assert {attrs[i]["dsv41.card"]["intValue"] for i in nodes} == {"0", "1"}
    for i in nodes:   # worker spans hang under worker submission spans under the engine's step span
        assert attrs[parent[parent[i]]]["dsv41.span"] == {"stringValue": "step"}
