"""One block pool per model layer holding every session's keys and values (the layout of retopk_core.kv.PagedKV).

Layer l keeps k[l], v[l]: (N_blocks, H_kv, P, d). A session owns a list of block ids, the same ids in
every layer; position i of the session lives in block ``blocks[i // P]`` at offset ``i % P``. When the
free list runs dry the pools double their block count (one copy, amortised over the blocks gained), so
no decode step reallocates a session's history. The allocator prefers consecutive ids: the dense and
exact paths read a session whose blocks are consecutive in place, and copy it otherwise.

With a CacheBudget (runtime/budget.py) a growth stops at what the budget holds and fails with
BudgetExceeded when even that is too few blocks. On the CPU such a pool reserves, once, the address space of
the most blocks its budget could ever hold (reserved_rows.py: memory is committed only where written), and each
layer's k[l], v[l] is a view of its first ``capacity`` blocks: a growth widens the views, with no copy of the
blocks in use and no fill of the new ones (which read as zero, as a fresh tensor's), and the tensors' storage
never moves; ``trim`` narrows them and gives the pages past them back. The budget counts ``capacity`` blocks,
whatever the system has committed of them. Elsewhere (a CUDA device, no budget, a system that refuses the
reservation) a growth allocates new tensors and copies every block. Growth and ``trim`` are all-or-nothing:
every layer's new tensors are allocated before any replaces the old one, so a failed allocation
(BudgetExceeded, or AllocationFailed when the device itself refuses) leaves the pool as it was. While a growth
copies, the old and the new tensors coexist for a moment.
"""

from __future__ import annotations

import torch

from retopk_core.cpu import decoder_ops
from retopk_core.kv import PagedKV
from retopk_server.runtime.budget import BudgetExceeded, CacheBudget
from retopk_server.runtime.reserved_rows import ReservedRows, reserve


class AllocationFailed(BudgetExceeded):
    """The device refused an allocation the budget allowed (out of memory); nothing changed."""


def allocation_failed(what: str, need: int, budget: CacheBudget | None, error: BaseException) -> AllocationFailed:
    limit = budget.limit if budget is not None else 0
    failed = AllocationFailed(what, need, budget.free if budget is not None else 0, limit)
    failed.args = (f"{what}: allocating {need} bytes failed: {type(error).__name__}: {error}",)
    return failed


FLOAT16_MAX = torch.finfo(torch.float16).max  # 65504


def to_pool_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in a pool's dtype, its rows laid out contiguously, rounded to nearest even as torch's cast; into float16,
    whose finite range ends at 65504, a value beyond it saturates to ±65504 where the cast gives ±inf (a key or value
    of ±inf makes the attention's scores and outputs inf or NaN); NaN stays NaN. The CPU library's store saturates
    alike (decoder_ops.cpp, to_pool), so both writers store the same bytes."""
    y = x.to(dtype, memory_format=torch.contiguous_format)
    if dtype == torch.float16 and x.dtype != torch.float16:  # y is a new tensor: clamp in place
        y.clamp_(-FLOAT16_MAX, FLOAT16_MAX)
    return y


# What torch raises when memory runs out: CUDA's OutOfMemoryError, the CPU allocator's RuntimeError.
OUT_OF_MEMORY = (getattr(torch, "OutOfMemoryError", RuntimeError), MemoryError, RuntimeError)


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, initial_blocks: int = 8,
                 budget: CacheBudget | None = None) -> None:
        """budget: the CacheBudget the pool's bytes count against (None: unbounded); the initial blocks are
        charged to it (ValueError when they do not fit)."""
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size = block_size
        self.budget = budget
        self._initial = max(1, initial_blocks)
        shape = (self._initial, num_kv_heads, block_size, head_dim)
        self._reserved = self._reserve(shape, dtype, device)
        if self._reserved is not None:  # k[l] is rows[l].view(capacity), v[l] rows[num_layers + l]'s
            self.k = [rows.view(shape[0]) for rows in self._reserved[:num_layers]]
            self.v = [rows.view(shape[0]) for rows in self._reserved[num_layers:]]
            self._commit(0)  # as torch.zeros did
        else:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.generation = 0  # bumped when ``k`` and ``v`` are replaced (``_resize``): whoever keeps them knows
        self._free: set[int] = set(range(shape[0]))
        self._shared: dict[int, int] = {}  # block id -> extra holders (``share``); absent = one holder
        self._held = 0  # free blocks ``make_free`` keeps for sessions about to come: ``trim`` leaves them
        if budget is not None:
            try:
                budget.charge(self.nbytes(), "the KV pool's initial blocks")
            except BudgetExceeded as e:
                raise ValueError(f"kv_cache_bytes: {e}") from None

    def _reserve(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> list[ReservedRows] | None:
        """Each layer's keys, then values, reserved for the most blocks the budget holds (module docstring); None
        where the pool grows by copying."""
        if self.budget is None or torch.device(device).type != "cpu":
            return None
        block = 2 * self.num_layers * torch.empty(shape[1:], dtype=dtype).nbytes
        most = max(shape[0], self.budget.limit // block)
        reserved = [reserve(most, shape[1:], dtype) for _ in range(2 * self.num_layers)]
        return reserved if all(r is not None for r in reserved) else None

    def _commit(self, start: int) -> None:
        """A reserved pool's blocks from ``start`` on written now (zeros, which they read as anyway): the sessions
        that use them next write into committed memory, not page by page inside their first turns."""
        if self._reserved is not None:
            for t in self.k + self.v:
                t[start:].zero_()

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0]

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block id across all layers, keys and values."""
        return 2 * self.num_layers * self.k[0][0].numel() * self.k[0].element_size()

    def nbytes(self) -> int:
        return self.capacity * self.block_nbytes

    @property
    def used_blocks(self) -> int:
        return self.capacity - len(self._free)

    def make_free(self, need: int) -> None:
        """At least ``need`` free blocks as far as the budget allows, grown once to just that (sessions about to
        come in, whose blocks a doubling per session would copy the pool for). They stay free of ``trim`` until
        as many blocks have been allocated since, or memory is short (``trim(pressure=True)``): a session closed
        before the others come back does not give their room back. A reserved pool commits the new blocks now
        (``_commit``), as a pool grown by copying does."""
        if self.budget is not None:
            need = min(need, len(self._free) + self.budget.free // self.block_nbytes)
        if need > len(self._free):
            old = self.capacity
            self._grow(need, None, exact=True)
            self._commit(old)
        self._held = max(self._held, need)

    def _grow(self, need: int, session_id: str | None, exact: bool = False) -> None:
        """At least ``need`` free blocks: double the block count (``exact``: just enough; capped by the budget),
        all layers or none."""
        old = self.capacity
        new = old + need - len(self._free) if exact else old
        while new - old + len(self._free) < need:
            new *= 2
        if self.budget is not None:
            most = old + self.budget.free // self.block_nbytes
            if most - old + len(self._free) < need:
                raise BudgetExceeded("the KV cache", (need - len(self._free)) * self.block_nbytes,
                                     self.budget.free, self.budget.limit, session_id)
            new = min(new, most)
        self._resize(new, session_id)
        self._free.update(range(old, new))

    def _resize(self, blocks: int, session_id: str | None = None) -> None:
        """Every layer's keys and values to ``blocks`` blocks (contents kept up to the smaller size); the new
        tensors all exist before the old ones are dropped, so a failure changes nothing."""
        old = self.capacity
        keep = min(old, blocks)
        delta = (blocks - old) * self.block_nbytes
        if self._reserved is not None:  # wider or narrower views of the same storage (module docstring)
            views = [r.view(blocks) for r in self._reserved]
            k, v = views[:self.num_layers], views[self.num_layers:]
            if delta < 0:
                for r in self._reserved:
                    r.release(blocks)
        else:
            try:
                k, v = ([self._resized(t, blocks, keep) for t in pools] for pools in (self.k, self.v))
            except OUT_OF_MEMORY as e:
                raise allocation_failed("the KV cache", max(delta, 0), self.budget, e) from e
        if self.budget is not None:
            if delta > 0:
                self.budget.charge(delta, "the KV cache", session_id)
            else:
                self.budget.refund(-delta)
        self.k, self.v = k, v
        self.generation += 1

    @staticmethod
    def _resized(t: torch.Tensor, blocks: int, keep: int) -> torch.Tensor:
        # in the tensor's own mode: a pool made outside inference mode stays writable outside it (fork_prefix)
        with torch.inference_mode(t.is_inference()):
            out = t.new_zeros((blocks, *t.shape[1:]))
            out[:keep] = t[:keep]
        return out

    def trim(self, pressure: bool = False) -> int:
        """Give the free blocks above the highest used one back (not below the initial size, nor below the room
        ``make_free`` holds unless ``pressure``: memory is short) -> bytes freed."""
        used = set(range(self.capacity)) - self._free
        if pressure:
            self._held = 0
        blocks = max(self._initial, max(used) + 1 if used else 0, len(used) + self._held)
        if blocks >= self.capacity:
            return 0
        freed = (self.capacity - blocks) * self.block_nbytes
        self._resize(blocks)
        self._free = {i for i in self._free if i < blocks}
        return freed

    def compact(self) -> dict[int, int]:
        """Move the used blocks that lie above the first ``used_blocks`` ids into the free ids below (every layer,
        keys and values; holder counts move with them) -> {old id: new id}: every holder must rename its blocks
        so (ModelRunner._compact). Afterwards the used blocks are the lowest ids, and ``trim`` can give back
        every free block, not only a free tail. Movers go to holes lowest first, in their order, so a session's
        run of consecutive blocks stays consecutive where the holes are."""
        n = self.used_blocks
        movers = sorted(b for b in range(n, self.capacity) if b not in self._free)
        holes = sorted(b for b in self._free if b < n)
        if not movers:
            return {}
        self.copy(movers, holes)
        moved = dict(zip(movers, holes, strict=True))
        self._shared = {moved.get(b, b): extra for b, extra in self._shared.items()}
        self._free.difference_update(holes)
        self._free.update(movers)
        return moved

    def shrink(self) -> int:
        """``trim`` once the blocks up to the highest used one are at most a quarter of the pool, or none is used
        (so that a load that comes and goes does not resize the pool at every session) -> bytes freed."""
        used = set(range(self.capacity)) - self._free
        top = max(used) + 1 if used else 0
        if top and 4 * top > self.capacity:
            return 0
        return self.trim()

    def alloc(self, n: int, after: int | None = None, session_id: str | None = None) -> list[int]:
        """n free block ids, consecutive when possible: the n ids right after ``after`` (a growing
        session's last block) when they are free, else the lowest run of n consecutive free ids, else
        the lowest free ids. The pool grows only when fewer than n blocks are free; BudgetExceeded
        (nothing allocated) when the budget cannot hold them."""
        if n <= 0:
            return []
        if len(self._free) < n:
            self._grow(n, session_id)
        if after is not None and all(after + 1 + i in self._free for i in range(n)):
            ids = list(range(after + 1, after + 1 + n))
        else:
            ids = self._lowest_run(n) or sorted(self._free)[:n]
        self._free.difference_update(ids)
        self._held = max(0, self._held - n)
        return ids

    def _lowest_run(self, n: int) -> list[int] | None:
        start = prev = None
        for i in sorted(self._free):
            if prev is None or i != prev + 1:
                start = i
            prev = i
            if i - start + 1 == n:
                return list(range(start, i + 1))
        return None

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks ``src`` onto blocks ``dst`` (same length) in every layer, keys and values."""
        for pools in (self.k, self.v):
            for t in pools:
                t[torch.tensor(dst, device=t.device)] = t[torch.tensor(src, device=t.device)]

    def share(self, blocks: list[int]) -> list[int]:
        """Another holder for each of ``blocks`` (copy-on-write forks, ModelRunner.fork) -> the same ids. A
        shared block must not be written again (only full blocks are shared: sessions only append); it
        is free once every holder released it."""
        for b in blocks:
            self._shared[b] = self._shared.get(b, 0) + 1
        return list(blocks)

    def holders(self, block: int) -> int:
        """How many holders (sessions, the prefix cache) a block in use has."""
        return 1 + self._shared.get(block, 0)

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            extra = self._shared.get(b, 0)
            if extra > 1:
                self._shared[b] = extra - 1
            elif extra == 1:
                del self._shared[b]
            else:
                self._free.add(b)

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def block_table(self, block_lists: list[list[int]], device: torch.device | str) -> torch.Tensor:
        """(B, max_blocks) int64 table of the given sessions' blocks, padded with block 0."""
        width = max(1, max((len(b) for b in block_lists), default=1))
        table = torch.tensor([blocks + [0] * (width - len(blocks)) for blocks in block_lists], dtype=torch.long)
        return table.view(len(block_lists), width).to(device)  # (0, width) for no rows

    def rows(self, table: torch.Tensor, start: torch.Tensor, T: int) -> torch.Tensor:
        """(B, H_kv, T) int64 rows of the (N_blocks * H_kv * P, d) pool view where the T new positions
        start .. start + T - 1 of each row live; the same for every layer, so a forward computes them once."""
        B = table.shape[0]
        pos = start.view(B, 1) + torch.arange(T, device=start.device).view(1, T)  # (B, T)
        block = table.gather(1, pos // self.block_size)  # (B, T)
        g = torch.arange(self.num_kv_heads, device=start.device).view(1, -1, 1)  # (1, H_kv, 1)
        return (block.unsqueeze(1) * self.num_kv_heads + g) * self.block_size + (pos % self.block_size).unsqueeze(1)

    def step_rows(self, block_lists: list[list[int]], positions: list[int], device: torch.device | str) -> torch.Tensor:
        """``rows`` of one new position per row, positions[b] in the blocks block_lists[b]: (B, H_kv, 1) int64,
        computed on Python ints and made in one tensor (a decode step's, where ``rows``' few tensor ops on the
        block table each cost more than the arithmetic)."""
        P, G = self.block_size, self.num_kv_heads
        flat = [(blocks[p // P] * G + g) * P + p % P
                for blocks, p in zip(block_lists, positions, strict=True) for g in range(G)]
        return torch.tensor(flat, dtype=torch.long, device=device).view(len(positions), G, 1)

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values k, v: (B, H_kv, T, d) at ``rows`` (B, H_kv, T) from ``rows()``."""
        # a decode step's rows (T = 1): the library's store, one call for both. A prefill chunk's many positions:
        # torch's vectorized cast and index_copy_ (the library converts element by element), the same bytes.
        if k.device.type == "cpu" and k.dtype == torch.float32 and k.shape[2] == 1 and decoder_ops.available():
            decoder_ops.store_kv(self.k[layer], self.v[layer], rows, k, v)
            return
        flat = rows.view(-1)
        for pool, x in ((self.k[layer], k), (self.v[layer], v)):
            x = to_pool_dtype(x, pool.dtype)  # cast and lay out rows in one copy
            pool.view(-1, pool.shape[-1]).index_copy_(0, flat, x.reshape(-1, x.shape[-1]))

    def paged(self, layer: int, table: torch.Tensor, lengths: torch.Tensor) -> PagedKV:
        return PagedKV(self.k[layer], self.v[layer], table, lengths)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded as ``write`` stores it (to_pool_dtype, as the CPU library's store rounds and saturates too) and
        back in x's dtype: what ``history`` returns for keys or values just written, without
        gathering them back from the blocks."""
        return self.stored(x).to(x.dtype)

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, H_kv, T, d) in the pool's dtype, its rows laid out contiguously: the values ``write`` stores, which
        it then takes without another copy (a prefill's attention widens them back: ``as_stored`` in one cast)."""
        return to_pool_dtype(x, self.k[0].dtype)

    def history(self, layer: int, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one session's first ``length`` positions: (H_kv, length, d) each (a copy)."""
        n = self.blocks_for(length)
        idx = blocks[:n]
        k = self.k[layer][idx].transpose(0, 1).reshape(self.num_kv_heads, n * self.block_size, -1)[:, :length]
        v = self.v[layer][idx].transpose(0, 1).reshape(self.num_kv_heads, n * self.block_size, -1)[:, :length]
        return k, v
