"""PrefillJob: one prompt fed into one session in chunks, so a scheduler can interleave it with decode steps.

``ModelRunner.start_prefill`` asserts the tokens and reserves every KV block the prompt needs (ContextTooLong
or BudgetExceeded before anything changes), then ``step(max_tokens)`` runs dense forwards of at most
``prefill_chunk`` tokens each until ``max_tokens`` are fed, and returns the logits after the prompt's last
token once it is all in. The method observes the prompt (``method.prefill``, with the prompt's last
``prefill_queries`` queries collected across chunks) in the last chunk only, so where the chunks fall
changes nothing. ``abort()`` before the end rewinds the session to where it started (the method has seen
none of it yet), giving back the blocks beyond that point.

With the prefix cache (prefix_cache.py), a first prompt's leading ``cached`` tokens are already in the
session when the job starts (their blocks mapped from the cache): the job feeds the rest, and once the
prompt is in it caches the prompt's full blocks for later prompts. The method's last queries then start
with the cached tail queries (``tail``) of the positions before the hit's end that the job does not feed.
A job that caches blocks also keeps, at its last grid boundary E past its start, the queries of positions
E - Q .. E - 1 (Q the method's ``prefill_queries``) beside the block ending at E, when it computed them
in the whole chunk that ends at E (the chunk a full prefill computes them in).
"""

from __future__ import annotations

from typing import Protocol

import torch

from retopk_server.runtime.attention import MethodGroup, PrefillContext, StepKV
from retopk_server.runtime.kv_pool import KVPool
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.prefix_cache import PrefixCache
from retopk_server.runtime.runtime_config import RuntimeConfig
from retopk_server.runtime.session import Session
from retopk_server.runtime.session_state import truncate


class PrefillRunner(Protocol):
    """What a PrefillJob uses of its runner (ModelRunner, which starts the jobs: runner.py imports this module, so
    this one names what it needs instead of importing it back)."""

    config: RuntimeConfig  # prefill_chunk
    device: torch.device
    pool: KVPool
    prefix_cache: PrefixCache | None

    @property
    def prefill_grid(self) -> int: ...

    def method_group(self, spec: MethodSpec) -> MethodGroup: ...

    def forward(self, ctx: PrefillContext, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor: ...


class PrefillJob:
    """begin, end: the session's length before and after the prompt; ``pos`` the next position to feed;
    cached: the prompt's tokens that came from the prefix cache (positions begin .. begin + cached - 1);
    looked_up: the prompt's tokens the cache was asked for (its length when it was, else 0);
    hashes: the chain hashes of the prompt's full blocks to cache once it is in (None: do not cache);
    tail: the cached queries (layers, H, n, d) of positions pos - n .. pos - 1, the last n of which the method
    observes with the ones the job computes (None: the job computes all it observes)."""

    def __init__(self, runner: PrefillRunner, session: Session, token_ids: list[int], begin: int | None = None,
                 hashes: list[bytes] | None = None, tail: torch.Tensor | None = None) -> None:
        self.runner, self.session, self.token_ids, self.hashes = runner, session, token_ids, hashes
        self.begin = session.length if begin is None else begin
        self.pos = session.length
        self.cached = self.pos - self.begin
        self.looked_up = len(token_ids) if hashes is not None else 0
        self.end = self.begin + len(token_ids)
        self.group = runner.method_group(session.method)
        self.table = runner.pool.block_table([session.blocks], runner.device)
        Q = self.group.method.prefill_queries
        self.tail_start = max(self.begin, self.end - Q)  # the first position whose query the method observes
        self.tails: dict[int, torch.Tensor] = {}  # layer -> the prompt's last queries collected so far
        if tail is not None and self.tail_start < self.pos:
            self.tails = {layer: t[:, t.shape[1] - (self.pos - self.tail_start):] for layer, t in enumerate(tail)}
        # where to keep tail queries for later prompts (prefix_cache.py): the last grid boundary past pos
        chunk, grid = runner.config.prefill_chunk, runner.prefill_grid
        self.keep_at = self.end // grid * grid if hashes is not None and 0 < Q <= chunk else 0
        if self.keep_at - Q >= self.pos:
            self.tail_start = min(self.tail_start, self.keep_at - Q)
        else:
            self.keep_at = 0
        self.whole_chunk_at_keep = False  # the job computed positions keep_at - chunk .. keep_at - 1 in one forward
        self.aborted = False

    @property
    def done(self) -> bool:
        return self.pos >= self.end

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    @torch.inference_mode()
    def step(self, max_tokens: int) -> torch.Tensor | None:
        """Feed up to ``max_tokens`` more tokens -> (vocab,) float32 logits once the last is in, else None."""
        if self.aborted or self.done:
            raise RuntimeError("this prefill has ended")
        runner, dev = self.runner, self.runner.device
        # read again: a compaction between steps may have moved the session's blocks (ModelRunner._compact)
        self.table = runner.pool.block_table([self.session.blocks], dev)
        stop = min(self.end, self.pos + max(1, max_tokens))
        logits = None
        while self.pos < stop:
            s = self.pos
            e = min(stop, s + runner.config.prefill_chunk)
            ids = self.token_ids[s - self.begin:e - self.begin]
            kv = StepKV(runner.pool, self.table, torch.tensor([s], device=dev), torch.tensor([e], device=dev))
            ctx = PrefillContext(kv, self.group, self.session.slots, first=s, last=e == self.end,
                                 tail_start=self.tail_start, tails=self.tails)
            positions = torch.arange(s, e, device=dev).unsqueeze(0)  # (1, T)
            logits = runner.forward(ctx, torch.tensor([ids], device=dev), positions)
            self.session.token_ids.extend(ids)
            self.pos = e
            if e == self.keep_at and s == e - runner.config.prefill_chunk:
                self.whole_chunk_at_keep = True
        if self.done:
            if self.hashes is not None and self.runner.prefix_cache is not None:
                self._cache_prompt()
            self.tails.clear()
        return logits[0] if self.done else None

    def _cache_prompt(self) -> None:
        """Cache the prompt's full blocks, and the tail queries at ``keep_at`` when the job computed them in the
        chunk a full prefill computes them in."""
        cache, P = self.runner.prefix_cache, self.runner.pool.block_size
        full = self.end // P  # begin is 0: the prompt's full blocks
        cache.insert(self.hashes[:full], self.session.blocks[:full])
        if self.whole_chunk_at_keep and self.tails:
            Q, first = self.group.method.prefill_queries, self.keep_at - self.tail_start  # tails start at tail_start
            queries = torch.stack([self.tails[layer][:, first - Q:first] for layer in range(len(self.tails))])
            cache.insert_queries(self.hashes[self.keep_at // P - 1], queries.contiguous())  # (layers, H, Q, d)

    def abort(self) -> None:
        """Stop before the end: the session goes back to ``begin`` tokens (blocks past them released)."""
        if self.aborted or self.done:
            return
        self.aborted = True
        truncate(self.runner.pool, self.session, self.begin)
        self.tails.clear()
