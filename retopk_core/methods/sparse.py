"""Building blocks shared by every sparse method: indexed scores, Top-K, exact selection, sparse attend.

All scores are e_i = q . k_i * scale (scale = 1/sqrt(d) by default), accumulated in float32.
Positions are int64 with -1 as padding; a padded position is never scored, selected or attended.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from retopk_core.kv import PagedKV
from retopk_core.workspace import Workspace  # noqa: F401  (re-exported: methods import it from here)

NEG_INF = float("-inf")
# A batch whose keys (B x L_max x H_kv x d elements) fit this goes through the exact path as one padded
# gather + matmul (``_exact_select_short``): 4M float32 elements = 16 MB.
SHORT_BATCH_KEYS = 1 << 22


def resolve_scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def kv_heads(num_heads: int, num_kv_heads: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """KV head read by each query head (GQA): h // (H // H_kv). -> (H,) int64."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)


def indexed_scores(q: torch.Tensor, kv: PagedKV, b: torch.Tensor, g: torch.Tensor, pos: torch.Tensor,
                   scale: float, ws: Workspace | None = None) -> torch.Tensor:
    """Exact scores of query rows against keys at given positions.

    q    (N, d)     one query per row
    b, g (N,)       sequence and KV head of each row
    pos  (N, M)     positions to score, -1 = padding
    ->   (N, M)     float32 scores, -inf at padding
    """
    valid = pos >= 0  # (N, M)
    rows = kv.flat_rows(b.unsqueeze(1), g.unsqueeze(1), pos.clamp(min=0))  # (N, M)
    out = None if ws is None else ws.take("keys", rows.numel() * kv.head_dim, kv.k_pool.dtype, kv.k_pool.device)
    keys = kv.gather_k(rows, out)  # (N, M, d)
    # (N, 1, d) @ (N, d, M): the row-vector form runs faster on the CPU than (N, M, d) @ (N, d, 1)
    scores = torch.bmm((q.float() * scale).unsqueeze(1), keys.float().transpose(1, 2)).squeeze(1)  # (N, M)
    return scores.masked_fill(~valid, NEG_INF)


def topk_select(scores: torch.Tensor, pos: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row's scores, padded to k when a row has fewer valid entries.

    scores (N, M) float32 (-inf = padding), pos (N, M) int64 or None (column j is position j)
    ->  (sel_pos (N, k) -1 padded, sel_scores (N, k) -inf padded)
    """
    N, M = scores.shape
    kk = min(k, M)
    top, idx = scores.topk(kk, dim=-1)  # (N, kk)
    sel = (idx if pos is None else pos.gather(-1, idx)).masked_fill(top == NEG_INF, -1)  # (N, kk)
    if kk < k:
        sel = torch.cat([sel, sel.new_full((N, k - kk), -1)], dim=-1)
        top = torch.cat([top, top.new_full((N, k - kk), NEG_INF)], dim=-1)
    return sel, top


def exact_select(q: torch.Tensor, kv: PagedKV, k: int, scale: float, need: torch.Tensor | None = None,
                 sel_pos: torch.Tensor | None = None, sel_scores: torch.Tensor | None = None,
                 ws: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact Top-K over the full history (equation 1) for the heads in ``need``.

    q (B, H, d); need (B, H) bool (None = every head). The keys of one (sequence, KV head) are read
    once for all of its query heads that need them: the exact path is memory-bound, so the
    granularity of the work is the KV group. The (n, L) score rows go into ``ws`` when given: a fresh
    multi-MB buffer per group costs page faults whenever the allocator cannot recycle the last one
    (ReTopK's fallback steps, between reuse steps). A batch of short histories skips the loop
    (``_exact_select_short``). Results are written into sel_pos (B, H, k) int64 and sel_scores
    (B, H, k) float32 (created -1 / -inf when not given) and returned.
    """
    B, H, _ = q.shape
    H_kv = kv.num_kv_heads
    G = H // H_kv
    if sel_pos is None:
        sel_pos = torch.full((B, H, k), -1, dtype=torch.long, device=q.device)
        sel_scores = torch.full((B, H, k), NEG_INF, dtype=torch.float32, device=q.device)
    need_g = (torch.ones(B, H, dtype=torch.bool, device=q.device) if need is None else need).view(B, H_kv, G)
    if B > 1 and B * int(kv.lengths.max()) * H_kv * kv.head_dim <= SHORT_BATCH_KEYS:
        return _exact_select_short(q, kv, k, scale, need_g.view(B, H), sel_pos, sel_scores)
    whole_seq = need_g.flatten(1).all(-1).tolist()  # (B,) every head of the sequence falls back
    for b, g in need_g.any(-1).nonzero().tolist():  # Python loop over (sequence, KV group), not over tokens
        L = int(kv.lengths[b])
        if whole_seq[b]:  # all groups at once: one batched matmul and one Top-K for the H heads
            if g == 0:
                qs = q[b].float().view(H_kv, G, -1) * scale  # (H_kv, G, d)
                scores = group_scores(qs, kv, b, L, ws).flatten(0, 1)  # (H, L)
                sel_pos[b], sel_scores[b] = topk_select(scores, None, k)
            continue
        heads = torch.arange(g * G, (g + 1) * G, device=q.device)[need_g[b, g]]  # (n,)
        qs = q[b, heads].float().unsqueeze(0) * scale  # (1, n, d)
        scores = group_scores(qs, kv, b, L, ws, group=g)[0]  # (n, L), column = position
        sp, ss = topk_select(scores, None, k)  # (n, k)
        sel_pos[b, heads] = sp
        sel_scores[b, heads] = ss
    return sel_pos, sel_scores


def _exact_select_short(q: torch.Tensor, kv: PagedKV, k: int, scale: float, need: torch.Tensor,
                        sel_pos: torch.Tensor, sel_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exact_select`` for a batch of short histories: one padded gather of the keys of every
    sequence that needs the exact path, one batched matmul, one Top-K, instead of a Python loop over
    (sequence, KV group) pairs whose ~10 small ops each outweigh the scoring itself. Heads that do not
    need it are scored too (cheap at this size) and left as they were.

    need (B, H) bool; sel_pos, sel_scores (B, H, k) updated where ``need`` and returned.
    """
    _, H, d = q.shape
    H_kv = kv.num_kv_heads
    rows = need.any(-1).nonzero().flatten()  # (B',) sequences with some head on the exact path
    if rows.numel() == 0:
        return sel_pos, sel_scores
    n = rows.numel()
    flat, past = kv.padded_rows(rows)  # (B', H_kv, L_max), (B', 1, L_max)
    keys = kv.gather_k(flat).float()  # (B', H_kv, L_max, d)
    qs = q[rows].float().view(n, H_kv, H // H_kv, d) * scale  # (B', H_kv, G, d)
    scores = torch.matmul(qs, keys.transpose(-1, -2)).masked_fill(past.unsqueeze(1), NEG_INF)  # (B', H_kv, G, L_max)
    sp, ss = topk_select(scores.view(n * H, -1), None, k)  # (B'*H, k)
    keep = need[rows].unsqueeze(-1)  # (B', H, 1)
    sel_pos[rows] = torch.where(keep, sp.view(n, H, k), sel_pos[rows])
    sel_scores[rows] = torch.where(keep, ss.view(n, H, k), sel_scores[rows])
    return sel_pos, sel_scores


def sparse_attend(kv: PagedKV, sel_pos: torch.Tensor, sel_scores: torch.Tensor, out_dtype: torch.dtype,
                  ws: Workspace | None = None) -> torch.Tensor:
    """Softmax over the selected exact scores and the weighted sum of their values (equation 12).

    sel_pos (B, H, K) int64 (-1 padded), sel_scores (B, H, K) float32 (-inf at padding; every row
    has at least one valid entry)  ->  out (B, H, d_v) in out_dtype
    """
    B, H, K = sel_pos.shape
    kvh = kv_heads(H, kv.num_kv_heads, sel_pos.device)
    b = torch.arange(B, device=sel_pos.device).view(B, 1, 1)
    rows = kv.flat_rows(b, kvh.view(1, H, 1), sel_pos.clamp(min=0))  # (B, H, K)
    weights = torch.softmax(sel_scores, dim=-1)  # (B, H, K) float32, 0 at padding
    if kv.v_pool.dtype == torch.float32:
        # one fused gather + weighted sum per (b, h) bag, without materialising the (B, H, K, d_v)
        # gathered values
        out = F.embedding_bag(rows.view(B * H, K), kv.v_pool.view(-1, kv.v_pool.shape[-1]), mode="sum",
                              per_sample_weights=weights.view(B * H, K))  # (B*H, d_v)
        return out.view(B, H, -1).to(out_dtype)
    buf = None if ws is None else ws.take("values", rows.numel() * kv.v_pool.shape[-1], kv.v_pool.dtype,
                                          kv.v_pool.device)
    values = kv.gather_v(rows, buf)  # (B, H, K, d_v)
    out = torch.matmul(weights.unsqueeze(-2), values.float()).squeeze(-2)  # (B, H, d_v)
    return out.to(out_dtype)


def dense_attend(q: torch.Tensor, kv: PagedKV, scale: float) -> torch.Tensor:
    """Full softmax attention of each sequence's current query over its whole history: q (B, H, d) ->
    out (B, H, d_v). See ``dense_attend_topk``."""
    return dense_attend_topk(q, kv, scale, 0)[0]


def dense_attend_topk(q: torch.Tensor, kv: PagedKV, scale: float, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full attention, and with k > 0 also each head's exact Top-k support from the same scores.

    out_h = softmax(e_h) V over every position i < L_b, e_h,i = q_h . k_i * scale;  S_h = TopK_i e_h,i (eq. 1)
    q (B, H, d) -> (out (B, H, d_v) in q.dtype, S (B, H, k) int64 -1 padded, or None when k = 0).
    A batch of short histories: one padded gather, two matmuls. Otherwise per sequence, every KV group
    at once: scores over the keys read in place run by run (``group_scores``), softmax, then the
    weighted sum over the value blocks. ReTopK's dense floor takes the support to fill its FIFO.
    """
    B, H, d = q.shape
    H_kv = kv.num_kv_heads
    G = H // H_kv
    sel = torch.full((B, H, k), -1, dtype=torch.long, device=q.device) if k else None
    if B > 1 and B * int(kv.lengths.max()) * H_kv * d <= SHORT_BATCH_KEYS:  # see _exact_select_short
        flat, past = kv.padded_rows()  # (B, H_kv, L_max), (B, 1, L_max)
        scores = torch.matmul(q.float().view(B, H_kv, G, d) * scale, kv.gather_k(flat).float().transpose(-1, -2))
        scores = scores.masked_fill(past.unsqueeze(1), NEG_INF)  # (B, H_kv, G, L_max)
        if k:
            sel = topk_select(scores.view(B * H, -1), None, k)[0].view(B, H, k)
        w = torch.softmax(scores, dim=-1)
        return torch.matmul(w, kv.gather_v(flat).float()).view(B, H, -1).to(q.dtype), sel  # (B, H, d_v)
    P = kv.block_size
    out = torch.empty(B, H, kv.v_pool.shape[-1], dtype=torch.float32, device=q.device)
    for b in range(B):
        L = int(kv.lengths[b])
        scores = group_scores(q[b].float().view(H_kv, G, d) * scale, kv, b, L)  # (H_kv, G, L)
        if k:
            sel[b] = topk_select(scores.reshape(H, L), None, k)[0]  # (H, k)
        w = torch.softmax(scores, dim=-1)  # (H_kv, G, L)
        runs = kv.block_runs(kv.v_pool, b, L)  # [(n_i, H_kv, P, d_v)]
        n = sum(r.shape[0] for r in runs)
        whole = (n - 1) * P  # positions in the whole blocks; the last one is read only up to L
        o = torch.matmul(w[..., whole:], runs[-1][-1, :, :L - whole].float())  # (H_kv, G, d_v)
        w_blocks = w[..., :whole].unflatten(-1, (n - 1, P)).permute(2, 0, 1, 3)  # (n-1, H_kv, G, P)
        first = 0
        for r in runs:  # block by block: (m, H_kv, G, P) @ (m, H_kv, P, d_v), summed over blocks
            m = min(r.shape[0], n - 1 - first)
            if m > 0:
                o += torch.matmul(w_blocks[first:first + m], r[:m].float()).sum(0)
            first += m
        out[b] = o.view(H, -1)
    return out.to(q.dtype), sel


def group_scores(qs: torch.Tensor, kv: PagedKV, b: int, L: int, ws: Workspace | None = None,
                 group: int | None = None) -> torch.Tensor:
    """Scores of each KV group's query rows against all of sequence b's keys of that group.

    qs (H_kv, h, d), scale applied -> (H_kv, h, L); with ``group`` = g: qs (1, h, d) against KV head g
    only -> (1, h, L). Reads the keys in place, run by run of consecutive blocks
    (``PagedKV.block_runs``): copying the keys out of their blocks first cost more than the scoring itself.
    One block: a single (g, h, d) @ (g, d, L) matmul into the workspace's score buffer (when given).
    """
    runs = kv.block_runs(kv.k_pool, b, L)  # [(n_i, H_kv, P, d)]
    if group is not None:
        runs = [r[:, group:group + 1] for r in runs]  # [(n_i, 1, P, d)]
    n, (g, P), h = sum(r.shape[0] for r in runs), runs[0].shape[1:3], qs.shape[1]
    if n == 1:
        buf = None if ws is None else ws.take("scores", g * h * L, torch.float32, qs.device).view(g, h, L)
        return torch.matmul(qs, runs[0][0, :, :L].float().transpose(1, 2), out=buf)  # (g, h, L)
    parts = [torch.matmul(qs.unsqueeze(0), r.float().transpose(-1, -2)) for r in runs]  # [(n_i, g, h, P)]
    s = parts[0] if len(parts) == 1 else torch.cat(parts)  # (n, g, h, P)
    return s.permute(1, 2, 0, 3).reshape(g, h, n * P)[..., :L]  # (g, h, L)
