"""Plan mode: build a full step's graph at any scale and walk it on ``meta`` tensors.

Nothing of the model is allocated: every node's value is the meta spec its kernel signature
returns, weights are sized from the checkpoint's formats and caches from the kv_cache formats' row
bytes. Only the step metadata (block tables, positions) is real, and it is small even at 1M context.

Each DP group serves ``requests`` requests at ``context`` tokens; a decode step gives each request
the capacity's ``decode_rows_per_request`` rows (1 target + 5 draft: 32 requests -> 192 rows per
group, the seed's capacity contract, ``dsv41.capacity``), a prefill step splits the group's
``prefill_max_tokens`` rows between them. The
per-card HBM is replayed along the simulated timeline, so the Perfetto counter track and the
reported transient peak follow the same order.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import torch

from dsv41.cluster.plan import make_plan
from dsv41.capacity import Capacity, capacity_of
from dsv41.engine.layout import StepLayout
from dsv41.engine.requests import StepInputs
from dsv41.graph.build import SHARDED, build, step_outputs
from dsv41.kernels.cost import nbytes
from dsv41.kernels.kinds import KINDS
from dsv41.ops import metadata as md_ops
from dsv41.plan.latency import SCHEMES, StepLatency, step_latency
from dsv41.plan.operators import coverage
from dsv41.plan.primitives import moe_imbalance
from dsv41.plan.roofline import node_us, profile, simulate
from dsv41.plan.sizing import card_values, card_weights, node_cost, request_cache_bytes, weights_by_kind
from dsv41.plan.hbm import CardLedger, annotate


@dataclass(frozen=True)
class CardContext:
    """What a kernel signature reads of a card (a CardState without tensors)."""
    cfg: object
    topo: object
    card: int

    @property
    def tp_rank(self) -> int:
        return self.topo.tp_rank(self.card)


def rows_per_request(capacity: Capacity, requests: int, phase: str) -> int:
    return capacity.decode_rows_per_request if phase == "decode" else capacity.prefill_max_tokens // requests


def step_inputs(cfg, requests: int, rows: int, context: int, phase: str) -> StepInputs:
    """One DP group's step: ``requests`` requests each adding ``rows`` tokens and ending at ``context``."""
    bs, kv = cfg.block_size, context - rows
    pages = -(-context // bs)
    window = torch.arange(requests * pages, dtype=torch.int32).reshape(requests, pages)
    tables = {}
    for r in sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids}):
        width = max(1, -(-(context // r) // bs))
        tables[r] = torch.arange(requests * width, dtype=torch.int32).reshape(requests, width)
    compressed = {s: tables[cfg.compress_ratios[s]] for s in cfg.kv_source_layer_ids}
    states = {s: torch.arange(requests, dtype=torch.int32).reshape(requests, 1)
              for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 2}
    qsl = torch.arange(requests + 1, dtype=torch.int32) * rows
    prompt = context if phase == "prefill" else kv        # a prefill's rows end its prompt; decode rows follow it
    md = md_ops.lower(cfg, qsl, torch.full((requests,), kv, dtype=torch.int32), window, compressed, states,
                      torch.full((requests,), prompt, dtype=torch.int32))
    t = requests * rows
    hashes = {layer: torch.zeros(t, cfg.engram_ids_per_token, dtype=torch.int64) for layer in cfg.engram_layer_ids}
    layout = StepLayout(list(range(requests)), [rows] * requests, [[] for _ in range(requests)], [None] * requests)
    return StepInputs(layout, torch.zeros(t, dtype=torch.int64), md, hashes, phase, md.logit_row_indices)


def check(cfg, capacity: Capacity, requests: int, context: int, phase: str):
    rows = rows_per_request(capacity, requests, phase)
    limit = capacity.step_limit(phase)
    rules = [(1 <= requests <= capacity.max_batch_per_dp, "batch",
              f"must be in [1, {capacity.max_batch_per_dp}] requests per DP group, got {requests}"),
             (rows >= 1 and requests * rows <= limit, "batch", f"{requests} requests do not fit {limit} {phase} rows"),
             (rows <= context <= cfg.max_position_embeddings, "context",
              f"must be in [{rows}, {cfg.max_position_embeddings}], got {context}")]
    for ok, name, rule in rules:
        if not ok:
            raise ValueError(f"--{name}: {rule}")


def walk(graph, contexts) -> dict:
    """Node key -> NodeCost, evaluating every signature on the meta values of its inputs."""
    held = {c: card_weights(ctx.cfg, ctx.topo, c) for c, ctx in contexts.items()}
    decoded = {c: card_values(ctx.cfg, ctx.topo, c) for c, ctx in contexts.items()}
    values = {k: v for k, (v, _) in graph.literals.items()}
    costs = {}
    for key in graph.topo_order():
        node = graph.nodes[key]
        args = [values[i] for i in node.inputs]
        sig = KINDS[node.kernel].cost(contexts[node.card], node, *args)
        values[key] = sig.out
        costs[key] = node_cost(held[node.card], sig, args, nbytes(sig.out), decoded[node.card])
    return costs


def replay_hbm(plan, costs, times, ledgers) -> dict[str, tuple[int, int]]:
    """Apply the liveness rule along the simulated timeline: node key -> the card's (live, peak) bytes
    when the node ends. Sends happen when a submission's last node ends."""
    events = defaultdict(list)     # card -> (time, sends after nodes, key, submission)
    for sub in plan.submissions.values():
        for n in sub.nodes:
            events[sub.card].append((times[n.key][1], 0, n.key, sub))
        end = max(times[n.key][1] for n in sub.nodes)
        events[sub.card] += [(end, 1, k, sub) for k in sub.trace.remote]
    at_end = {}
    for card, evs in events.items():
        led = ledgers[card]
        for _, is_send, key, sub in sorted(evs, key=lambda e: e[:2]):
            if is_send:
                led.sent(key)
                continue
            led.produce(key, costs[key].output_bytes, sub.trace.uses[key], key in sub.trace.remote)
            for i in plan.graph.nodes[key].inputs:
                led.consume(i)
            at_end[key] = (led.live_bytes, led.peak_bytes)
    return at_end


@dataclass
class PlannedStep:
    """What the plan computed, for whoever records it (telemetry draws it as simulated spans)."""
    plan: object
    costs: dict
    latency: StepLatency
    live_at: dict          # node key -> the card's (live, peak) HBM bytes when the node ends
    device: object
    dispatch: str = "graph"
    imbalance: float = 1.0
    scheme: str = "all_to_all"


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a request makes per verify step of ``drafts`` drafts when each is accepted with
    probability ``acceptance`` given the ones before it were: 1 + a + a^2 + ... + a^drafts."""
    return sum(acceptance ** i for i in range(drafts + 1))


def run_plan(cfg, topo, requests: int, context: int, phase: str = "decode", wiring: str = SHARDED,
             device: str = "a5", dispatch: str = "graph", acceptance: float = 0.0,
             scheme: str = "all_to_all", capacity: Capacity | None = None) -> tuple[dict, PlannedStep]:
    """The report of one step and the planned step itself. A decode step's rows per request are
    1 + drafts (the capacity's ``decode_rows_per_request``; default capacity: the model's,
    ``capacity_of``); acceptance: each draft's, for the tokens per step; scheme: how the stack hands
    data between cards (``dsv41.plan.latency.SCHEMES``)."""
    capacity = capacity or capacity_of(cfg)
    check(cfg, capacity, requests, context, phase)
    topo.check(cfg)
    if scheme not in SCHEMES:
        raise ValueError(f"--scheme: must be one of {list(SCHEMES)}, got {scheme!r}")
    if scheme == "all_reduce" and topo.dp != 1:
        raise ValueError(f"--scheme all_reduce: needs one DP group (TP attention, the experts' sums "
                         f"all-reduced over it), got --dp {topo.dp}")
    dev = profile(device)
    rows = rows_per_request(capacity, requests, phase)
    steps = {g: step_inputs(cfg, requests, rows, context, phase) for g in range(topo.dp)}
    # a step with draft rows verifies DSpark's drafts and drafts the next block in the same graph
    dspark = cfg.dspark and phase == "decode" and rows > 1
    graph = build(cfg, topo, steps, wiring, phase, dspark)
    plan = make_plan(graph, topo, outputs=step_outputs(topo, steps, dspark), step=1)
    annotate(plan)
    costs = walk(graph, {c: CardContext(cfg, topo, c) for c in topo.cards})
    roofline = simulate(graph, {k: node_us(c, dev) for k, c in costs.items()})
    imbalance = moe_imbalance(topo.dp * requests * rows * cfg.num_experts_per_tok, topo.ep)
    latency = step_latency(graph, costs, dev, dispatch, imbalance, scheme=scheme)

    per_request = request_cache_bytes(cfg, context)
    weights = {c: weights_by_kind(cfg, topo, c) for c in topo.cards}
    ledgers = {c: CardLedger(sum(weights[c].values()), requests * sum(per_request.values())) for c in topo.cards}
    live_at = replay_hbm(plan, costs, latency.times, ledgers)

    moved = defaultdict(int)
    for key, c in costs.items():
        moved[graph.nodes[key].card] += c.bytes_read + c.bytes_written
    on_path = Counter()
    for key in latency.path:
        on_path[graph.nodes[key].kernel] += latency.parts[key].total
    by_card = latency.per_card(graph)
    cards = []
    for c, led in ledgers.items():
        by_kind = {f"weights.{k}": v for k, v in weights[c].items()}
        by_kind.update({f"cache.{k}": requests * v for k, v in per_request.items()})
        cards.append({"card": c, "weights_bytes": led.weights, "cache_bytes": led.caches,
                      "transient_peak_bytes": led.peak_transient, "total_bytes": led.peak_bytes, "by_kind": by_kind,
                      "breakdown_us": by_card[c]})
    step_us = latency.step_us
    made = expected_tokens(acceptance, rows - 1) if phase == "decode" else rows
    tokens_per_step = requests * made
    report = {
        "cards": cards, "nodes": len(graph.nodes), "submissions": len(plan.submissions),
        "requests_per_dp_group": requests, "rows_per_dp_group": requests * rows, "context": context,
        "wiring": wiring, "cache_per_request_bytes": sum(per_request.values()),
        "cache_per_request_bf16_bytes": sum(request_cache_bytes(cfg, context, bf16=True).values()),
        "device_profile": dev.name, "dispatch": dispatch, "scheme": scheme, "predicted_step_us": step_us,
        "moe_imbalance": imbalance,
        "breakdown_us": latency.on_path(),
        "acceptance": acceptance if phase == "decode" else None,
        "tokens_per_request_step": made,
        "tokens_per_s_per_request": (tokens_per_step / requests) * 1e6 / step_us,
        "tokens_per_s": tokens_per_step * topo.dp * 1e6 / step_us,
        "roofline_step_us": max(end for _, end in roofline.values()),
        "floor_us": max(moved.values()) / dev.hbm_bytes_per_s * 1e6,
        "critical_path_us_by_kernel": dict(on_path.most_common()),
        "operators": coverage((n.kernel for n in graph.nodes.values()), dev),
    }
    return report, PlannedStep(plan, costs, latency, live_at, dev, dispatch, imbalance, scheme)
