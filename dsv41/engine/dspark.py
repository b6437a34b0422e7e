"""DSpark as the scheduler's drafter: the model's own draft stages (``model.dspark``), seeded with
the taps of the rows each step kept and drafting a block after each request's newest token.

The engine hands back the taps of its DSpark target layers (``Engine.taps``: graph nodes
``dspark.tap`` on the cards, the reference forward's capture) with every step; the drafter publishes
the kept rows' window rows (a prefill's last ``window`` rows; a verify step's accepted rows, never a
rejected one) and drafts the next block for every running request in one batched forward. A greedy
request's drafts are the stages' argmax (with the Markov bias); a sampling request's are drawn from
the draft distribution with a generator of its own, and that distribution goes with the drafts, so
the verify step accepts them by the speculative-sampling rule. The stages run in the engine's
process, over one copy of their weights. A request recomputed after preemption drafts nothing (its
taps were not seen); its tokens are the model's either way.
"""
from __future__ import annotations

import torch

from dsv41.engine.drafters import Drafter
from dsv41.model.dspark import DSpark, DSparkWindow
from dsv41.ops.rope import PLAIN, precompute_rope_tables
from dsv41.ops.sampling import RequestGenerator, apply_penalties, filtered_probs

DRAFT_STREAM = 0x5D5A_7E11      # a sampling request's drafts: a generator stream apart from its tokens'


class DSparkDrafter(Drafter):
    def __init__(self, engine, weights, k: int | None = None, confidence: float | None = None):
        """weights: the checkpoint's tensors in this process (the DSpark stages, embedding and LM
        head); k: drafts per step (default the config's block); confidence: a block ends at the
        first draft whose confidence (sigmoid of the head's score) is below it."""
        cfg = engine.cfg
        if not cfg.dspark:
            raise ValueError(f"--speculative dspark: {cfg.name} has no DSpark stages (n_mtp_layers 0)")
        block = cfg.dspark_block_size
        if k is not None and not 1 <= k <= block:
            raise ValueError(f"draft_tokens: must be in [1, {block}] (the DSpark block) , got {k}")
        if confidence is not None and not 0.0 <= confidence <= 1.0:
            raise ValueError(f"confidence_threshold: must be in [0, 1], got {confidence}")
        self.engine, self.cfg, self.k, self.confidence = engine, cfg, k or block, confidence
        self.model = DSpark(cfg, weights)
        self.tables = {PLAIN: precompute_rope_tables(cfg, engine.max_context + block + 1, PLAIN)}
        self.windows: dict[int, DSparkWindow] = {}          # job id -> its window
        engine.taps = tuple(sorted(set(cfg.dspark_target_layer_ids)))

    # ---- seeding ----------------------------------------------------------------------------------
    def observe(self, phase: str, jobs, out):
        """After a step: publish each job's kept rows (a prefill's last window rows)."""
        for i, job in enumerate(jobs):
            taps = out.taps[i]
            rows = next(iter(taps.values())).shape[0]
            if phase == "prefill":
                first, kept = 0, rows
                window = DSparkWindow(self.cfg)
            elif job.id in self.windows:
                window = self.windows[job.id]
                first, kept = window.length, rows - (out.proposed[i] if out.proposed else 0) + out.accepted[i]
            else:
                continue
            keep = slice(max(0, kept - self.cfg.sliding_window), kept)
            picked = {L: t[keep] for L, t in taps.items()}
            positions = torch.arange(first + keep.start, first + kept)
            self.windows[job.id] = window.published(self.model.seed(picked, positions, self.tables), positions)

    def forget(self, job):
        self.windows.pop(job.id, None)

    # ---- drafting ---------------------------------------------------------------------------------
    def propose_batch(self, jobs, rooms):
        ready = [i for i, (j, r) in enumerate(zip(jobs, rooms)) if r > 0 and j.id in self.windows]
        drafts, probs = [[] for _ in jobs], [None for _ in jobs]
        if not ready:
            return drafts, None
        picked = [jobs[i] for i in ready]
        dists: dict[int, list] = {i: [] for i in range(len(picked))}

        def sample(logits, pos):
            out = torch.empty(len(picked), dtype=torch.long)
            for b, job in enumerate(picked):
                p = job.params
                if p.greedy:
                    out[b] = int(torch.argmax(logits[b]))
                    continue
                q = filtered_probs(apply_penalties(logits[b], p, (), ()), p)
                # the request's seed, the draft's absolute position: the same draws on every layout
                at = self.windows[job.id].length + pos
                seed = RequestGenerator.draw_seed(self.engine.sequence(job.rid).seed ^ DRAFT_STREAM, at)
                out[b] = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(seed)))
                dists[b].append(q)
            return out
        draft = self.model.draft(torch.tensor([j.last for j in picked]), [self.windows[j.id] for j in picked],
                                 self.tables, sample)
        conf = torch.sigmoid(draft.confidence)
        for b, i in enumerate(ready):
            n = min(rooms[i], self.k)
            if self.confidence is not None:
                low = (conf[b, :n] < self.confidence).nonzero()
                n = int(low[0]) if low.numel() else n
            drafts[i] = draft.tokens[b, :n].tolist()
            if dists[b] and n:
                probs[i] = torch.stack(dists[b][:n])
        return drafts, probs if any(p is not None for p in probs) else None
