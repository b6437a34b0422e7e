"""Recovering a ``GraphEngine`` from lost cards.

A card's State is lost when its worker restarted, was replaced or is gone (``StateLost``). The
engine waits up to its ``recovery_timeout`` for a worker to serve every card, rebuilds the States of
each DP group that lost a card (weights from the same seed, empty caches) and replays every request
of those groups (read from the engine's host state, ``engine/host.py``) as prefill steps of its
token history. The replay is exact: the graph is
bit-identical to the reference, and a prefill of a history equals the steps that produced it.
"""
from __future__ import annotations

import time

from dsv41.cluster import registry
from dsv41.cluster.registry import StateLost
from dsv41.engine.layout import Part
from dsv41.engine.requests import RequestTable


def recover(engine, err: StateLost, failed_step_ms: float) -> dict:
    """Rebuild and replay the DP groups of the cards lost; the record of what was done and how long it
    took. engine: the GraphEngine, whose own install, renew and execute steps do the work (so a replay
    step is aborted, stamped and observed as any step); failed_step_ms: how long the step ran before the
    loss was detected."""
    t = [time.perf_counter()]
    lost = lost_cards(engine) or list(err.cards)
    t.append(time.perf_counter())
    groups = sorted({engine.topo.dp_group(c) for c in lost})
    drawn = sorted(r for g in groups for r, seq in engine.host.tables[g].requests.items() if seq.from_context)
    if drawn:
        raise RuntimeError(f"recovery: request(s) {drawn} started at a drawn context (start_at_context); "
                           f"replaying their history would compute caches, not redraw them") from err
    cards = [c for g in groups for c in engine.topo.group_cards(g)]
    engine._install(lost)
    engine._renew([c for c in cards if c not in lost])
    t.append(time.perf_counter())
    tokens, requests, steps = replay(engine, groups)
    t.append(time.perf_counter())
    return {"lost_cards": lost, "rebuilt_cards": cards, "dp_groups": groups, "cause": err.reason,
            "replayed_requests": requests, "replayed_tokens": tokens, "replay_steps": steps,
            "failed_step_ms": failed_step_ms, "wait_ms": (t[1] - t[0]) * 1e3,
            "rebuild_ms": (t[2] - t[1]) * 1e3, "replay_ms": (t[3] - t[2]) * 1e3, "ms": (t[3] - t[0]) * 1e3}


def lost_cards(engine) -> list[int]:
    """Cards whose State is missing or not the one the engine expects (waits for workers)."""
    expect = {c: (engine.builds[c], engine.generation) for c in engine.topo.cards}
    runner = engine.runner
    if runner is None:
        found = registry.probe(engine.id)
        return [c for c, e in expect.items() if found.get(c) != e]
    runner.wait_for_cards(list(engine.topo.cards), engine.settings.recovery_timeout)
    found = runner.run_on_cards(registry.probe, engine.id, on_error="return")
    return [c for c, e in expect.items()
            if not isinstance(got := found.get(runner.address_of[c]), dict) or got.get(c) != e]


def replay(engine, groups: list[int]) -> tuple[int, int, int]:
    """Rebuild the caches of these DP groups from their requests' token histories, as prefill steps of
    at most prefill_max_tokens rows per group (a longer history in chunks), into fresh tables that
    replace the groups' tables in the engine's host state, under the same request ids. Returns the
    tokens replayed, the requests and the steps."""
    limit = engine.capacity.prefill_max_tokens
    tables = engine.host.tables
    fresh = {g: RequestTable(engine.cfg, tables[g].max_batch, tables[g].max_context, tables[g].token_map,
                             tables[g].cache_tokens, tables[g].blocks.cache is not None, g, tables[g].capacity)
             for g in groups}
    # each request under its own chain start (its prompt length, its salt): the spans it registers
    # again are the ones its first computation registered
    work = {g: [Part(rid, req.tokens[i:i + limit], start=i == 0, prompt_len=req.prompt_len if i == 0 else None,
                     cache_root=req.cache_root)
                for rid, req in tables[g].requests.items() for i in range(0, len(req.tokens), limit)] for g in groups}
    tokens = steps = 0
    while any(work.values()):
        take = {g: pack(work[g], limit) for g in groups if work[g]}
        plans = {g: fresh[g].plan(parts, "prefill") for g, parts in take.items()}
        engine._execute({g: p.inputs for g, p in plans.items()}, "prefill")
        for g, parts in take.items():
            fresh[g].commit(plans[g])
            tokens += sum(len(p.tokens) for p in parts)
        steps += 1
    for g in groups:   # the replay drew nothing: each request keeps its sampling state, grammar and drafts
        for rid, old in tables[g].requests.items():
            new = fresh[g].requests[rid]
            new.settle(old)
            new.matcher, new.drafted = old.matcher, old.drafted
        tables[g] = fresh[g]
    return tokens, sum(len(fresh[g].requests) for g in groups), steps


def pack(work: list[Part], limit: int) -> list[Part]:
    """Take from the front of work the chunks of one prefill step: at least one, up to limit rows, at
    most one chunk per request and a request's chunks in order."""
    items = [work.pop(0)]
    rows, seen = len(items[0].tokens), {items[0].id}
    i = 0
    while i < len(work):
        part = work[i]
        if part.id not in seen and rows + len(part.tokens) <= limit:
            items.append(work.pop(i))
            rows += len(part.tokens)
        else:
            i += 1
        seen.add(part.id)
    return items
