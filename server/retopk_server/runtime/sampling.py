"""Turning logits into tokens (one Sampler per request) and tokens into streamed text (StopChecker).

Order of the logit transforms, each applied to what the previous one left:
  1. repetition penalty p over prompt and generated tokens: l -> l / p if l > 0 else l * p (CTRL, as in HF)
  2. presence / frequency penalties over generated tokens: l -> l - presence * [c > 0] - frequency * c,
     c = how often the token was generated so far (OpenAI's definition)
  3. temperature 0 -> argmax (greedy); otherwise l / T, then
  4. top-k: keep the k largest logits (ties at the k-th value kept)
  5. top-p: keep the smallest prefix of the descending distribution whose mass reaches p
  6. min-p: keep tokens whose probability is >= min_p * the largest probability
  7. draw one token from the renormalised distribution with the request's own generator

A constrained request (runtime/constraints.py) sets the logit of every token its grammar forbids next to
-inf right after step 2 (on the penalties' copy; before or after them is the same, a penalty never lifts
a -inf), so every later step works on the allowed tokens only; rows without a constraint skip that.

Log-probabilities (when a request asks for them) are log_softmax of the logits after step 3's division
by the temperature (after step 2 at T = 1 for greedy), before the truncations of steps 4-6: the model's
distribution as the penalties and the temperature shape it, the same whichever filters are on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from retopk_core.params import ParamError, check, param

# Below this temperature sampling is greedy: the tempered logits l / T stay finite above it (|l| <= 1e4 after
# a repetition penalty <= 100), and a distribution that sharp is the argmax anyway.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling; each field declared once (default, doc, bounds: ``retopk_core.params``).

    These defaults are the neutral values (greedy, no filter, no penalty); a Generate request's unset fields
    take the served model's defaults instead (``sampling_defaults.resolve``)."""

    temperature: float = param(0.0, "softmax temperature (0 = greedy; so is any value below MIN_TEMPERATURE)", low=0)
    top_p: float = param(1.0, "nucleus mass in (0, 1]", high=1)
    top_k: int = param(0, "keep the k largest logits (0 = off)", low=0)
    min_p: float = param(0.0, "keep tokens with probability >= min_p x the largest", low=0, high=1)
    repetition_penalty: float = param(1.0, "1 = off; over prompt and generated tokens", low=0.01, high=100)
    presence_penalty: float = param(0.0, "subtracted once from every generated token's logit", low=-2, high=2)
    frequency_penalty: float = param(0.0, "subtracted per occurrence of a generated token", low=-2, high=2)
    seed: int | None = param(None, "seed of the request's generator (None: nondeterministic)", low=0)

    def __post_init__(self) -> None:  # every failure is a ParamError naming its field
        check(self)
        if not self.top_p > 0:
            raise ParamError("top_p", f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.seed is not None and self.seed >= 2**63:
            raise ParamError("seed", f"seed must be a non-negative 64-bit integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that l / T would overflow float32: the argmax, as vLLM does."""
        return self.temperature < MIN_TEMPERATURE


def apply_penalties(logits: torch.Tensor, params: SamplingParams, generated_ids: list[int],
                    prompt_ids: list[int]) -> torch.Tensor:
    """Steps 1-2 of the module docstring on a float32 copy. logits (V,) -> (V,)."""
    logits = logits.float().clone()
    if params.repetition_penalty != 1.0 and (generated_ids or prompt_ids):
        ids = torch.tensor(sorted(set(prompt_ids) | set(generated_ids)), dtype=torch.long, device=logits.device)
        seen = logits[ids]  # (n,)
        p = params.repetition_penalty
        logits[ids] = torch.where(seen > 0, seen / p, seen * p)
    if (params.presence_penalty or params.frequency_penalty) and generated_ids:
        counts = Counter(generated_ids)
        ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
        c = torch.tensor(list(counts.values()), dtype=torch.float32, device=logits.device)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * c
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Steps 3-6 for temperature > 0: tempered logits (V,) with removed tokens at -inf."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)  # (V,)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        drop_sorted = mass_before >= params.top_p  # the first token always has mass_before 0 < top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def token_logprobs(scaled: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(logprob of ``token``, the ``top`` most likely (id, logprob) pairs, most likely first) under
    log_softmax(scaled). scaled (V,) float32: penalised logits divided by the temperature."""
    logprobs = torch.log_softmax(scaled, dim=-1)  # (V,)
    if not top:
        return float(logprobs[token]), ()
    values, ids = torch.topk(logprobs, min(top, logprobs.numel()))  # (top,) each, descending
    keep = torch.isfinite(values)  # a constraint's forbidden tokens are no alternatives
    return float(logprobs[token]), tuple(zip(ids[keep].tolist(), values[keep].tolist(), strict=True))


class Sampler:
    """Samples one request's tokens; its generator is seeded from ``params.seed`` (random when None).

    ``logprobs``: None (off) or how many alternatives to report with each token's log-probability; after
    each ``sample`` the pair of ``token_logprobs`` is in ``last_logprobs`` (None when off).
    ``constraint``: the request's RowConstraint (runtime/constraints.py) or None; ``sample`` masks the
    logits with it and advances it past the drawn token.
    """

    def __init__(self, params: SamplingParams, logprobs: int | None = None, constraint=None) -> None:
        self.params = params
        self.logprobs = logprobs
        self.constraint = constraint
        self.last_logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None
        self.generator = torch.Generator(device="cpu")
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply first (no penalty, constraint or log-probabilities): the token is the
        argmax of the raw logits, which ``greedy_tokens`` takes for a whole batch at once."""
        p = self.params
        return (p.greedy and self.constraint is None and self.logprobs is None and p.repetition_penalty == 1.0
                and not p.presence_penalty and not p.frequency_penalty)

    def sample(self, logits: torch.Tensor, generated_ids: list[int], prompt_ids: list[int]) -> int:
        """logits (V,) float32 on any device -> the next token id (never changes ``logits``)."""
        logits = apply_penalties(logits.detach().float().cpu(), self.params, generated_ids, prompt_ids)  # a copy
        if self.constraint is not None:  # in place on that copy; a penalty never lifts a -inf, so the order is free
            self.constraint.apply(logits)
        if self.params.greedy:
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(filter_logits(logits, self.params), dim=-1)  # (V,)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        if self.logprobs is not None:
            scaled = logits if self.params.greedy else logits / self.params.temperature
            self.last_logprobs = token_logprobs(scaled, token, self.logprobs)
        if self.constraint is not None and not self.constraint.accept(token):
            raise RuntimeError(f"the constraint refused token {token}, which its own mask allowed")
        return token


# Logit dtypes numpy holds as they are (bfloat16 it has not): ``greedy_tokens`` takes their argmax there.
NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64, torch.float16)


def greedy_tokens(samplers: list[Sampler], logits: torch.Tensor) -> dict[int, int]:
    """{row: token} for the rows whose sampler is ``plain_greedy``, from one argmax over those rows of logits
    (B, V): the same token their ``sample`` would draw, without a copy of each row's logits."""
    rows = [i for i, s in enumerate(samplers) if s.plain_greedy]
    if not rows:
        return {}
    picked = logits if len(rows) == len(samplers) else logits[rows]  # (n, V)
    if picked.device.type == "cpu" and picked.dtype in NUMPY_ARGMAX_DTYPES:
        # numpy's argmax is torch.argmax's token (the first of equal maxima; a NaN, the first one, where a row has
        # one) from a vectorised pass that costs a fraction of torch's max over a CPU batch's rows
        # (measured: docs/bench/history.md, 2026-12-07, helper h49)
        tokens = picked.numpy().argmax(axis=-1).tolist()
    else:  # max's indices are argmax's, from a reduction that costs less than torch's argmax (history.md, h39)
        tokens = picked.max(dim=-1).indices.tolist()
    return dict(zip(rows, tokens, strict=True))


class StopChecker:
    """Incremental detokenizer with stop token ids and stop strings.

    ``push`` returns the text that became final with this token. Text that could still be the start of
    a stop string is held back until it cannot; when a stop string appears, the text before it is
    emitted and generation stops (the stop string itself is not emitted). A stop token id stops
    without emitting its text. ``flush`` returns what is held back when generation ends otherwise.
    """

    def __init__(self, tokenizer, stop_token_ids: list[int], stop_strings: list[str]) -> None:
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise ValueError("stop_strings must be non-empty strings")
        self.tokenizer = tokenizer
        self.stop_token_ids = set(int(t) for t in stop_token_ids)
        self.stop_strings = list(stop_strings)
        self.ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] decode to context already turned into text
        self._read_offset = 0
        self._pending = ""  # decoded but not yet emitted (may be the start of a stop string)
        self.stopped = False
        self.stop_reason: str | int | None = None  # the stop string or stop token id that stopped generation

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _new_text(self, token_id: int) -> str:
        """Text added by token_id, '' while it ends in an incomplete UTF-8 sequence."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def push(self, token_id: int) -> tuple[str, bool]:
        if self.stopped:
            raise RuntimeError("push after the generation stopped")
        if token_id in self.stop_token_ids:
            self.stopped, self.stop_reason = True, token_id
            return self.flush(), True
        self._pending += self._new_text(token_id)
        hits = [(i, s) for s in self.stop_strings if (i := self._pending.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            out, self._pending = self._pending[:i], ""
            self.stopped, self.stop_reason = True, s
            return out, True
        hold = max((n for s in self.stop_strings for n in range(min(len(s) - 1, len(self._pending)), 0, -1)
                    if self._pending.endswith(s[:n])), default=0)
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """Text held back as a possible stop-string start (call when generation ends without a stop)."""
        out, self._pending = self._pending, ""
        return out
