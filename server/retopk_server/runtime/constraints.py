"""Constrained decoding: a request's JSON schema, JSON object, regex or grammar as a per-token mask.

xgrammar (the library vLLM and SGLang use) compiles a constraint against the tokenizer's vocabulary into
a CompiledGrammar; a GrammarMatcher walks it token by token and fills a bitmask of the tokens that may
come next (one bit per token, int32 words). The sampler sets every other logit to -inf.

    ConstraintSpec      what a request asks for (kind, text, strict), checked against ConstraintLimits
    ConstraintCompiler  tokenizer -> compiled grammars, cached by content (an LRU of ``cache_size``), each
                        compilation bounded by ``compile_timeout_s`` (a slower one is the client's error)
    RowConstraint       one running request's matcher and mask; ``start_fill`` computes the next mask on
                        a helper thread while the model runs, ``apply`` waits for it and masks the logits

Rows without a constraint hold no RowConstraint and pay nothing. Errors a client caused (bad JSON, a
schema the compiler refuses, a grammar that does not parse, too large, too slow) are ConstraintError
naming the field, never an internal error.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

KINDS = ("json_schema", "json_object", "regex", "grammar")


class ConstraintError(ValueError):
    """A constraint the client must fix: ``field`` names it (e.g. "constraint.json_schema")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ConstraintLimits:
    """Bounds of one constraint (reported in ModelInfo.limits).

    max_chars          characters of a schema, regex or grammar
    max_depth          nesting of a JSON schema (objects and arrays inside each other)
    compile_timeout_s  longest a compilation may take
    """

    max_chars: int = 65536
    max_depth: int = 32
    compile_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_chars <= 0 or self.max_depth <= 0 or not self.compile_timeout_s > 0:
            raise ValueError("constraint limits must be positive")


@dataclass(frozen=True)
class ConstraintSpec:
    """kind: one of KINDS; text: the schema (JSON text), regex or grammar ("" for json_object);
    strict: a JSON schema's strict mode; field: the request field that holds it, named by errors
    ("" = GenerateRequest's ``constraint.<kind>``)."""

    kind: str
    text: str = ""
    strict: bool = False
    field: str = ""

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.text, self.strict

    @property
    def where(self) -> str:
        return self.field or f"constraint.{self.kind}"

    def check(self, limits: ConstraintLimits) -> None:
        """ConstraintError naming the field when the constraint is empty, too large, too deep or not JSON."""
        name = self.where
        if self.kind not in KINDS:
            raise ConstraintError(self.field or "constraint", f"unknown kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind == "json_object":
            return
        if not self.text:
            raise ConstraintError(name, "must not be empty")
        if len(self.text) > limits.max_chars:
            raise ConstraintError(name, f"too long: {len(self.text)} characters, the limit is {limits.max_chars} "
                                        "(ModelInfo.limits.max_constraint_chars)")
        if self.kind == "json_schema":
            schema = parse_schema(name, self.text)
            if json_depth(schema, limits.max_depth + 1) > limits.max_depth:
                raise ConstraintError(name, f"nested too deeply: more than {limits.max_depth} levels "
                                            "(ModelInfo.limits.max_constraint_depth)")


def parse_schema(field: str, text: str):
    """A JSON schema's text -> the parsed object; ConstraintError when it is not a JSON object or boolean."""
    try:
        schema = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise ConstraintError(field, f"not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(field, f"a JSON schema is an object, got {type(schema).__name__}")
    return schema


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def json_depth(value, cap: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), counted up to ``cap`` (iteratively: no recursion)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            d += 1
            deepest = max(deepest, d)
            if d >= cap:
                return d
            stack.extend((c, d) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


class ConstraintCompiler:
    """Compiles ConstraintSpecs for one tokenizer; thread-safe. Built lazily (the first constrained request
    pays xgrammar's scan of the tokenizer's vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, limits: ConstraintLimits | None = None,
                 cache_size: int = 256) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.limits = limits or ConstraintLimits()
        self.vocab_size = int(vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=[int(t) for t in stop_token_ids] or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # one compilation at a time: a flood of new grammars waits here instead of taking every core
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retopk-grammar")

    def compile(self, spec: ConstraintSpec):
        """The CompiledGrammar of ``spec`` (from the cache when seen before); ConstraintError when it is
        invalid, cannot be compiled, or does not compile within the time limit."""
        spec.check(self.limits)
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
            else:
                future = self._cache[spec.key] = self._pool.submit(self._compile, spec)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        try:
            return future.result(timeout=self.limits.compile_timeout_s)
        except FutureTimeout:
            raise ConstraintError(spec.where, f"did not compile within "
                                  f"{self.limits.compile_timeout_s:g} s (ModelInfo.limits."
                                  "constraint_compile_timeout_ms); simplify it") from None
        except ConstraintError:
            with self._lock:  # not cached: the same mistake is cheap to find again, and the cache stays for good ones
                if self._cache.get(spec.key) is future:
                    del self._cache[spec.key]
            raise

    def _compile(self, spec: ConstraintSpec):
        name = spec.where
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "json_schema":
                return self._compiler.compile_json_schema(spec.text, any_whitespace=False, strict_mode=spec.strict)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.text)
            return self._compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's refusals of the client's text
            raise ConstraintError(name, f"cannot be compiled: {_reason(e)}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reason(e: BaseException) -> str:
    """xgrammar's message without its source location prefix ("[time] /project/cpp/x.cc:12: ...")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(" ", 1)[0]:
            text = text.split(": ", 1)[-1]
    return text[:300]


_FILL_POOL: ThreadPoolExecutor | None = None
_FILL_LOCK = threading.Lock()


def _fill_pool() -> ThreadPoolExecutor:
    global _FILL_POOL
    with _FILL_LOCK:
        if _FILL_POOL is None:
            _FILL_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retopk-mask")
        return _FILL_POOL


class RowConstraint:
    """One request's walk through its grammar: ``start_fill`` (any time before ``apply``), ``apply(logits)``,
    then ``accept(token)``. ``terminated`` once the grammar is complete and its end accepted."""

    @classmethod
    def of(cls, compiled, vocab_size: int) -> RowConstraint:
        import xgrammar as xgr

        return cls(xgr, compiled, vocab_size)

    def __init__(self, xgr, compiled, vocab_size: int) -> None:
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V / 32)) int32
        self.vocab_size = vocab_size
        self._pending: Future | None = None

    def start_fill(self) -> None:
        """Compute the next token's mask on the helper thread (while the model's forward runs)."""
        if self._pending is None and not self._matcher.is_terminated():  # complete: no next token to mask
            self._pending = _fill_pool().submit(self._matcher.fill_next_token_bitmask, self._mask)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logit of every token the grammar forbids next to -inf, in place. logits (V,) float32 CPU."""
        if self._matcher.is_terminated():
            raise RuntimeError("the constraint is complete: nothing may follow")
        self.start_fill()
        pending, self._pending = self._pending, None
        pending.result()
        view = logits.view(1, -1)
        n = min(view.shape[1], self.vocab_size)
        self._xgr.apply_token_bitmask_inplace(view[:, :n], self._mask, vocab_size=n)
        if view.shape[1] > n:  # padding rows of the model's embedding past the tokenizer's vocabulary
            view[:, n:] = float("-inf")

    def accept(self, token: int) -> bool:
        """Advance past ``token`` -> whether the grammar allowed it."""
        pending, self._pending = self._pending, None
        if pending is not None:  # a mask computed for a step whose logits were never used
            pending.result()
        return bool(self._matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
