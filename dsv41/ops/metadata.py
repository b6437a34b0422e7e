"""Forward-metadata lowering: packed requests + block tables -> every per-token index the layers use.

One lowering serves packed prefill and continuous-batch decode. Every input is validated before
anything is derived, and a bad input raises ValueError naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

I32, I64 = torch.int32, torch.int64


@dataclass(frozen=True)
class ForwardMetadata:
    query_start_loc: torch.Tensor        # i32 [B+1]
    query_lens: torch.Tensor             # i32 [B]
    logit_row_indices: torch.Tensor      # i32 [B], -1 for an empty request
    token_to_req_indices: torch.Tensor   # i32 [T]
    position_ids: torch.Tensor           # i32 [T]
    kv_seq_lens: torch.Tensor            # i32 [B]
    window_slots: torch.Tensor           # i64 [T]
    window_lens: torch.Tensor            # i32 [T]
    window_indices: torch.Tensor         # i32 [T, W]
    window_list_widths: torch.Tensor     # i32 [T], window slots the attention lists before the compressed ones
    compressed_slots: dict               # source -> i64 [T]
    compressed_lens: dict                # source -> i32 [T], causal visible compressed rows
    compressed_rope_position_ids: dict   # source -> i32 [T], group start or -1
    compressed_block_tables: dict        # source -> i32 [B, P']
    state_block_tables: dict             # ratio-2 source -> i32 [B, 1]

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_requests(self) -> int:
        return self.query_lens.shape[0]


def paged_slots(pos, req, table, block_size: int, div: int = 1, only_complete: bool = False,
                field: str = "block_table") -> torch.Tensor:
    """Physical slot of logical row floor(pos/div) of request req; -1 where a group is incomplete."""
    pos, req = pos.long(), req.long()
    if req.numel() and (int(req.min()) < 0 or int(req.max()) >= table.shape[0]):
        raise ValueError(f"{field}: request index outside the table's {table.shape[0]} rows")
    logical = pos // div
    page, off = logical // block_size, logical % block_size
    keep = (pos >= 0) & (((pos + 1) % div == 0) if (only_complete and div > 1) else torch.ones_like(pos, dtype=torch.bool))
    if keep.any():
        pk = page[keep]
        if int(pk.max()) >= table.shape[1]:
            raise ValueError(f"{field}: page {int(pk.max())} >= table width {table.shape[1]}")
        phys = table.long()[req[keep], pk]
        if int(phys.min()) < 0:
            raise ValueError(f"{field}: a page needed by a token maps to a negative physical block")
    slots = torch.full_like(pos, -1)
    if keep.any():
        slots[keep] = phys * block_size + off[keep]
    return slots


def _as_int(t, name: str, ndim: int) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != ndim:
        raise ValueError(f"{name}: must be an int32/int64 tensor with {ndim} dims, got {t.dtype} {tuple(t.shape)}")
    return t.long()


def _need_pages(table, first_row, end_row, active, block_size: int, field: str):
    """Every request with work needs valid pages covering logical rows [first_row, end_row)."""
    for b in torch.nonzero(active).flatten().tolist():
        lo, hi = int(first_row[b]) // block_size, (int(end_row[b]) + block_size - 1) // block_size
        if hi > table.shape[1]:
            raise ValueError(f"{field}: request {b} needs {hi} pages, table width is {table.shape[1]}")
        if hi > lo and int(table[b, lo:hi].min()) < 0:
            raise ValueError(f"{field}: request {b} has an unallocated (negative) page in [{lo}, {hi})")


def lower(cfg, query_start_loc, kv_seq_lens, window_block_table, compressed_block_tables: dict,
          state_block_tables: dict, prompt_lens) -> ForwardMetadata:
    """Lower packed requests to ForwardMetadata (see spec 01 §2). prompt_lens: each request's whole
    prompt (its record's, not this step's rows), which sizes its rows' attention slot lists."""
    qsl = _as_int(query_start_loc, "query_start_loc", 1)
    if qsl.numel() < 1 or int(qsl[0]) != 0:
        raise ValueError("query_start_loc: must start at 0 and have B+1 >= 1 entries")
    lens = qsl[1:] - qsl[:-1]
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError("query_start_loc: must be nondecreasing")
    b = lens.numel()
    kv = _as_int(kv_seq_lens, "kv_seq_lens", 1)
    if kv.shape != (b,):
        raise ValueError(f"kv_seq_lens: must have shape [{b}], got {tuple(kv.shape)}")
    if b and int(kv.min()) < 0:
        raise ValueError("kv_seq_lens: must be >= 0")
    new_kv = kv + lens
    prompt = _as_int(prompt_lens, "prompt_lens", 1)
    if prompt.shape != (b,):
        raise ValueError(f"prompt_lens: must have shape [{b}], got {tuple(prompt.shape)}")
    if b and int(prompt.min()) < 0:
        raise ValueError("prompt_lens: must be >= 0")
    if b and int(new_kv.max()) > cfg.max_position_embeddings:
        raise ValueError(f"position_ids: positions must be < max_position_embeddings "
                         f"{cfg.max_position_embeddings}, got {int(new_kv.max()) - 1}")
    wtab = _as_int(window_block_table, "window_block_table", 2)
    if wtab.shape[0] != b:
        raise ValueError(f"window_block_table: must have {b} rows, got {wtab.shape[0]}")
    bs, w = cfg.block_size, cfg.sliding_window
    active = lens > 0
    _need_pages(wtab, (kv - w + 1).clamp_min(0), new_kv, active, bs, "window_block_table")

    kv_sources = cfg.kv_source_layer_ids
    missing = [s for s in kv_sources if s not in compressed_block_tables]
    if missing:
        raise ValueError(f"compressed_block_tables: missing KV source(s) {missing}")
    ctabs = {s: _as_int(compressed_block_tables[s], f"compressed_block_tables[{s}]", 2) for s in kv_sources}
    for s in kv_sources:
        if ctabs[s].shape[0] != b:
            raise ValueError(f"compressed_block_tables[{s}]: must have {b} rows, got {ctabs[s].shape[0]}")
        peer = next(p for p in kv_sources if cfg.compress_ratios[p] == cfg.compress_ratios[s])
        if not torch.equal(ctabs[s], ctabs[peer]):
            raise ValueError(f"compressed_block_tables[{s}]: sources of equal ratio must pass identical tables "
                             f"(differs from source {peer})")
    stabs = {}
    for s in kv_sources:
        if cfg.compress_ratios[s] < 2:
            continue
        if s not in state_block_tables:
            raise ValueError(f"state_block_tables: missing ratio-2 source {s}")
        st = _as_int(state_block_tables[s], f"state_block_tables[{s}]", 2)
        if st.shape != (b, 1):
            raise ValueError(f"state_block_tables[{s}]: must have shape [{b}, 1], got {tuple(st.shape)}")
        if b and int(st.min()) < -1:
            raise ValueError(f"state_block_tables[{s}]: entries must be >= -1 (-1 = inactive)")
        live = st[st >= 0]
        if live.unique().numel() != live.numel():
            raise ValueError(f"state_block_tables[{s}]: live state blocks must be distinct")
        stabs[s] = st.to(I32)

    req = torch.repeat_interleave(torch.arange(b), lens)
    t = req.numel()
    row = torch.arange(t)
    pos = kv[req] + (row - qsl[:-1][req])
    wslots = paged_slots(pos, req, wtab, bs, field="window_block_table")
    wlens = (pos + 1).clamp(max=w)
    col = torch.arange(w)
    win_pos = pos.unsqueeze(1) - wlens.unsqueeze(1) + 1 + col            # ascending, pos-len+1 .. pos
    win_ok = col.unsqueeze(0) < wlens.unsqueeze(1)
    win_pos = torch.where(win_ok, win_pos, torch.full_like(win_pos, -1))
    win_idx = paged_slots(win_pos.flatten(), req.repeat_interleave(w), wtab, bs,
                          field="window_block_table").reshape(t, w)

    per_source = {k: {} for k in ("slots", "lens", "rope")}
    for s in kv_sources:
        r = cfg.compress_ratios[s]
        cmp_len = new_kv // r
        _need_pages(ctabs[s], torch.zeros_like(kv), cmp_len, active, bs, f"compressed_block_tables[{s}]")
        slots = paged_slots(pos, req, ctabs[s], bs, div=r, only_complete=True,
                            field=f"compressed_block_tables[{s}]")
        if s in stabs:
            slots = torch.where(stabs[s][req, 0] < 0, torch.full_like(slots, -1), slots)
        closes = (pos + 1) % r == 0
        per_source["slots"][s] = slots
        per_source["lens"][s] = ((pos + 1) // r).to(I32)
        per_source["rope"][s] = torch.where(closes, pos + 1 - r, torch.full_like(pos, -1)).to(I32)

    return ForwardMetadata(
        query_start_loc=qsl.to(I32), query_lens=lens.to(I32),
        logit_row_indices=torch.where(lens > 0, qsl[1:] - 1, torch.full_like(lens, -1)).to(I32),
        token_to_req_indices=req.to(I32), position_ids=pos.to(I32), kv_seq_lens=kv.to(I32),
        window_slots=wslots.to(I64), window_lens=wlens.to(I32), window_indices=win_idx.to(I32),
        window_list_widths=_window_list_widths(pos, prompt[req], w).to(I32),
        compressed_slots=per_source["slots"], compressed_lens=per_source["lens"],
        compressed_rope_position_ids=per_source["rope"],
        compressed_block_tables={s: ctabs[s].to(I32) for s in kv_sources}, state_block_tables=stabs,
    )


def _window_list_widths(pos: torch.Tensor, prompt: torch.Tensor, window: int) -> torch.Tensor:
    """Window slots the official attention lists for a row at position pos of a request whose prompt
    has ``prompt`` tokens: min(prompt, window) for a prompt row, the whole window for a generated one.

    The one-step prefill lists min(prompt, window) slots on every row, decode the whole window. The
    leaf tiles the list [window | compressed] 64 slots at a time and rounds per tile, so this width
    is part of a row's bits: it comes from the whole prompt, never from the rows of the step (a
    chunk, a recompute or the rows after a cached prefix list what the one-step prefill lists)."""
    return torch.where(pos < prompt, prompt.clamp(max=window), torch.full_like(pos, window))


def replay_rows(md: ForwardMetadata, window: int) -> tuple[ForwardMetadata, torch.Tensor]:
    """SWA bounded replay (approximate, prefill of fresh prompts only): keep each request's last
    min(len, window) rows and truncate their windows to those rows.

    Returns the metadata of the kept rows (per-token fields sliced, windows cut to the newest
    entries inside the replay span) and the kept packed-row indices.
    """
    qsl, lens = md.query_start_loc.long(), md.query_lens.long()
    if md.kv_seq_lens.numel() and int(md.kv_seq_lens.max()) != 0:
        raise ValueError("kv_seq_lens: bounded replay needs fresh prompts (all kv_seq_lens == 0)")
    keep_n = lens.clamp(max=window)
    rows = torch.cat([torch.arange(int(qsl[b + 1] - keep_n[b]), int(qsl[b + 1])) for b in range(lens.numel())]
                     or [torch.zeros(0, dtype=I64)])
    req = md.token_to_req_indices.long()[rows]
    pos = md.position_ids.long()[rows]
    start = (lens - keep_n)[req]                       # first replay position of the row's request
    old_len = md.window_lens.long()[rows]
    new_len = torch.minimum(old_len, pos - start + 1)
    col = torch.arange(md.window_indices.shape[1])
    src = (old_len - new_len).unsqueeze(1) + col       # newest new_len entries moved to the front
    win = torch.gather(md.window_indices[rows].long(), 1, src.clamp(max=md.window_indices.shape[1] - 1))
    win = torch.where(col < new_len.unsqueeze(1), win, torch.full_like(win, -1))
    new_qsl = torch.cat([torch.zeros(1, dtype=I64), torch.cumsum(keep_n, 0)])
    per_token = lambda d: {s: v[rows] for s, v in d.items()}  # noqa: E731
    return ForwardMetadata(
        query_start_loc=new_qsl.to(I32), query_lens=keep_n.to(I32),
        logit_row_indices=torch.where(keep_n > 0, new_qsl[1:] - 1, torch.full_like(keep_n, -1)).to(I32),
        token_to_req_indices=req.to(I32), position_ids=pos.to(I32), kv_seq_lens=md.kv_seq_lens,
        window_slots=md.window_slots[rows], window_lens=new_len.to(I32), window_indices=win.to(I32),
        window_list_widths=md.window_list_widths[rows],
        compressed_slots={s: torch.full_like(v[rows], -1) for s, v in md.compressed_slots.items()},
        compressed_lens=per_token(md.compressed_lens),
        compressed_rope_position_ids=per_token(md.compressed_rope_position_ids),
        compressed_block_tables=md.compressed_block_tables, state_block_tables=md.state_block_tables,
    ), rows
