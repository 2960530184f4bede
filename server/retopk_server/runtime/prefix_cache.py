"""PrefixCache: full KV blocks of prompts, reused by later prompts that start with the same tokens.

Keys. Block i of a prompt (positions iP .. iP + P - 1, P the KV block size) is keyed by the chain hash

    h_0 = SHA-256(namespace),   h_{i+1} = SHA-256(h_i || tokens of block i)

so a key names a block's tokens AND everything before them, and the namespace (``namespace()``: the
caller's API key and its ``cache_salt``, or the salt alone under global sharing) keeps one tenant's
blocks out of every other tenant's chains. A block's keys and values depend on nothing else: prefill is
dense attention for every method, so one cached block serves sessions of any method.

What is cached. Only blocks a session's FIRST prefill computed (or mapped from the cache): their keys
and values are a dense prefill of the tokens before them. Positions a decode step wrote went through the
session's method (sparse for ReTopK) and are never registered, nor anything after them.

Lifecycle of a cached block (KVPool holder counts; the cache is one holder):
  registered   at the end of a first prefill, the cache takes a reference to each full block
  mapped       a later prompt's session shares the run of cached blocks its prompt starts with (``lookup``)
  idle         every session released it: the cache alone holds it; it stays until the budget needs it
  evicted      least recently used first, only idle blocks (``evict``), before any idle session is evicted
A cached block is full, and sessions only append, so no one ever writes into it; the first block a
prompt does not share is a new block of its own, filled by its prefill.

Exactness (``ModelRunner.cached_prefix``): a hit covers a multiple of the prefill grid, lcm(block size,
prefill chunk), so the rest of the prompt is prefilled in the very chunks (same shapes, same inputs) that
a prefill of the whole prompt uses. A method that observes the prompt's last Q = ``prefill_queries``
queries at prefill (ReTopK seeds its FIFO from them) must see the same Q queries as a full prefill; the
positions among them that the hit covers are not computed again, so their queries come from the cache:

Tail queries. Beside the block that ends a first prompt's last grid boundary E (the end of the last whole
chunk among its full blocks), the cache keeps the post-RoPE queries of positions E - Q .. E - 1, every
layer, (layers, H, Q, d) float32 (``insert_queries``). They are the values the chunk [E - chunk, E) of any
full prefill computes, since that chunk's inputs are the same tokens and keys. A later prompt whose hit
ends at E takes them (``queries``) and prefills only the tokens after E; a hit that ends at a boundary
without them leaves the prompt's last Q tokens to the prefill, as before. They count against the cache
budget and go with their block (evicted, cleared).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from retopk_server.runtime.budget import BudgetExceeded
from retopk_server.runtime.kv_pool import KVPool

# Longest ``cache_salt`` a request may set (characters); the service refuses longer ones.
MAX_CACHE_SALT_CHARS = 256


def namespace(owner: str, salt: str = "", shared: bool = False) -> bytes:
    """The root of a request's chains: its owner (an API key's name, "" anonymous) and ``salt``, or only the salt
    when the server shares its cache across keys. Length-prefixed, so no two (owner, salt) pairs collide."""
    parts = ("" if shared else owner, salt)
    return b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)


def block_hashes(root: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """The chain hash of each FULL block of ``token_ids`` (len // block_size of them), from ``root``."""
    out, h = [], hashlib.sha256(root).digest()
    for i in range(len(token_ids) // block_size):
        h = hashlib.sha256(h + array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()).digest()
        out.append(h)
    return out


def shared_run(a: list[bytes], b: list[bytes]) -> int:
    """How many blocks two chains start with in common: equal chain hashes name the same namespace and the same
    tokens up to the end of their block."""
    n = 0
    for x, y in zip(a, b, strict=False):  # the chains may differ in length
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Chain hash -> KV block id, least recently used first. Engine thread only (as the runner)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._blocks: OrderedDict[bytes, int] = OrderedDict()
        self._queries: dict[bytes, torch.Tensor] = {}  # chain hash of a block ending a grid boundary -> tail queries

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def idle_blocks(self) -> int:
        """Cached blocks no session holds (what ``evict`` can give back)."""
        return sum(1 for b in self._blocks.values() if self.pool.holders(b) == 1)

    def cached_run(self, hashes: list[bytes], multiple: int = 1) -> int:
        """How many of ``hashes``' first blocks are cached, cut to a multiple of ``multiple`` (nothing changes)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._blocks:
            n += 1
        return n // multiple * multiple

    def lookup(self, hashes: list[bytes], most: int, multiple: int = 1) -> list[int]:
        """The block ids of the longest run of ``hashes[:most]`` that is cached, cut to a multiple of ``multiple``
        blocks (``cached_run``), each with a new holder (the caller's session: release them as its own), marked
        recently used."""
        n = self.cached_run(hashes[:most], multiple)
        self._touch(hashes[:n])
        return self.pool.share([self._blocks[h] for h in hashes[:n]])

    @property
    def query_bytes(self) -> int:
        """Bytes of the tail queries kept (charged to the pool's budget)."""
        return sum(_nbytes(q) for q in self._queries.values())

    def queries(self, h: bytes) -> torch.Tensor | None:
        """The tail queries kept beside the cached block ``h`` (layers, H, Q, d) float32, or None."""
        return self._queries.get(h) if h in self._blocks else None

    def insert_queries(self, h: bytes, queries: torch.Tensor) -> bool:
        """Keep ``queries`` (layers, H, Q, d), the last Q queries before the end of cached block ``h``, beside it
        -> whether they are kept: not when ``h`` is not cached, already has as many, or the budget cannot hold
        them (the cache holds what fits; a later hit then prefills those positions again)."""
        old = self._queries.get(h)
        if h not in self._blocks or (old is not None and old.shape[2] >= queries.shape[2]):
            return False
        budget, need = self.pool.budget, _nbytes(queries) - (0 if old is None else _nbytes(old))
        if budget is not None:
            try:
                budget.charge(need, "the prefix cache's tail queries")
            except BudgetExceeded:
                return False
        self._queries[h] = queries
        return True

    def _drop_queries(self, h: bytes) -> None:
        q = self._queries.pop(h, None)
        if q is not None and self.pool.budget is not None:
            self.pool.budget.refund(_nbytes(q))

    def insert(self, hashes: list[bytes], blocks: list[int]) -> None:
        """Cache ``blocks`` (full, prefilled) under ``hashes``: the cache becomes one more holder of each block
        it did not have under that hash (a hash cached already keeps its block)."""
        for h, block in zip(hashes, blocks, strict=True):
            if h not in self._blocks:
                self._blocks[h] = self.pool.share([block])[0]
        self._touch(hashes)

    def _touch(self, hashes: list[bytes]) -> None:
        # deepest first, so that a block is never older than the blocks after it in its chain: eviction,
        # oldest first, takes a chain's tail before its head and leaves no unreachable block behind
        for h in reversed(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)

    def evict(self, n: int | None = None) -> int:
        """Give back up to ``n`` (None: every) idle cached blocks to the pool, least recently used first ->
        how many. A block some session holds is never evicted."""
        gone = []
        for h, block in self._blocks.items():
            if n is not None and len(gone) >= n:
                break
            if self.pool.holders(block) == 1:
                gone.append(h)
        for h in gone:
            self.pool.release([self._blocks.pop(h)])
            self._drop_queries(h)
        return len(gone)

    def rename(self, moved: dict[int, int]) -> None:
        """The pool moved blocks (KVPool.compact): old id -> new id."""
        for h, block in self._blocks.items():
            self._blocks[h] = moved.get(block, block)

    def _entry_bytes(self, h: bytes) -> int:
        q = self._queries.get(h)
        return self.pool.block_nbytes + (0 if q is None else _nbytes(q))

    def idle_bytes(self) -> int:
        """Bytes that ``evict()`` would give back: the idle blocks and the tail queries beside them."""
        return sum(self._entry_bytes(h) for h, b in self._blocks.items() if self.pool.holders(b) == 1)

    def evict_to(self, most: int) -> int:
        """Evict idle blocks, least recently used first, until the idle ones hold at most ``most`` bytes -> how many
        went (a cap on what the cache keeps for later prompts, ``RuntimeConfig.prefix_cache_bytes``)."""
        idle = [h for h, b in self._blocks.items() if self.pool.holders(b) == 1]  # least recently used first
        total, gone = sum(self._entry_bytes(h) for h in idle), []
        for h in idle:
            if total <= most:
                break
            total -= self._entry_bytes(h)
            gone.append(h)
        for h in gone:
            self.pool.release([self._blocks.pop(h)])
            self._drop_queries(h)
        return len(gone)

    def clear(self) -> int:
        """Drop every entry (the blocks stay with the sessions that hold them) -> how many entries."""
        n = len(self._blocks)
        self.pool.release(list(self._blocks.values()))
        self._blocks.clear()
        for h in list(self._queries):
            self._drop_queries(h)
        return n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
