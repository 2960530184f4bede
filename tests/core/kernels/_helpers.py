"""Shared builders and independent references for the kernel tests (float64 math from the definitions)."""

from __future__ import annotations

import torch

from retopk_core.kv import PagedKV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_from_dense(k: torch.Tensor, v: torch.Tensor, lengths: list[int], block: int, seed: int = 0) -> PagedKV:
    """Scatter padded k, v (B, H_kv, L_cap, d) into a block pool of block size P = ``block`` whose
    physical blocks are shuffled (so the table is a real indirection), plus one spare block."""
    B, H_kv, L_cap, _ = k.shape
    nb = -(-L_cap // block)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(B * nb + 1, generator=gen)
    k_pool = torch.zeros(B * nb + 1, H_kv, block, k.shape[-1], dtype=k.dtype)
    v_pool = torch.zeros(B * nb + 1, H_kv, block, v.shape[-1], dtype=v.dtype)
    table = torch.empty(B, nb, dtype=torch.long)
    for b in range(B):
        for j in range(nb):
            phys = int(perm[b * nb + j])
            table[b, j] = phys
            seg = slice(j * block, min((j + 1) * block, L_cap))
            n = seg.stop - seg.start
            k_pool[phys, :, :n] = k[b, :, seg]
            v_pool[phys, :, :n] = v[b, :, seg]
    return PagedKV(k_pool.to(DEVICE), v_pool.to(DEVICE), table.to(DEVICE),
                   torch.tensor(lengths, dtype=torch.long, device=DEVICE))


def make_kv(B: int, H_kv: int, L_cap: int, d: int, lengths: list[int], dtype=torch.float32, block: int | None = None,
            seed: int = 0, dv: int | None = None) -> tuple[PagedKV, torch.Tensor, torch.Tensor]:
    """Random keys/values; returns (PagedKV (contiguous view or paged with block size ``block``), k, v)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H_kv, L_cap, d, generator=gen).to(dtype)
    v = torch.randn(B, H_kv, L_cap, dv or d, generator=gen).to(dtype)
    if block is None:
        kv = PagedKV.contiguous(k.to(DEVICE), v.to(DEVICE), torch.tensor(lengths, device=DEVICE))
    else:
        kv = paged_from_dense(k, v, lengths, block, seed)
    return kv, k, v


def ref_scores(q: torch.Tensor, k: torch.Tensor, lengths: list[int], scale: float) -> list[torch.Tensor]:
    """Per sequence b: (H, L_b) float64 scores q . k * scale (GQA: head h reads KV head h // G)."""
    B, H, _ = q.shape
    G = H // k.shape[1]
    out = []
    for b in range(B):
        kk = k[b, :, :lengths[b]].double().repeat_interleave(G, dim=0)  # (H, L_b, d)
        out.append(torch.einsum("hd,hld->hl", q[b].double().cpu(), kk) * scale)
    return out


def ref_attend(q, k, v, lengths, scale, sel: torch.Tensor | None = None) -> torch.Tensor:
    """float64 softmax attention (B, H, d_v) over all positions (sel None) or over the selected
    positions sel (B, H, K), -1 = unused."""
    B, H, _ = q.shape
    G = H // k.shape[1]
    scores = ref_scores(q, k, lengths, scale)
    out = torch.zeros(B, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        vv = v[b, :, :lengths[b]].double().repeat_interleave(G, dim=0)  # (H, L_b, dv)
        for h in range(H):
            s = scores[b][h]
            if sel is None:
                idx = torch.arange(lengths[b])
            else:
                idx = sel[b, h].cpu()
                idx = idx[idx >= 0]
            w = torch.softmax(s[idx], dim=0)
            out[b, h] = w @ vv[h, idx]
    return out


def assert_topk_support(sel: torch.Tensor, scores: list[torch.Tensor], K: int, tol: float = 1e-4) -> None:
    """sel (B, H, K) is a Top-K support of each row of float64 ``scores``: min(K, L_b) distinct valid
    positions, -1 after them, none scoring below the K-th best by more than ``tol`` (ties allowed)."""
    B, H, _ = sel.shape
    sel = sel.cpu()
    for b in range(B):
        L = scores[b].shape[1]
        n = min(K, L)
        for h in range(H):
            row = sel[b, h]
            assert (row[n:] == -1).all(), f"padding expected after {n} entries (b={b}, h={h})"
            chosen = row[:n]
            assert (chosen >= 0).all() and (chosen < L).all(), f"positions out of range (b={b}, h={h})"
            assert len(set(chosen.tolist())) == n, f"duplicate positions (b={b}, h={h})"
            kth = scores[b][h].topk(n).values[-1]
            assert scores[b][h][chosen].min() >= kth - tol, f"a selected score is below the K-th best (b={b}, h={h})"


def assert_rows_by_position(support: torch.Tensor) -> None:
    """Every support row (..., K): its positions strictly ascending, then only -1s (what the Triton
    method's prefill and steps write, so that its selector's merge-only path applies)."""
    s = support.reshape(-1, support.shape[-1]).cpu()
    valid = s >= 0
    assert (s[~valid] == -1).all()
    assert not (~valid[:, :-1] & valid[:, 1:]).any(), "a position after the -1 padding"
    assert ((s[:, 1:] > s[:, :-1]) | ~valid[:, 1:]).all(), "positions not ascending"
