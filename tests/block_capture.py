"""Teacher-forced, per-block comparison of the reference forward with the independent one.

``capture_run`` runs the reference (prefill, then decode steps) with pass-through wrappers around
its stage helpers and records every block's inputs and outputs. ``compare_run`` feeds each block
of ``spec_forward`` the reference's own inputs (all positions of the request, recomputed from 0)
and collects per-stage differences, so one wrong stage shows where it is and chaotic growth
through later layers cannot hide it.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import pytest
import torch

import spec_forward as S
from dsv41.config import FULL, REINDEX
from dsv41.kernels.ties import block_selection, tie_mismatch_rows
from dsv41.model import attention as attention_module
from dsv41.model.attention import Attention
from dsv41.model.embedding import Engram
from dsv41.model.hyper import HyperSite
from dsv41.model.moe import MoE


@contextmanager
def recording(steps: list):
    """Wrap the reference's stage helpers; each call records into steps[-1]."""
    def layer(n):
        return steps[-1]["layers"].setdefault(n, {})

    def wrap(owner, name, rec, static=False):
        orig = getattr(owner, name)

        def wrapped(*args):
            out = orig(*args)
            rec(args, out)
            return out
        mp.setattr(owner, name, staticmethod(wrapped) if static else wrapped)

    def on_attention(args, out):
        attn, _, md, x, _, sel, _ = args
        cfg, spec = attn.cfg, attn.spec
        steps[-1]["md"] = md
        d = layer(spec.layer)
        d["a"], d["attn"] = x, out
        if spec.mode in (FULL, REINDEX):
            d["topk"] = sel[spec.layer]
        if spec.layer == cfg.candidate_source_layer_id:
            d["cand"] = sel["candidates"]

    with pytest.MonkeyPatch.context() as mp:
        wrap(Attention, "forward", on_attention)
        wrap(HyperSite, "mixes", lambda a, o: layer(a[0].layer).update({a[0].site + "_x": a[1], a[0].site + "_mix": o}))
        wrap(Engram, "forward", lambda a, o: layer(a[0].layer).update(eng_in=a[1], eng_ids=a[2], eng_out=o))
        wrap(MoE, "forward", lambda a, o: layer(a[0].layer).update(f=a[1], moe=o))
        wrap(MoE, "gate", lambda a, o: layer(a[0].layer).update(route=o))
        wrap(HyperSite, "head", lambda a, o: steps[-1].update(final=(a[0], a[1])), static=True)
        # index scores: index_scores records each chunk's rows, index_chunk files them under its layer
        wrap(attention_module, "index_scores", lambda a, o: steps[-1].setdefault("scores", []).append(o))
        wrap(Attention, "index_chunk",
             lambda a, o: layer(a[0].layer).setdefault("scores", []).append(steps[-1]["scores"].pop()))
        yield


def capture_run(model, prompts: list[list[int]], decode_steps: int) -> list[dict]:
    """Prefill the prompts, then greedy decode steps; one record per step."""
    steps = []
    with recording(steps):
        steps.append({"layers": {}, "batch": [list(p) for p in prompts]})
        out = model.prefill(prompts)
        steps[-1]["logits"], steps[-1]["rids"] = out.logits, list(out.request_ids)
        rids = list(out.request_ids)
        for _ in range(decode_steps):
            steps.append({"layers": {}, "batch": [[t] for t in out.last]})
            out = model.decode(out.last, rids)
            steps[-1]["logits"], steps[-1]["rids"] = out.logits, rids
    for r in rids:
        model.release(r)
    return steps


class Diffs:
    """Per stage: elements compared, elements not bit-equal, worst |err| in ulps of the row RMS (BF16
    ulps for BF16-valued stages, FP32 ulps for the FP32 ones), and selection mismatches."""

    def __init__(self):
        self.stats = defaultdict(lambda: [0, 0, 0.0, 8, 0, 0])
        self.selections: dict[str, list] = defaultdict(list)
        self.checked: dict[str, int] = defaultdict(int)

    def tensor(self, stage: str, mine: torch.Tensor, ref: torch.Tensor, bits: int = 8):
        a = mine.double().reshape(mine.shape[0], -1)
        r = ref.double().reshape(ref.shape[0], -1)
        assert a.shape == r.shape, (stage, a.shape, r.shape)
        rms = r.pow(2).mean(-1, keepdim=True).sqrt()
        ulp = torch.ldexp(torch.ones_like(rms), torch.frexp(rms)[1] - bits)
        err = ((a - r).abs() / ulp).amax().item() if a.numel() else 0.0
        st = self.stats[stage]
        st[0] += a.numel()
        st[1] += int((a != r).sum())
        st[2] = max(st[2], err)
        st[3] = bits
        st[4] += a.shape[0]
        st[5] += int((a != r).any(-1).sum())

    def selection(self, stage: str, mine: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, where):
        """Rows of two selections ([T, k] ids, -1 = none) that differ beyond swaps among equal scores."""
        self.checked[stage] += mine.shape[0]
        for t in tie_mismatch_rows(mine, ref, scores):
            self.selections[stage].append((*where, t, mine[t].tolist(), ref[t].tolist()))

    def exact(self, stage: str, mine: torch.Tensor, ref: torch.Tensor, where):
        self.checked[stage] += mine.shape[0]
        for t in torch.nonzero((mine != ref).reshape(mine.shape[0], -1).any(-1)).flatten().tolist():
            self.selections[stage].append((*where, t, mine[t].tolist(), ref[t].tolist()))

    def table(self) -> str:
        lines = [f"{'stage':16s} {'elements':>9s} {'differ':>7s} {'rows':>6s} {'differ':>6s} {'max ulp(rms)':>12s}"]
        for k, (n, d, e, bits, rows, drows) in sorted(self.stats.items()):
            lines.append(f"{k:16s} {n:9d} {d:7d} {rows:6d} {drows:6d} {e:12.3f} {'bf16' if bits == 8 else 'fp32'}")
        for k, n in sorted(self.checked.items()):
            bad = self.selections.get(k, [])
            lines.append(f"{k}: {n} checked, {len(bad)} differ" + (f", first {bad[0]}" if bad else ""))
        return "\n".join(lines)


def _logical(phys: torch.Tensor, req: int, table: torch.Tensor, bs: int) -> torch.Tensor:
    """Physical compressed-cache rows of one request -> its logical compressed positions (-1 stays)."""
    pages = {int(b): i for i, b in enumerate(table[req].tolist()) if b >= 0}
    return torch.tensor([-1 if p < 0 else pages[p // bs] * bs + p % bs for p in phys.tolist()],
                        dtype=torch.long)


def compare_run(cfg, W, steps: list[dict]) -> Diffs:
    d = Diffs()
    hc = cfg.hc_mult
    tokens: dict[int, list[int]] = {}
    prompt: dict[int, int] = {}
    a_hist: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
    for st in steps:
        md = st["md"]
        qsl = md.query_start_loc.tolist()
        for i, rid in enumerate(st["rids"]):
            rows = slice(qsl[i], qsl[i + 1])
            start = len(tokens.get(rid, []))
            tokens.setdefault(rid, []).extend(st["batch"][i])
            prompt.setdefault(rid, len(st["batch"][i]))
            n = len(tokens[rid])
            new = slice(start, n)
            state = S.LayerState({}, {})
            pre_in = S.initial_pre(n - start, hc)
            first = st["layers"][0]
            x_first = first.get("eng_in", first["attn_x"])
            d.tensor("embed", S.embed(W, torch.tensor(tokens[rid][new]), hc), x_first[rows])
            for spec in cfg.layers:
                L, rec = spec.layer, st["layers"][spec.layer]
                w = lambda k: W[f"layers.{L}.{k}"]                                   # noqa: E731
                x = rec["attn_x"][rows]
                if L in cfg.engram_layer_ids:
                    ids = S.engram_hash(cfg, L, tokens[rid])[new]
                    d.exact("engram ids", ids, rec["eng_ids"][rows].long(), (L, rid))
                    d.tensor("engram", S.engram(cfg, W, L, rec["eng_in"][rows], ids), rec["eng_out"][rows])
                ap, apost, acomb = S.mixes(x, w("hc_attn_fn"), w("hc_attn_scale"), w("hc_attn_base"), cfg)
                for name, mine, ref in zip(("mix pre", "mix post", "mix comb"), (ap, apost, acomb),
                                           rec["attn_mix"]):
                    d.tensor(name, mine, ref[rows], bits=24)
                d.tensor("attn in", S.rms_norm(S.collapse(x, pre_in), w("attn_norm.weight"), cfg.rms_norm_eps),
                         rec["a"][rows])
                a_hist[(rid, L)].append(rec["a"][rows])
                out, top, sc, mask = S.attention(cfg, W, spec, torch.cat(a_hist[(rid, L)]), state, prompt[rid])
                d.tensor(f"attn {spec.kind}", out[new], rec["attn"][rows])
                if top is not None:
                    ref_sc = torch.cat(rec["scores"])[rows][:, :sc.shape[1]]
                    mine_sc = sc[new]
                    finite = torch.isfinite(mine_sc)
                    d.exact("index score mask", finite, torch.isfinite(ref_sc), (L, rid))
                    d.tensor("index scores", torch.where(finite, mine_sc, 0), torch.where(finite, ref_sc, 0))
                    table = md.compressed_block_tables[spec.kv_source]
                    ref_pos = torch.stack([_logical(got, i, table, cfg.block_size) for got in rec["topk"][rows]])
                    d.selection(f"topk {spec.kind}", top[new], ref_pos, sc[new], (L, rid))
                if mask is not None:
                    # positions past the request's compressed rows are never visible: compare the rest
                    mine, bscores = mask
                    b = cfg.candidate_block_size
                    got = rec["cand"][rows][:, :mine.shape[1]].bool()
                    d.selection("candidates", block_selection(mine[new], b), block_selection(got, b), bscores[new],
                                (L, rid))
                h = rec["ffn_x"][rows]
                d.tensor("attn hidden", S.expand(rec["attn"][rows], x, apost, acomb), h)
                fp, fpost, fcomb = S.mixes(h, w("hc_ffn_fn"), w("hc_ffn_scale"), w("hc_ffn_base"), cfg)
                for name, mine, ref in zip(("mix pre", "mix post", "mix comb"), (fp, fpost, fcomb), rec["ffn_mix"]):
                    d.tensor(name, mine, ref[rows], bits=24)
                f = rec["f"][rows]
                d.tensor("ffn in", S.rms_norm(S.collapse(h, rec["attn_mix"][0][rows]), w("ffn_norm.weight"),
                                              cfg.rms_norm_eps), f)
                y, idx, wts, biased = S.moe(cfg, W, L, f)
                d.tensor("ffn out", y, rec["moe"][rows])
                ridx, rw = rec["route"]
                d.selection("router", idx, ridx[rows].long(), biased, (L, rid))
                if torch.equal(idx, ridx[rows].long()):
                    d.tensor("route weights", wts, rw[rows], bits=24)
                nxt = st["layers"].get(L + 1, {})
                x_next = nxt.get("eng_in", nxt.get("attn_x")) if nxt else st["final"][0]
                d.tensor("block out", S.expand(rec["moe"][rows], h, fpost, fcomb), x_next[rows])
                pre_in = rec["ffn_mix"][0][rows]
            x_fin, pre_fin = st["final"]
            last = slice(qsl[i + 1] - 1, qsl[i + 1])
            d.tensor("logits", S.head(cfg, W, x_fin[last], pre_fin[last]), st["logits"][i:i + 1], bits=24)
    return d
