"""Builders of the decode and prefill graphs from (config, topology, per-group metadata, wiring).

Placement is decided here by the seed's rules: attention and mHC nodes by DP group and TP rank,
experts by EP rank, collectives on every card of their TP group.

Wirings (both as the seed describes):
- ``replicated``: every TP rank holds all rows of the residual stream; head-parallel attention
  partials meet in an all-reduce; MoE rows are owned round-robin (t mod TP) and re-assembled by a
  second (exact) all-reduce.
- ``sharded``: rank r holds the contiguous slab [r*W, r*W + count) with W = ceil(T/TP); the
  normalised attention input is all-gathered, the FP32 partials reduce-scattered; MoE consumes the
  slab rows directly and the residual never crosses the group.
"""
from __future__ import annotations

from dsv41.config import FULL, REINDEX, SWA, ModelConfig, Topology, slab
from dsv41.graph.graph import Graph
from dsv41.model import caches as cache
from dsv41.model.dspark import block_prefix
from dsv41.model.head import Head
from dsv41.model.transformer import Block
from dsv41.ops.indexer import score_chunks
from dsv41.ops.rope import COMPRESSED, PLAIN, profile_for

REPLICATED, SHARDED = "replicated", "sharded"
DRAFT, TARGET = "draft", "target"     # a node's part of a step (``Node.attrs['part']``; default the target)


def head_key(grp: int) -> str:
    """The node that makes a DP group's tokens (its value: the ids, in the group's batch order, or
    (ids, logprobs) when a request of the group asked for logprobs)."""
    return f"final/argmax@g{grp}"


def commit_key(card: int) -> str:
    return f"cache.commit@c{card}"


def tap_key(layer: int, card: int) -> str:
    return f"L{layer}/dspark.tap@c{card}"


def dspark_key(grp: int) -> str:
    """The node that makes a DP group's next DSpark drafts (``kernels.nodes.dspark.Drafts``)."""
    return f"dspark/head@g{grp}"


def step_outputs(topo: Topology, steps: dict, dspark: bool = False) -> list[str]:
    """What a step hands back: each group's tokens, every card's commit and, with DSpark drafting,
    each group's next drafts."""
    return [head_key(g) for g in steps] + [commit_key(c) for c in topo.cards] + \
        ([dspark_key(g) for g in steps] if dspark else [])


def local_rows(t: int, tp: int, rank: int, wiring: str) -> list[int]:
    """Rows of the residual stream a card holds."""
    if wiring == REPLICATED:
        return list(range(t))
    first, count = slab(t, tp, rank)
    return list(range(first, first + count))


def moe_rows(t: int, tp: int, rank: int, wiring: str) -> list[int]:
    """Rows (global) whose MoE a card runs: each token exactly once per TP group."""
    if wiring == REPLICATED:
        return list(range(rank, t, tp))
    return local_rows(t, tp, rank, wiring)


class _Builder:
    def __init__(self, cfg: ModelConfig, topo: Topology, steps: dict, wiring: str, phase: str, dspark: bool = False):
        if wiring not in (REPLICATED, SHARDED):
            raise ValueError(f"wiring: must be {REPLICATED!r} or {SHARDED!r}, got {wiring!r}")
        if dspark and not cfg.dspark:
            raise ValueError(f"dspark: {cfg.name} has no DSpark stages (n_mtp_layers 0)")
        self.cfg, self.topo, self.steps, self.wiring, self.dspark = cfg, topo, steps, wiring, dspark
        self.taps = tuple(sorted(set(cfg.dspark_target_layer_ids))) if dspark else ()
        self.g = Graph(phase)

    def collective(self, key_fn, kernel: str, group: list[int], inputs_fn, instance: str, layer=None,
                   **attrs) -> dict:
        """One node per participant card; each takes its input from every card of the group."""
        return {c: self.g.add(key_fn(c), kernel, inputs_fn(c), c, layer, group=tuple(group), instance=instance,
                              **attrs) for c in group}

    def build(self) -> Graph:
        cfg, topo, g = self.cfg, self.topo, self.g
        # x: each card's residual-stream node; mixes: its latest mHC site (the delayed pre mix source)
        x, mixes = {}, {}
        step_key, rope, t_of = {}, {}, {}
        for grp, step in self.steps.items():
            t = step.md.num_tokens
            for c in topo.group_cards(grp):
                t_of[c] = t
                step_key[c] = g.literal(f"step@c{c}", step, c)
                for prof, vec in [(PLAIN, "token"), (COMPRESSED, "token")] + \
                        [(COMPRESSED, s) for s in cfg.kv_source_layer_ids]:
                    rope[(c, prof, vec)] = g.add(f"rope/{prof}/{vec}@c{c}", "rope.rows", [step_key[c]], c,
                                                 profile=prof, vector=vec)
            for c, rows in self._embed(grp, step_key).items():
                x[c] = g.add(f"hc.pack@c{c}", "hc.pack", [rows], c)
                mixes[c] = None
        selections = {}   # (card, "pub" | "topk", layer) -> publication / Top-K node
        for spec in cfg.layers:
            L = spec.layer
            for grp, step in self.steps.items():
                group = topo.group_cards(grp)
                t = t_of[group[0]]
                attn_out = self._attention(spec, grp, group, t, x, mixes, step_key, rope, selections)
                for c in group:
                    x[c] = attn_out[c]
            self._moe(L, x, mixes, step_key)
        self._head(x, mixes, step_key)
        if self.dspark:
            self._dspark(step_key, rope)
        # commit waits for the whole step, on every card, before anything persists; a card of a group
        # with work takes its group's tokens first: they say which rows the step publishes
        sinks = g.sinks()
        for c in topo.cards:
            grp = topo.dp_group(c)
            head = [head_key(grp)] if grp in self.steps else []
            g.add(commit_key(c), "cache.commit", head + [k for k in sinks if k not in head], c, accepts=bool(head))
        return g

    # ---- vocab-parallel embedding of one DP group ------------------------------------------------
    def _embed(self, grp, step_key) -> dict:
        """Each TP rank looks up all the group's rows in its vocabulary shard (-0.0 outside it); the
        attention sub-layer's transport sums the shares, which is exact (one owner per row)."""
        g, group = self.g, self.topo.group_cards(grp)
        shares = {c: g.add(f"embed@c{c}", "embed", [step_key[c]], c) for c in group}
        return self._tp_reduce("embed", grp, group, shares)

    # ---- Engram of one DP group: table rows split over the EP world ------------------------------
    def _engram(self, L, grp, group, t, x, step_key):
        """Every card looks up the group's hashed ids in its slab of the table (-0.0 outside it); each
        card of the group adds all cards' shares of its rows in card order, then updates them."""
        g, topo = self.g, self.topo
        shares = []
        for c in topo.cards:
            step = step_key[c] if c in group else f"step@c{c}/g{grp}"   # the group's step metadata on c
            if step not in g.literals:
                g.literal(step, self.steps[grp], c)
            shares.append(g.add(f"L{L}/engram.lookup@c{c}/g{grp}", "engram.lookup", [step], c, L))
        for c in group:
            x[c] = g.add(f"L{L}/engram@c{c}", "engram", [x[c], step_key[c]] + shares, c, L,
                         rows=local_rows(t, topo.tp, topo.tp_rank(c), self.wiring))

    # ---- attention sub-layer of one DP group ----------------------------------------------------
    def _attention(self, spec, grp, group, t, x, mixes, step_key, rope, selections) -> dict:
        cfg, g, L, tp = self.cfg, self.g, spec.layer, self.topo.tp
        p = f"L{L}/attn"
        norm = {}
        if L in cfg.engram_layer_ids:
            self._engram(L, grp, group, t, x, step_key)
        if L in self.taps:
            for c in group:
                g.add(tap_key(L, c), "dspark.tap", [x[c]], c, L)
        for c in group:
            site = g.add(f"{p}/mixes@c{c}", "hc.mixes", [x[c]], c, L, site="attn")
            pre_in = [mixes[c]] if mixes[c] else []
            collapsed = g.add(f"{p}/pre@c{c}", "hc.pre", [x[c]] + pre_in, c, L, initial=not pre_in)
            norm[c] = g.add(f"{p}/norm@c{c}", "norm.rms", [collapsed], c, L, weight=Block.norm_key(L, "attn"))
            mixes[c] = site  # post uses it now, the FFN collapses with its pre
        full = self._gather(p, grp, group, norm, t, layer=L)
        out = {}
        partial = {}
        for c in group:
            rank = self.topo.tp_rank(c)
            cos_key = rope[(c, profile_for(spec.ratio), "token")]
            q = g.add(f"{p}/q_proj@c{c}", "attn.q_proj", [full[c], cos_key], c, L, tp_rank=rank)
            kv = g.add(f"{p}/kv_proj@c{c}", "attn.kv_proj", [full[c], cos_key], c, L)
            win = g.add(f"{p}/publish.window@c{c}", "attn.publish", [kv, step_key[c]], c, L,
                        cache="window", publishes=(cache.window(L),))
            if spec.mode == FULL:
                comp = g.add(f"{p}/compress@c{c}", "attn.compress", [full[c], step_key[c]], c, L,
                             reads_previous=(cache.ring(L),) if spec.ratio == 2 else ())
                published = cache.compressor_writes(spec)
                selections[(c, "pub", L)] = g.add(
                    f"{p}/publish.compressed@c{c}", "attn.publish", [comp, rope[(c, COMPRESSED, L)], step_key[c]],
                    c, L, cache="compressed", publishes=published)
            if spec.mode in (FULL, REINDEX):
                step = self.steps[grp]
                width = int(step.md.compressed_lens[spec.kv_source].max()) if t else 0
                chunks = score_chunks(t, width, cfg.index_score_budget_bytes, cfg.index_score_leaf)
                pub = selections[(c, "pub", spec.kv_source)]
                extra = [selections[(c, "topk", spec.candidate_source)]] if spec.mode == REINDEX else []
                parts = [g.add(f"{p}/index#{i}@c{c}", "attn.index", [q, full[c], cos_key, step_key[c], pub] + extra,
                               c, L, rows=(a, b), reads=(cache.index(spec.kv_source),))
                         for i, (a, b) in enumerate(chunks)]
                selections[(c, "topk", L)] = g.add(f"{p}/topk@c{c}", "attn.topk", parts, c, L)
            leaf_in = [q, step_key[c], win]
            reads = [cache.window(L)]
            if spec.mode != SWA:
                leaf_in += [selections[(c, "pub", spec.kv_source)], selections[(c, "topk", spec.index_source)]]
                reads.append(cache.compressed(spec.kv_source))
            leaf = g.add(f"{p}/leaf.{spec.kind}@c{c}", f"attn.leaf.{spec.kind}", leaf_in, c, L, tp_rank=rank,
                         reads=tuple(reads))
            partial[c] = g.add(f"{p}/o_proj@c{c}", "attn.o_proj", [leaf, cos_key], c, L, tp_rank=rank)
        reduced = self._tp_reduce(p, grp, group, partial, layer=L)
        for c in group:
            out[c] = g.add(f"{p}/post@c{c}", "hc.post", [reduced[c], x[c], mixes[c]], c, L, site="attn",
                           rows=local_rows(t, tp, self.topo.tp_rank(c), self.wiring))
        return out

    # ---- MoE sub-layer across the EP world -------------------------------------------------------
    def _moe(self, L, x, mixes, step_key, rows: dict | None = None):
        """rows: DP group -> the rows of its stream (default: its step's tokens)."""
        g, topo, p = self.g, self.topo, f"L{L}/moe"
        rows = rows or {grp: step.md.num_tokens for grp, step in self.steps.items()}
        active = [c for c in topo.cards if c in x]
        gate, dispatch, shared, ffn_mixes = {}, {}, {}, {}
        for c in active:
            ffn_mixes[c] = g.add(f"L{L}/ffn/mixes@c{c}", "hc.mixes", [x[c]], c, L, site="ffn")
            collapsed = g.add(f"L{L}/ffn/pre@c{c}", "hc.pre", [x[c], mixes[c]], c, L, initial=False)
            normed = g.add(f"L{L}/ffn/norm@c{c}", "norm.rms", [collapsed], c, L,
                           weight=block_prefix(self.cfg, L) + "ffn_norm.weight")
            t = rows[topo.dp_group(c)]
            gate[c] = g.add(f"{p}/gate@c{c}", "moe.gate", [normed], c, L,
                            rows=self._moe_local(t, topo.tp_rank(c)))
            dispatch[c] = g.add(f"{p}/dispatch@c{c}", "moe.dispatch", [gate[c]], c, L)
            shared[c] = g.add(f"{p}/shared@c{c}", "moe.shared", [gate[c]], c, L)
        experts = {e: g.add(f"{p}/experts@c{e}", "moe.experts", [dispatch[c] for c in active], e, L,
                            sources=tuple(active)) for e in topo.cards}
        combined = {c: g.add(f"{p}/combine@c{c}", "moe.combine", [gate[c], shared[c]] + list(experts.values()), c, L)
                    for c in active}
        for grp in self.steps:
            group = topo.group_cards(grp)
            if self.wiring == REPLICATED:
                t = rows[grp]
                merged = self.collective(lambda c: f"{p}/all_reduce@c{c}", "tp.all_reduce", group,
                                         lambda c: [combined[r] for r in group], f"{p}/all_reduce@g{grp}", layer=L,
                                         owners=[moe_rows(t, topo.tp, topo.tp_rank(r), REPLICATED) for r in group],
                                         rows=t)
            else:
                merged = {c: combined[c] for c in group}
            for c in group:
                x[c] = g.add(f"L{L}/ffn/post@c{c}", "hc.post", [merged[c], x[c], ffn_mixes[c]], c, L, site="ffn")
                mixes[c] = ffn_mixes[c]

    def _moe_local(self, t: int, rank: int) -> list[int]:
        """MoE rows as indices into the card's local rows."""
        held = local_rows(t, self.topo.tp, rank, self.wiring)
        pos = {r: i for i, r in enumerate(held)}
        return [pos[r] for r in moe_rows(t, self.topo.tp, rank, self.wiring)]

    # ---- final collapse, norm, LM head -------------------------------------------------------------
    def _head(self, x, mixes, step_key):
        g, topo = self.g, self.topo
        for grp, step in self.steps.items():
            group = topo.group_cards(grp)
            t = step.md.num_tokens
            normed = {}
            for c in group:
                h = g.add(f"final/hc.head@c{c}", "hc.head", [x[c], mixes[c]], c)
                normed[c] = g.add(f"final/norm@c{c}", "norm.final", [h], c, weight=Head.NORM)
            normed = self._gather("final", grp, group, normed, t)
            shards = [g.add(f"final/lm_head.shard@c{c}", "lm_head.shard", [normed[c], step_key[c]], c,
                            tp_rank=topo.tp_rank(c)) for c in group]
            g.add(head_key(grp), "lm_head.argmax", shards + [step_key[group[0]]], group[0], dp_group=grp)

    # ---- TP transport of one DP group --------------------------------------------------------------
    def _tp_reduce(self, name: str, grp: int, group: list[int], parts: dict, layer=None) -> dict:
        """The wiring's TP reduction of per-card partials: all-reduce (replicated) or reduce-scatter."""
        kernel, op = ("tp.reduce_scatter", "reduce_scatter") if self.wiring == SHARDED else ("tp.all_reduce", "all_reduce")
        return self.collective(lambda c: f"{name}/{op}@c{c}", kernel, group, lambda c: [parts[r] for r in group],
                               f"{name}/{op}@g{grp}", layer=layer)

    def _gather(self, name: str, grp: int, group: list[int], rows: dict, t: int, layer=None) -> dict:
        """All rows on every card of the group: the slabs all-gathered (sharded), or as they are."""
        if self.wiring != SHARDED:
            return rows
        tp = self.topo.tp
        return self.collective(lambda c: f"{name}/all_gather@c{c}", "tp.all_gather", group,
                               lambda c: [rows[r] for r in group], f"{name}/all_gather@g{grp}", layer=layer,
                               counts=[slab(t, tp, self.topo.tp_rank(r))[1] for r in group])

    # ---- DSpark: seed the windows with the kept rows, draft the next block ---------------------------
    def _dspark(self, step_key, rope):
        """Per DP group after its head's verdict: the kept rows' taps seed the stages' window caches,
        then the stages draft the next block (a backbone-shaped sub-graph over B*block rows: heads by
        TP rank, experts by EP rank) and the group's DSpark head draws the drafts."""
        cfg, g, topo, tp = self.cfg, self.g, self.topo, self.topo.tp
        first = len(g.nodes)
        n = cfg.num_hidden_layers
        windows = tuple(cache.window(n + s) for s in range(cfg.n_mtp_layers))
        x, mixes, drope, published, rows = {}, {}, {}, {}, {}
        for grp, step in self.steps.items():
            group, head = topo.group_cards(grp), head_key(grp)
            t, b = step.md.num_tokens, len(step.rids) * cfg.dspark_block_size
            rows[grp] = b
            seeds = {c: g.add(f"dspark/seed@c{c}", "dspark.seed",
                              [rope[(c, PLAIN, "token")]] + [tap_key(L, c) for L in cfg.dspark_target_layer_ids],
                              c, rows=local_rows(t, tp, topo.tp_rank(c), self.wiring)) for c in group}
            seeds = self._gather("dspark/seed", grp, group, seeds, t)
            shares = {}
            for c in group:
                published[c] = g.add(f"dspark/publish@c{c}", "dspark.publish", [seeds[c], head, step_key[c]], c,
                                     publishes=windows)
                shares[c] = g.add(f"dspark/embed@c{c}", "dspark.embed", [head, step_key[c]], c)
                drope[c] = g.add(f"dspark/rope@c{c}", "dspark.rope", [head, step_key[c]], c)
            for c, reduced in self._tp_reduce("dspark/embed", grp, group, shares).items():
                x[c] = g.add(f"dspark/hc.pack@c{c}", "hc.pack", [reduced], c)
                mixes[c] = None
        for s in range(cfg.n_mtp_layers):
            L = n + s
            for grp in self.steps:
                self._dspark_attention(L, grp, rows[grp], x, mixes, step_key, drope, published)
            self._moe(L, x, mixes, step_key, rows)
        for grp in self.steps:
            group = topo.group_cards(grp)
            hidden = {c: g.add(f"dspark/hc.head@c{c}", "hc.head", [x[c], mixes[c]], c) for c in group}
            hidden = self._gather("dspark/hidden", grp, group, hidden, rows[grp])
            shards = [g.add(f"dspark/shard@c{c}", "dspark.shard", [hidden[c]], c, tp_rank=topo.tp_rank(c))
                      for c in group]
            g.add(dspark_key(grp), "dspark.head", shards + [hidden[group[0]], head_key(grp), step_key[group[0]]],
                  group[0], dp_group=grp)
        # the draft part of the step (traces tell it from the target model's forward, which verifies)
        for key in list(g.nodes)[first:]:
            g.nodes[key].attrs["part"] = DRAFT
        for key in g.nodes:
            if g.nodes[key].kernel == "dspark.tap":
                g.nodes[key].attrs["part"] = DRAFT

    def _dspark_attention(self, L, grp, t, x, mixes, step_key, drope, published):
        """One stage's attention sub-layer over a group's block rows (``t``), as the backbone's."""
        g, topo, p = self.g, self.topo, f"L{L}/attn"
        group, head = topo.group_cards(grp), head_key(grp)
        norm, partial = {}, {}
        for c in group:
            site = g.add(f"{p}/mixes@c{c}", "hc.mixes", [x[c]], c, L, site="attn")
            pre_in = [mixes[c]] if mixes[c] else []
            collapsed = g.add(f"{p}/pre@c{c}", "hc.pre", [x[c]] + pre_in, c, L, initial=not pre_in)
            norm[c] = g.add(f"{p}/norm@c{c}", "norm.rms", [collapsed], c, L,
                            weight=block_prefix(self.cfg, L) + "attn_norm.weight")
            mixes[c] = site
        full = self._gather(p, grp, group, norm, t, layer=L)
        for c in group:
            partial[c] = g.add(f"{p}/dspark.attn@c{c}", "dspark.attn", [full[c], drope[c], head, step_key[c],
                                                                          published[c]], c, L,
                               tp_rank=topo.tp_rank(c), reads=(cache.window(L),))
        reduced = self._tp_reduce(p, grp, group, partial, layer=L)
        for c in group:
            x[c] = g.add(f"{p}/post@c{c}", "hc.post", [reduced[c], x[c], mixes[c]], c, L, site="attn",
                         rows=local_rows(t, topo.tp, topo.tp_rank(c), self.wiring))


def shape(cfg: ModelConfig, steps: dict) -> tuple:
    """All a graph's structure depends on: the DP groups with work, their rows, their requests (DSpark
    drafts a block of rows per request) and the index chunks per indexed source. Steps of one shape
    differ only in their ``step@c*`` literals."""
    sources = sorted({spec.kv_source for spec in cfg.layers if spec.mode in (FULL, REINDEX)})
    out = []
    for grp, step in sorted(steps.items()):
        t = step.md.num_tokens
        chunks = tuple(tuple(score_chunks(t, int(step.md.compressed_lens[s].max()) if t else 0,
                                          cfg.index_score_budget_bytes, cfg.index_score_leaf)) for s in sources)
        out.append((grp, t, len(step.rids), chunks))
    return tuple(out)


def feed(graph: Graph, topo: Topology, steps: dict):
    """Give a graph built for steps of the same shape this step's inputs: the group's own cards
    (``step@c{c}``) and the cards outside it that look up its Engram rows (``step@c{c}/g{grp}``)."""
    for grp, step in steps.items():
        for c in topo.cards:
            key = f"step@c{c}" if c in topo.group_cards(grp) else f"step@c{c}/g{grp}"
            if key in graph.literals:
                graph.literals[key] = (step, c)


def build(cfg: ModelConfig, topo: Topology, steps: dict, wiring: str = SHARDED, phase: str = "decode",
          dspark: bool = False) -> Graph:
    """steps: DP group -> StepInputs for groups with work this step; dspark: the step also seeds the
    DSpark windows with the rows it keeps and drafts each request's next block."""
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase: must be 'decode' or 'prefill', got {phase!r}")
    return _Builder(cfg, topo, steps, wiring, phase, dspark).build()
