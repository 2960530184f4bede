"""Drive any registered method through prompts and decode steps, contiguous or in a shuffled block pool.

A run holds B sequences' keys/values for the whole trace (prompt + one token per decode step); at
decode step t sequence b has length prompt_lens[b] + t + 1. ``drive`` yields, per step, the lengths,
the queries and the method's StepOutput, so tests can compare them with references from the definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods.base import Path


@dataclass
class Run:
    keys: torch.Tensor  # (B, H_kv, L_cap, d)
    values: torch.Tensor  # (B, H_kv, L_cap, d)
    prompt_lens: list[int]
    prompt_queries: torch.Tensor  # (B, H, T, d) the last T prompt queries (positions P-T..P-1)
    queries: torch.Tensor  # (steps, B, H, d)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.keys.shape[-1])

    def lengths_at(self, step: int) -> torch.Tensor:
        return torch.tensor([p + step + 1 for p in self.prompt_lens])


def make_run(H=6, H_kv=2, d=16, prompt_lens=(37, 20, 9), steps=4, T=4, seed=0, dtype=torch.float32,
             keys: torch.Tensor | None = None, queries: torch.Tensor | None = None) -> Run:
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    L_cap = max(prompt_lens) + steps
    if keys is None:
        keys = torch.randn(B, H_kv, L_cap, d, generator=g)
    values = torch.randn(B, H_kv, L_cap, d, generator=g)
    prompt_q = torch.randn(B, H, T, d, generator=g)
    if queries is None:
        queries = torch.randn(steps, B, H, d, generator=g)
    return Run(keys.to(dtype), values.to(dtype), list(prompt_lens), prompt_q.to(dtype), queries.to(dtype))


def to_pool(keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, block: int, seed: int = 0,
            spare: int = 3) -> PagedKV:
    """The sequences (B, H_kv, L_cap, d) in a shuffled pool of ``block``-token blocks plus ``spare``
    unused blocks filled with NaN (reading them would poison the output). Keeps the dtype."""
    B, H_kv, L_cap, d = keys.shape
    nb = -(-L_cap // block)
    pad = nb * block - L_cap

    def blocks(x):  # (B, H_kv, L_cap, d) -> (B * nb, H_kv, block, d)
        x = torch.nn.functional.pad(x, (0, 0, 0, pad), value=float("nan"))
        return x.view(B, H_kv, nb, block, d).permute(0, 2, 1, 3, 4).reshape(B * nb, H_kv, block, d)

    n = B * nb + spare
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: B * nb]  # logical -> physical
    k_pool = torch.full((n, H_kv, block, d), float("nan"), dtype=keys.dtype)
    v_pool = torch.full((n, H_kv, block, d), float("nan"), dtype=values.dtype)
    k_pool[perm], v_pool[perm] = blocks(keys), blocks(values)
    return PagedKV(k_pool, v_pool, perm.view(B, nb), lengths.long())


def make_kv(keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, block: int | None,
            poison: bool = True, seed: int = 0) -> PagedKV:
    """Contiguous (block None) or paged view; with poison, positions >= each length hold NaN so a
    method that reads (and attends) past the current position returns NaN."""
    if poison:
        pos = torch.arange(keys.shape[2]).view(1, 1, -1, 1)
        future = pos >= lengths.view(-1, 1, 1, 1)
        keys = keys.masked_fill(future, float("nan"))
        values = values.masked_fill(future, float("nan"))
    if block is None:
        return PagedKV.contiguous(keys, values, lengths)
    return to_pool(keys, values, lengths, block, seed)


def drive(method, run: Run, block: int | None = None, poison: bool = True):
    """Prefill every sequence, then decode; yield (step, lengths, q, StepOutput, state, slots)."""
    B, H_kv, _, d = run.keys.shape
    H = run.queries.shape[2]
    state = method.init_state(H, H_kv, d, capacity=1)  # grows while allocating B slots
    slots = torch.tensor([state.alloc() for _ in range(B)])
    T = run.prompt_queries.shape[2]
    for b, P in enumerate(run.prompt_lens):
        kv_b = make_kv(run.keys[b:b + 1], run.values[b:b + 1], torch.tensor([P]), block, poison)
        want = min(method.prefill_queries, T, P)
        q = run.prompt_queries[b, :, T - want:] if want else None
        pos = torch.arange(P - want, P) if want else None
        method.prefill(state, int(slots[b]), q, pos, kv_b)
    for t in range(run.queries.shape[0]):
        lengths = run.lengths_at(t)
        kv = make_kv(run.keys, run.values, lengths, block, poison, seed=t)
        q = run.queries[t]
        yield t, lengths, q, method.decode(q, kv, state, slots), state, slots


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int], scale: float,
           ) -> torch.Tensor:
    """Reference exact softmax attention of one query (d,) over positions of keys/values (L, d), float64."""
    idx = torch.tensor(sorted(positions))
    s = (keys[idx].double() @ q.double()) * scale
    return torch.softmax(s, dim=0) @ values[idx].double()


def selected_set(sel: torch.Tensor) -> list[int]:
    """Sorted valid positions of one (b, h) row of StepOutput.selected."""
    return sorted(sel[sel >= 0].tolist())


def check_against_reference(method, run: Run, block: int | None, reference) -> None:
    """Drive ``method`` over ``run``; at every step and (sequence b, query head h over KV head g) compare it
    with ``reference(b, g, L, q, keys, values) -> (positions, out, n_approx)`` (q (d,), keys/values (L, d)):
    the selected positions, the exactly scored count, n_approx and, per step, the outputs; every path APPROX."""
    for _, lengths, q, out, _, _ in drive(method, run, block=block):
        H = q.shape[1]
        G = H // run.keys.shape[1]
        ref = torch.empty(out.out.shape, dtype=torch.float64)
        for b, L in enumerate(lengths.tolist()):
            for h in range(H):
                g = h // G
                want, ref[b, h], n_approx = reference(b, g, L, q[b, h], run.keys[b, g, :L], run.values[b, g, :L])
                assert selected_set(out.selected[b, h]) == want, (b, h, L)
                assert int(out.n_scored[b, h]) == len(want)
                assert int(out.n_approx[b, h]) == n_approx
        torch.testing.assert_close(out.out.double(), ref, atol=1e-5, rtol=1e-5)
        assert (out.path == Path.APPROX).all()
