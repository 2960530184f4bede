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

``step_together`` feeds several jobs at once (the engine's newcomers of one iteration): round by round, one
forward over every job's next chunk, the same chunk the job would take alone, the chunks ragged along the
token axis and each causal within its own session (attention.py's PrefillContext). Each job gets what it
would get alone: the same KV, method state and logits up to the float rounding of a GEMM over more rows.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from retopk_server.runtime.attention import MethodGroup, PrefillContext, PrefillSegment, StepKV
from retopk_server.runtime.kv_pool import KVPool
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.prefix_cache import PrefixCache
from retopk_server.runtime.runtime_config import RuntimeConfig
from retopk_server.runtime.session import Session
from retopk_server.runtime.session_state import truncate

log = logging.getLogger("retopk_server.runtime")


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

    def forward(self, ctx: PrefillContext, input_ids: torch.Tensor, position_ids: torch.Tensor,
                logits_at: list[int] | None = None) -> torch.Tensor | None: ...


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

    def step(self, max_tokens: int) -> torch.Tensor | None:
        """Feed up to ``max_tokens`` more tokens -> (vocab,) float32 logits once the last is in, else None."""
        [out] = step_together(self.runner, [(self, max_tokens)])
        if isinstance(out, BaseException):
            raise out
        return out

    def _segment(self, end: int, offset: int) -> PrefillSegment:
        """This job's chunk pos .. end - 1 as rows offset .. of a prefill forward."""
        dev, s = self.runner.device, self.pos
        kv = StepKV(self.runner.pool, self.table, torch.tensor([s], device=dev), torch.tensor([end], device=dev))
        return PrefillSegment(kv, self.group, self.session.slots, first=s, offset=offset, T=end - s,
                              last=end == self.end, tail_start=self.tail_start, tails=self.tails)

    def _commit(self, seg: PrefillSegment, scale: float, logits: torch.Tensor | None) -> torch.Tensor | None:
        """After the forward of ``seg``: keep its queries, let the method observe the prompt when the chunk was its
        last (raising leaves ``pos`` where it was, for ``abort``), then advance -> ``logits`` once done."""
        for layer, kept in seg.kept.items():
            prev = self.tails.get(layer)
            self.tails[layer] = kept if prev is None else torch.cat([prev, kept], dim=1)
        if seg.last:
            seg.observe(scale)
        s, e, chunk = self.pos, seg.first + seg.T, self.runner.config.prefill_chunk
        self.session.token_ids.extend(self.token_ids[s - self.begin:e - self.begin])
        self.pos = e
        if e == self.keep_at and s == e - chunk:
            self.whole_chunk_at_keep = True
        if not self.done:
            return None
        if self.hashes is not None and self.runner.prefix_cache is not None:
            self._cache_prompt()
        self.tails.clear()
        return logits

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


def _forward(runner: PrefillRunner, chunks: list[tuple[PrefillJob, int]]) -> list[torch.Tensor | BaseException | None]:
    """One forward over each job's chunk pos .. end - 1 (``chunks``: (job, end)) -> per job its logits (vocab,)
    when the chunk ends its prompt, else None, or the exception its commit raised (the method's observation).
    Raises when the forward itself fails: then no job has changed but for KV at the chunks' positions, which
    a retry writes again."""
    dev = runner.device
    segments, ids, positions, at = [], [], [], []
    for job, end in chunks:
        segments.append(job._segment(end, len(ids)))
        ids += job.token_ids[job.pos - job.begin:end - job.begin]
        positions += range(job.pos, end)
        if end == job.end:
            at.append(len(ids) - 1)
    ctx = PrefillContext(segments)
    logits = runner.forward(ctx, torch.tensor([ids], device=dev), torch.tensor([positions], device=dev),
                            logits_at=at)  # (len(at), V) or None
    out: list[torch.Tensor | BaseException | None] = []
    row = 0
    for (job, _), seg in zip(chunks, segments, strict=True):
        mine = None
        if seg.last:
            mine, row = logits[row], row + 1
        try:
            out.append(job._commit(seg, ctx.scale, mine))
        except Exception as e:  # noqa: BLE001 - this job alone ends (its caller aborts it)
            out.append(e)
    return out


@torch.inference_mode()
def step_together(runner: PrefillRunner,
                  plan: list[tuple[PrefillJob, int]]) -> list[torch.Tensor | BaseException | None]:
    """Feed each job of ``plan`` (job, n) up to n more tokens -> per job its (vocab,) float32 logits once its prompt
    is in, else None, or the exception that stopped it (the caller aborts that job).

    Round by round, one forward over each job's next chunk: at most ``prefill_chunk`` tokens, as the job alone
    would take them. A forward of several jobs that fails is retried one job at a time, so that only the jobs
    that fail alone stop.
    """
    for job, _ in plan:
        if job.aborted or job.done:
            raise RuntimeError("this prefill has ended")
        # read again: a compaction between steps may have moved the session's blocks (ModelRunner._compact)
        job.table = runner.pool.block_table([job.session.blocks], runner.device)
    stops = [min(job.end, job.pos + max(1, n)) for job, n in plan]
    out: list[torch.Tensor | BaseException | None] = [None] * len(plan)
    chunk = runner.config.prefill_chunk
    while live := [i for i, (job, _) in enumerate(plan) if job.pos < stops[i] and out[i] is None]:
        chunks = [(plan[i][0], min(stops[i], plan[i][0].pos + chunk)) for i in live]
        try:
            results = _forward(runner, chunks)
        except Exception as e:
            if len(live) == 1:
                results = [e]
            else:
                log.exception("a prefill forward of %d prompts failed; feeding them one at a time", len(live))
                results = []
                for c in chunks:
                    try:
                        results += _forward(runner, [c])
                    except Exception as alone:  # noqa: BLE001 - this job alone stops
                        results.append(alone)
        for i, res in zip(live, results, strict=True):
            out[i] = res
    return out
