"""PrefillJob: one prompt fed into one session in chunks, so a scheduler can interleave it with decode steps.

``ModelRunner.start_prefill`` checks the tokens and reserves every KV block the prompt needs (ValueError
or BudgetExceeded before anything changes), then ``step(max_tokens)`` runs dense forwards of at most
``prefill_chunk`` tokens each until ``max_tokens`` are fed, and returns the logits after the prompt's last
token once it is all in. The method observes the prompt (``method.prefill``, with the prompt's last
``prefill_queries`` queries collected across chunks) in the last chunk only, so where the chunks fall
changes nothing. ``abort()`` before the end rewinds the session to where it started (the method has seen
none of it yet), giving back the blocks beyond that point.

With the prefix cache (prefix_cache.py), a first prompt's leading ``cached`` tokens are already in the
session when the job starts (their blocks mapped from the cache): the job feeds the rest, and once the
prompt is in it caches the prompt's full blocks for later prompts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from retopk_server.runtime.attention import StepContext
from retopk_server.runtime.session_state import truncate

if TYPE_CHECKING:
    from retopk_server.runtime.runner import ModelRunner
    from retopk_server.runtime.session import Session


class PrefillJob:
    """begin, end: the session's length before and after the prompt; ``pos`` the next position to feed;
    cached: the prompt's tokens that came from the prefix cache (positions begin .. begin + cached - 1);
    looked_up: the prompt's tokens the cache was asked for (its length when it was, else 0);
    hashes: the chain hashes of the prompt's full blocks to cache once it is in (None: do not cache)."""

    def __init__(self, runner: ModelRunner, session: Session, token_ids: list[int], begin: int | None = None,
                 hashes: list[bytes] | None = None) -> None:
        self.runner, self.session, self.token_ids, self.hashes = runner, session, token_ids, hashes
        self.begin = session.length if begin is None else begin
        self.pos = session.length
        self.cached = self.pos - self.begin
        self.looked_up = len(token_ids) if hashes is not None else 0
        self.end = self.begin + len(token_ids)
        self.group = runner._groups[session.method]
        self.table = runner.pool.block_table([session.blocks], runner.device)
        self.tails: dict[int, torch.Tensor] = {}  # layer -> the prompt's last queries collected so far
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
        stop = min(self.end, self.pos + max(1, max_tokens))
        logits = None
        while self.pos < stop:
            s = self.pos
            e = min(stop, s + runner.config.prefill_chunk)
            ids = self.token_ids[s - self.begin:e - self.begin]
            ctx = StepContext(mode="prefill", pool=runner.pool, table=self.table,
                              start=torch.tensor([s], device=dev), lengths=torch.tensor([e], device=dev),
                              prefill_group=self.group, prefill_slots=self.session.slots, prefill_start=s,
                              prefill_last=e == self.end,
                              tail_start=max(self.begin, self.end - self.group.method.prefill_queries),
                              tails=self.tails)
            positions = torch.arange(s, e, device=dev).unsqueeze(0)  # (1, T)
            logits = runner._forward(ctx, torch.tensor([ids], device=dev), positions)
            self.session.token_ids.extend(ids)
            self.pos = e
        if self.done and self.hashes is not None and self.runner.prefix_cache is not None:
            full = self.end // self.runner.pool.block_size  # begin is 0: the prompt's full blocks
            self.runner.prefix_cache.insert(self.hashes[:full], self.session.blocks[:full])
        return logits[0] if self.done else None

    def abort(self) -> None:
        """Stop before the end: the session goes back to ``begin`` tokens (blocks past them released)."""
        if self.aborted or self.done:
            return
        self.aborted = True
        truncate(self.runner.pool, self.session, self.begin)
        self.tails.clear()
