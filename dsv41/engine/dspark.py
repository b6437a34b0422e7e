"""DSpark as the scheduler's drafter: the model's own draft stages (``model.dspark``), seeded with
the rows each step kept and drafting a block after each request's newest token.

On a graph engine the stages are graph nodes of every step (``graph.build`` with ``dspark``: seed,
draft and head nodes per DP group, placed as the backbone's, the windows card caches published with
the step), so a request's drafts are what its last step made (its ``Sequence.drafted``): ``GraphDrafts``
only cuts them to the room and the confidence threshold. A request recomputed after preemption
drafts again: its recompute prefill seeds its windows and drafts its next block (with the request's
own seed: the scheduler feeds it as chunks, as it does a prompt).

On the reference engine ``DSparkDrafter`` is the golden: the stages in the engine's process over its
weights, seeded with the taps the reference forward captures (``Engine.taps``): a prefill's last
``window`` rows, a verify step's accepted rows, never a rejected one, a recompute's rows after
preemption (the scheduler tells it each recompute chunk's step). A greedy request's drafts are
the stages' argmax (with the Markov bias); a sampling request's are drawn from the draft
distribution with a generator of its own (``model.dspark.seeded_sampler``), and that distribution
goes with the drafts, so the verify step accepts them by the speculative-sampling rule.
"""
from __future__ import annotations

import torch

from dsv41.engine.drafters import Drafter
from dsv41.model.dspark import DSpark, DSparkWindow, seeded_sampler
from dsv41.ops.rope import PLAIN, precompute_rope_tables


def dspark_drafter(engine, k: int | None = None, confidence: float | None = None) -> Drafter:
    """The DSpark drafter of an engine: in its graph, or (the reference) over its own weights."""
    host = getattr(engine, "host_weights", None)
    return GraphDrafts(engine, k, confidence) if host is None else DSparkDrafter(engine, host(), k, confidence)


def _options(cfg, k: int | None, confidence: float | None) -> int:
    """Checked drafts per step (default the config's block)."""
    if not cfg.dspark:
        raise ValueError(f"--speculative dspark: {cfg.name} has no DSpark stages (n_mtp_layers 0)")
    block = cfg.dspark_block_size
    if k is not None and not 1 <= k <= block:
        raise ValueError(f"draft_tokens: must be in [1, {block}] (the DSpark block) , got {k}")
    if confidence is not None and not 0.0 <= confidence <= 1.0:
        raise ValueError(f"confidence_threshold: must be in [0, 1], got {confidence}")
    return k or block


def _kept(confidence: torch.Tensor, n: int, threshold: float | None) -> int:
    """Drafts kept of the first n: up to the first whose confidence (sigmoid of the score) is below
    the threshold."""
    if threshold is None:
        return n
    low = (torch.sigmoid(confidence[:n]) < threshold).nonzero()
    return int(low[0]) if low.numel() else n


class GraphDrafts(Drafter):
    reads_states = True
    def __init__(self, engine, k: int | None = None, confidence: float | None = None):
        """k: drafts per step; confidence: a block ends at the first draft whose confidence is below it."""
        self.k, self.confidence, self.engine = _options(engine.cfg, k, confidence), confidence, engine
        engine.dspark = True

    def propose_batch(self, jobs, rooms):
        drafts, probs = [], []
        for job, room in zip(jobs, rooms):
            made = self.engine.host.sequence(job.id).drafted
            n = 0 if made is None else _kept(made[1], min(max(room, 0), self.k), self.confidence)
            drafts.append(made[0][:n].tolist() if n else [])
            probs.append(made[2][:n] if n and made[2] is not None else None)
        return drafts, probs if any(p is not None for p in probs) else None


class DSparkDrafter(Drafter):
    reads_states = True
    def __init__(self, engine, weights, k: int | None = None, confidence: float | None = None):
        """weights: the checkpoint's tensors in this process (the DSpark stages, embedding and LM
        head); k: drafts per step (default the config's block); confidence: a block ends at the
        first draft whose confidence (sigmoid of the head's score) is below it."""
        cfg = engine.cfg
        block = cfg.dspark_block_size
        self.engine, self.cfg, self.k, self.confidence = engine, cfg, _options(cfg, k, confidence), confidence
        self.model = DSpark(cfg, weights)
        self.tables = {PLAIN: precompute_rope_tables(cfg, engine.max_context + block + 1, PLAIN)}
        self.windows: dict[int, DSparkWindow] = {}          # request id -> its window
        engine.taps = tuple(sorted(set(cfg.dspark_target_layer_ids)))

    # ---- seeding ----------------------------------------------------------------------------------
    def observe(self, phase: str, jobs, out):
        """After a step: publish each job's kept rows (a prefill's last window rows; a recompute
        after preemption tells its steps too). jobs: one per request of the step, None for a
        request of the other phase (a prefill step's decode rows are told as "decode")."""
        for i, job in enumerate(jobs):
            if job is None:                   # not this phase's row in a step that mixes both
                continue
            taps = out.taps[i]
            rows = next(iter(taps.values())).shape[0]
            if phase == "prefill":            # a recompute's later chunks continue its window
                window = self.windows.get(job.id)
                if window is None:            # its first rows: past a cached prefix, not at 0
                    window = DSparkWindow(self.cfg, length=self.engine.host.sequence(job.id).kv_len - rows)
                first, kept = window.length, rows
            elif job.id in self.windows:
                window = self.windows[job.id]
                first, kept = window.length, out.kept[i]
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
        dists: dict[int, list] = {}
        windows = [self.windows[j.id] for j in picked]
        sample = seeded_sampler([(j.params, self.engine.host.sequence(j.id).seed, w.length) for j, w in zip(picked, windows)],
                                dists)
        draft = self.model.draft(torch.tensor([j.last for j in picked]), windows, self.tables, sample)
        for b, i in enumerate(ready):
            n = _kept(draft.confidence[b], min(rooms[i], self.k), self.confidence)
            drafts[i] = draft.tokens[b, :n].tolist()
            if b in dists and n:
                probs[i] = torch.stack(dists[b][:n])
        return drafts, probs if any(p is not None for p in probs) else None
