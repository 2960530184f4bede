"""A session's state on the runner as plain tensors, to move it to another runner (engine/session_artifact.py).

SessionState holds everything the runner keeps for one session:

    method     its MethodSpec
    token_ids  (L,) int64: the tokens whose keys and values are in the cache, in order
    k, v       (num_layers, n, H_kv, P, d) in the KV cache's dtype: the session's n = ceil(L / P) blocks of P
               positions in order (position i: block i // P, row i % P), the rows past L zero; P is the
               capturing runner's block size (``positions`` gives the (num_layers, H_kv, L, d) view)
    state      the method's per-session state, field f -> (num_layers, *f's per-slot shape) (SlotPool.read_slot,
               stacked over layers); None while the session has none (never prefilled)

``capture`` copies it out of the pools (one gather of the session's blocks per layer), ``restore`` writes it
into a session opened on another runner whose blocks are reserved: block for block when the block sizes agree,
else position for position; the method state into the session's slots. A runner that restores it continues the
session exactly as the one that captured it would have: same keys, values, FIFOs and step counters.

Imported state comes from outside the process, so ``check`` bounds every value a kernel indexes with before
anything is written: the KV cache's shapes and dtype here, the method state's by the method itself
(``AttentionMethod.check_state``: ReTopK's supports, Quest's pages, TokenSelect's selection, ...). A method
whose state has no such check cannot be imported.

``truncate`` shortens a session to its first ``length`` tokens (a prefill undone, a chat history rewound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retopk_core.kv import id_runs
from retopk_server.runtime.attention import MethodGroup
from retopk_server.runtime.kv_pool import KVPool
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.session import Session


class StateMismatch(ValueError):
    """The state cannot go into this runner: another model shape, KV dtype or method state (message says which)."""


@dataclass
class SessionState:
    """See the module docstring."""

    method: MethodSpec
    token_ids: torch.Tensor  # (L,) int64
    k: torch.Tensor  # (num_layers, H_kv, L, d)
    v: torch.Tensor  # (num_layers, H_kv, L, d)
    state: dict[str, torch.Tensor] | None

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    def positions(self, t: torch.Tensor) -> torch.Tensor:
        """``k`` or ``v`` per position: (num_layers, n, H_kv, P, d) -> (num_layers, H_kv, L, d), a view."""
        layers, n, heads, P, d = t.shape
        return t.permute(0, 2, 1, 3, 4).reshape(layers, heads, n * P, d)[:, :, :self.length]


def capture(pool: KVPool, group: MethodGroup | None, session: Session) -> SessionState:
    """A copy of ``session``'s tokens, keys, values and method state (``group`` holds its slots)."""
    L, P = session.length, pool.block_size
    n = pool.blocks_for(L)
    k, v = (torch.empty((pool.num_layers, n, pool.num_kv_heads, P, pool.head_dim), dtype=pool.k[0].dtype)
            for _ in range(2))
    if n:
        blocks = torch.tensor(session.blocks[:n], dtype=torch.long, device=pool.k[0].device)
        for layer in range(pool.num_layers):
            for out, src in ((k, pool.k[layer]), (v, pool.v[layer])):
                if src.device.type == "cpu":
                    torch.index_select(src, 0, blocks, out=out[layer])  # straight into the result: one copy
                else:
                    out[layer] = src.index_select(0, blocks).cpu()
        k[:, -1, :, L - (n - 1) * P:] = 0  # the last block's rows past L hold what earlier sessions left there
        v[:, -1, :, L - (n - 1) * P:] = 0
    state = None
    if session.slots is not None and group is not None:
        state = {name: t.cpu() for name, t in group.read_state(session.slots).items()}
    return SessionState(session.method, torch.tensor(session.token_ids, dtype=torch.long), k, v, state)


def check(state: SessionState, pool: KVPool, vocab_size: int, max_context: int) -> None:
    """StateMismatch when the tensors do not fit this runner's KV cache; ValueError for a value out of its
    bounds (module docstring). Nothing is written."""
    L = state.length
    if state.token_ids.dtype != torch.long or state.token_ids.dim() != 1:
        raise ValueError("token_ids: must be a 1-D int64 tensor")
    if L > max_context:
        raise StateMismatch(f"the session holds {L} tokens, this server's max_context is {max_context}")
    if L and not bool(((state.token_ids >= 0) & (state.token_ids < vocab_size)).all()):
        raise ValueError(f"token_ids: every id must lie in [0, {vocab_size})")
    for name, t in (("k", state.k), ("v", state.v)):
        blocks_ok = t.dim() == 5 and t.shape[3] >= 1 and t.shape[1] == -(-L // t.shape[3])
        if not blocks_ok or tuple(t.shape) != tuple(state.k.shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)} is not (layers, ceil({L} / P), KV heads, P, head dim)")
        here = (pool.num_layers, pool.num_kv_heads, pool.head_dim)
        if (t.shape[0], t.shape[2], t.shape[4]) != here:
            raise StateMismatch(f"KV cache: (layers, KV heads, head dim) {(t.shape[0], t.shape[2], t.shape[4])}, "
                                f"this model's are {here}")
        if t.dtype != pool.k[0].dtype:
            raise StateMismatch(f"kv_dtype: the session's KV cache is {str(t.dtype).removeprefix('torch.')}, this "
                                f"server's is {str(pool.k[0].dtype).removeprefix('torch.')}")
    if state.state is not None:
        _check_method_state(state.method, state.state, L)


def _check_method_state(method: MethodSpec, tensors: dict[str, torch.Tensor], length: int) -> None:
    """The method's own bounds of the values its kernels index with (AttentionMethod.check_state)."""
    try:
        method.build().check_state(tensors, length)
    except NotImplementedError as e:
        raise StateMismatch(str(e)) from None


def restore(pool: KVPool, group: MethodGroup | None, session: Session, state: SessionState) -> None:
    """Write ``state`` into ``session``: empty, of ``state.method``, its blocks reserved for ``state.length``
    positions and (when ``state.state``) its method slots allocated. ``check`` it first."""
    L = state.length
    if L:
        device = pool.k[0].device
        if state.k.shape[3] == pool.block_size:  # the same block size: block for block
            # one slice copy per run of consecutive block ids (a session's blocks are mostly one run): a plain
            # copy of contiguous memory, where index_copy_ addresses every element through the index
            ids = session.blocks[:state.k.shape[1]]
            runs = [(start, stop, ids[start]) for start, stop in id_runs(ids)]
            for layer in range(pool.num_layers):
                for dst, src in ((pool.k[layer], state.k[layer]), (pool.v[layer], state.v[layer])):
                    for start, stop, first in runs:  # src[start:stop]: (stop - start, H_kv, P, d)
                        dst[first:first + stop - start].copy_(src[start:stop])
        else:  # position for position
            table = pool.block_table([session.blocks], device)  # (1, blocks)
            rows = pool.rows(table, torch.zeros(1, dtype=torch.long, device=device), L)  # (1, H_kv, L)
            k, v = state.positions(state.k), state.positions(state.v)  # (layers, H_kv, L, d)
            for layer in range(pool.num_layers):  # (1, H_kv, L, d) each, laid out as KVPool.write reads them
                pool.write(layer, rows, k[layer].unsqueeze(0).contiguous().to(device),
                           v[layer].unsqueeze(0).contiguous().to(device))
    if state.state is not None:
        group.write_state(session.slots, state.state)
    session.token_ids = state.token_ids.tolist()


def truncate(pool: KVPool, session: Session, length: int) -> None:
    """Keep the session's first ``length`` tokens; the blocks past them go back to the pool. The caller keeps
    the method state consistent (a prefill that never reached the method, or a reset). A kept block others hold
    too (the prefix cache's) must not be written: ModelRunner.rewind copies a partly kept one first."""
    del session.token_ids[length:]
    keep = pool.blocks_for(length)
    if not session.closed and len(session.blocks) > keep:
        pool.release(session.blocks[keep:])
        del session.blocks[keep:]
