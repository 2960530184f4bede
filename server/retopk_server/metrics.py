"""Prometheus metrics: every metric of the server is declared in this module, recorded by MetricsObserver
through the engine's observer hooks, and served on an HTTP port of its own (default 9464, ``--metrics-port``).

All names start with ``retopk_``; every series carries a ``model`` label. No request or session ids
are labels: the per-head counter has at most layers x heads x paths series per model.

Per-head ReTopK behaviour (one observation per head per decode step of each running request)
  retopk_attention_decisions_total{layer,head,path}  decode decisions; path is ``retopk_core.methods.base.Path``
        by name: reuse / fallback / refresh / promoted for ReTopK (exact, dense, approx, cached for the other
        methods).
        reuse rate of each head:  sum by (layer, head) (rate(retopk_attention_decisions_total{path="reuse"}[5m]))
                                / sum by (layer, head) (rate(retopk_attention_decisions_total[5m]))
  retopk_exact_path_share_ratio      share (0..1) of head decisions on an exact path (fallback, refresh, promoted,
                                     exact, dense) in the latest decode step; the per-head share is a PromQL ratio
  retopk_candidate_set_size          histogram of M_t, the keys scored with the exact query on the reuse path
  retopk_max_query_similarity{layer} histogram of each head's max cosine to its cached queries (ReTopK), one per
                                     layer (the heads of a layer pooled)
KV group reads per layer (GQA: a head on an exact path reads every key of its KV group, so the group read, not
the per-head path, is what a step costs; ``retopk_core.methods.base.group_reads``; every method counts, Full
and Exact Top-K read every group on every step)
  retopk_kv_group_reads_total{layer}  (sequence, KV group, decode step) triples whose keys were read in full
  retopk_kv_group_steps_total{layer}  (sequence, KV group, decode step) triples observed (batch x H_kv a step)
        group-read rate per layer:  rate(retopk_kv_group_reads_total[5m]) / rate(retopk_kv_group_steps_total[5m]);
        overall: the same with sum() on both sides
Latency (seconds; buckets span 100 us .. 10 min so both CPU and GPU speeds resolve)
  retopk_time_to_first_token_seconds, retopk_time_per_output_token_seconds (interval between a request's
  tokens), retopk_e2e_request_seconds, retopk_queue_wait_seconds, retopk_prefill_seconds,
  retopk_decode_step_seconds (one batched step), retopk_attention_step_seconds{path} (attention core time of
  one decode step of one method group, summed over layers; path = refresh if any head refreshed, else
  fallback if any head fell back, else promoted if any head was promoted, else the most frequent path,
  e.g. reuse)
Traffic and load
  retopk_prompt_tokens_total, retopk_generation_tokens_total, retopk_requests_finished_total{finish_reason},
  retopk_request_errors_total{code}, retopk_rpcs_total{rpc,code}, retopk_decode_batch_size,
  retopk_requests_running, retopk_requests_waiting, retopk_sessions_open{kind=named|ephemeral},
  retopk_kv_cache_bytes{kind=used|reserved}, retopk_query_cache_bytes{kind=used|reserved} (ReTopK's per-head
  query-support FIFOs and the other methods' state), retopk_cache_budget_bytes (the budget both share,
  --kv-cache-bytes), retopk_sessions_evicted_total (idle sessions closed to make room in it),
  retopk_model_info{architecture,layers,heads,...,weight_format,kv_dtype} = 1
Prefix cache (runtime/prefix_cache.py)
  retopk_prefix_cache_lookup_tokens_total  prompt tokens looked up (a session's first prompt, cache on)
  retopk_prefix_cache_hit_tokens_total     of them, the tokens whose KV blocks came from the cache
        hit rate:  rate(retopk_prefix_cache_hit_tokens_total[5m]) / rate(retopk_prefix_cache_lookup_tokens_total[5m])
  retopk_prefix_cache_key_lookup_tokens_total{key}, retopk_prefix_cache_key_hit_tokens_total{key}  the same per
                                           API key: ``key`` is the key's configured name (never the secret;
                                           "anonymous" without keys), the first MAX_KEY_LABELS names seen by the
                                           process, every later one counted under "other" (bounded cardinality)
  retopk_prefix_cache_blocks               KV blocks the cache holds (shared with sessions or not)
  retopk_prefix_cache_bytes{kind=held|idle}  their bytes; idle: held by the cache alone (evicted first, least
                                           recently used, when the budget is short)
The process (prometheus_client's ProcessCollector, on Linux): process_resident_memory_bytes,
  process_virtual_memory_bytes, process_cpu_seconds_total, process_open_fds, process_start_time_seconds
Router-facing load (plain gauges a gateway or the Gateway API Inference Extension's endpoint picker scores
replicas by; docs/deploy.md names the picker's flags)
  retopk_requests_waiting, retopk_requests_running, retopk_kv_cache_utilization_ratio (0..1: the share of the
  cache budget held by sessions, KV blocks and method state; near 1 means the next admission evicts idle
  sessions or is refused)

Cost on the engine thread: a step's per-head statistics (runtime/stats.py's StepStatsBatch, stacked only when
read) wait in a list, and every FOLD_STEPS steps, and whenever the registry is collected (a scrape), the steps
waiting are folded in at once: their (rows, layers, heads) path tensors become per-(layer, head, path) counts
with one ``np.bincount`` added to a numpy array, their (rows, layers, H_kv) group reads per-layer counts with
one sum; the two distributions are bucketed the same way (``np.searchsorted`` + ``np.bincount``). A step's own
Python then costs a list append: one step's few hundred values take a numpy call each as long as many steps'
do, and the interpreter's cache-cold start after a step's layers would pay it per step. A scrape reads every
step so far. Custom collectors expose those arrays at scrape time, so no per-head Python loop runs per step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from retopk_core.methods.base import FULL_READ_PATHS, PATH_NAMES, Path
from retopk_server.engine.observer import EngineObserver
from retopk_server.engine.requests import ErrorCode, FinishReason
from retopk_server.runtime.stats import StepStatsBatch

log = logging.getLogger("retopk_server.metrics")

DEFAULT_METRICS_PORT = 9464
PREFIX = "retopk_"

# Request-level latencies: 1 ms (a GPU prefill of a short prompt) .. 10 min (a long CPU generation).
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
                   120.0, 300.0, 600.0)
# Per-token and per-step latencies: 100 us (GPU attention of one step) .. 10 s (a long CPU step).
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0)
CANDIDATE_BUCKETS = tuple(float(2 ** i) for i in range(18))  # 1 .. 131072 keys
# A cosine <= 0 lands in the first bucket (a negative bound would drop _sum and _count from the exposition).
SIMILARITY_BUCKETS = (0.0, 0.25, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

NUM_PATHS = max(p.value for p in Path) + 1
# The paths a ReTopK head can take (their series exist from the start).
RETOPK_PATHS = (Path.REUSE, Path.FALLBACK, Path.REFRESH, Path.PROMOTED)
# A head on an exact path scores every key of its KV group: the core's full-read paths.
EXACT_PATHS = FULL_READ_PATHS


def model_label(name: str) -> str:
    """The ``model`` label of a model name or checkpoint path (a path's last component)."""
    trimmed = name.rstrip("/" + os.sep)
    return os.path.basename(trimmed) if ("/" in trimmed or os.sep in trimmed) else trimmed


class ArrayCounts:
    """Per model one int64 count array, added to under a lock (a new shape restarts it); subclasses
    expose it as a counter family in ``collect``."""

    name = doc = ""
    labels: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, np.ndarray] = {}

    def add(self, model: str, counts: np.ndarray) -> None:
        """counts (the subclass's shape) int64 added to the model's totals (a new shape restarts them)."""
        with self._lock:
            current = self._counts.get(model)
            if current is None or current.shape != counts.shape:
                self._counts[model] = counts.astype(np.int64, copy=True)
            else:
                current += counts

    def totals(self, model: str) -> np.ndarray | None:
        with self._lock:
            c = self._counts.get(model)
            return None if c is None else c.copy()

    def _snapshot(self) -> dict[str, np.ndarray]:
        with self._lock:
            return {m: c.copy() for m, c in self._counts.items()}

    def describe(self) -> Iterable[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.doc, labels=["model", *self.labels])


class LayerCounts(ArrayCounts):
    """Collector of one per-layer counter: per model a (layers,) int64 array, a series per layer."""

    labels = ("layer",)

    def __init__(self, name: str, doc: str) -> None:
        super().__init__()
        self.name, self.doc = name, doc

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=["model", *self.labels])
        for model, c in self._snapshot().items():
            for layer, n in enumerate(c.tolist()):
                family.add_metric([model, str(layer)], float(n))
        yield family


class HeadPathCounts(ArrayCounts):
    """Collector of retopk_attention_decisions_total: per model a (layers, heads, paths) int64 array.

    Exposes, for every (layer, head), each path seen anywhere in the model, and always the ReTopK paths
    (``RETOPK_PATHS``) once the model's shape is known (``on_start`` adds zeros): a head that never reused
    reads 0 rather than missing, and every series exists before the first request, so rate() over it works
    even when a burst of traffic falls between two scrapes.
    """

    name = PREFIX + "attention_decisions"
    doc = "Attention decode decisions per layer, head and path (retopk_core Path names)."
    labels = ("layer", "head", "path")

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=["model", *self.labels])
        for model, c in self._snapshot().items():
            layers, heads, _ = c.shape
            seen = c.sum(axis=(0, 1)) > 0  # (paths,)
            seen[list(RETOPK_PATHS)] = True
            for p in np.flatnonzero(seen):
                name = PATH_NAMES.get(int(p), str(int(p)))
                for layer in range(layers):
                    for head in range(heads):
                        family.add_metric([model, str(layer), str(head), name], float(c[layer, head, p]))
        yield family


class BulkHistogram:
    """Collector of one histogram (labelled by model, and with ``per_layer`` by layer) that takes a whole tensor
    of values per call.

    ``observe_many`` buckets with ``np.searchsorted`` (bucket i holds values in (bounds[i-1], bounds[i]],
    Prometheus' ``le``) and one ``bincount``; NaN values are skipped. With ``per_layer`` the values are
    (..., layers, heads) and each layer has its own series.
    """

    def __init__(self, name: str, doc: str, bounds: Sequence[float], per_layer: bool = False) -> None:
        self.name, self.doc, self.per_layer = name, doc, per_layer
        self.bounds = tuple(float(b) for b in bounds)
        self._bounds = np.asarray(self.bounds, dtype=np.float64)
        self._lock = threading.Lock()
        # model -> [counts (layers, len(bounds) + 1) int64, sums (layers,) float]; one "layer" without per_layer
        self._data: dict[str, list] = {}

    @property
    def labels(self) -> list[str]:
        return ["model", "layer"] if self.per_layer else ["model"]

    def observe_many(self, model: str, values) -> None:
        """values: a tensor or array of any shape ((..., layers, heads) with ``per_layer``)."""
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().numpy()
        v = np.asarray(values, dtype=np.float64)
        layers = v.shape[-2] if self.per_layer else 1
        v = v.reshape(-1, layers, v.shape[-1]).transpose(1, 0, 2).reshape(layers, -1) if self.per_layer \
            else v.reshape(1, -1)  # (layers, observations)
        nb = len(self.bounds) + 1
        keep = ~np.isnan(v)
        if not keep.any():
            return
        index = np.searchsorted(self._bounds, np.where(keep, v, 0.0), side="left") + nb * np.arange(layers)[:, None]
        counts = np.bincount(index[keep], minlength=layers * nb).reshape(layers, nb)
        sums = np.where(keep, v, 0.0).sum(axis=1)
        with self._lock:
            entry = self._data.get(model)
            if entry is None or entry[0].shape != counts.shape:
                self._data[model] = [counts.astype(np.int64), sums]
            else:
                entry[0] += counts
                entry[1] += sums

    def describe(self) -> Iterable[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.doc, labels=self.labels)

    def collect(self) -> Iterable[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        with self._lock:
            snapshot = {m: (c.copy(), s.copy()) for m, (c, s) in self._data.items()}
        for model, (counts, sums) in snapshot.items():
            for layer, (row, total) in enumerate(zip(counts, sums, strict=True)):
                cumulative = np.cumsum(row)
                buckets = [(_le(b), float(n)) for b, n in zip(self.bounds, cumulative[:-1], strict=True)]
                buckets.append(("+Inf", float(cumulative[-1])))
                family.add_metric([model, str(layer)] if self.per_layer else [model], buckets, float(total))
        yield family


def _le(bound: float) -> str:
    return repr(float(bound))


class BeforeCollect:
    """A collector of no metrics that runs ``hooks`` whenever its registry is collected; registered first, so that
    what they record is in the same scrape (MetricsObserver's fold of the steps waiting)."""

    def __init__(self) -> None:
        self.hooks: list = []

    def describe(self) -> Iterable:
        return ()

    def collect(self) -> Iterable:
        for hook in self.hooks:
            hook()
        return ()


class Metrics:
    """Every metric of the server, on its own CollectorRegistry (no global state)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model"]
        self.before_collect = BeforeCollect()
        r.register(self.before_collect)
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends (nothing where /proc is absent)

        def hist(name, doc, buckets, labels=()):
            return Histogram(PREFIX + name, doc, [*m, *labels], buckets=buckets, registry=r)

        # per-head ReTopK behaviour
        self.decisions = HeadPathCounts()
        self.candidate_size = BulkHistogram(PREFIX + "candidate_set_size",
                                            "Keys scored with the exact query on ReTopK's reuse path (M_t), per head "
                                            "and step.", CANDIDATE_BUCKETS)
        self.max_similarity = BulkHistogram(PREFIX + "max_query_similarity",
                                            "Max cosine of a head's query to its cached queries, per head and step, "
                                            "by layer.", SIMILARITY_BUCKETS, per_layer=True)
        # KV group reads per layer: reads / steps is the group-read rate
        self.group_reads = LayerCounts(PREFIX + "kv_group_reads", "(sequence, KV group, decode step) triples "
                                       "whose keys were read in full, per layer (a head of the group took an "
                                       "exact path).")
        self.group_steps = LayerCounts(PREFIX + "kv_group_steps", "(sequence, KV group, decode step) triples "
                                       "observed, per layer; kv_group_reads / kv_group_steps is the group-read "
                                       "rate.")
        for collector in (self.decisions, self.candidate_size, self.max_similarity, self.group_reads,
                          self.group_steps):
            r.register(collector)
        exact = ", ".join(PATH_NAMES[p] for p in EXACT_PATHS)
        self.exact_share = Gauge(PREFIX + "exact_path_share_ratio", f"Share (0..1) of head decisions on an exact path "
                                 f"({exact}) in the latest decode step.", m, registry=r)
        # latency
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.", REQUEST_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Interval between consecutive tokens of a request.",
                         STEP_BUCKETS)
        self.e2e = hist("e2e_request_seconds", "Arrival to the last token of a request that finished.",
                        REQUEST_BUCKETS)
        self.queue_wait = hist("queue_wait_seconds", "Time a request waited in the admission queue.",
                               REQUEST_BUCKETS)
        self.prefill = hist("prefill_seconds", "Time to feed a request's new tokens through the model.",
                            REQUEST_BUCKETS)
        self.step = hist("decode_step_seconds", "One batched decode step (all running requests).", STEP_BUCKETS)
        self.attention = hist("attention_step_seconds", "Attention-core time of one decode step of one method "
                              "group, summed over layers, by the step's path.", STEP_BUCKETS, ["path"])
        self.batch = hist("decode_batch_size", "Requests in one batched decode step.", BATCH_BUCKETS)
        # traffic
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Input tokens fed through prefill.", m, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", m, registry=r)
        self.finished = Counter(PREFIX + "requests_finished", "Requests that ended normally, by finish reason.",
                                [*m, "finish_reason"], registry=r)
        self.errors = Counter(PREFIX + "request_errors", "Requests and rpcs that failed, by status code.",
                              [*m, "code"], registry=r)
        self.rpcs = Counter(PREFIX + "rpcs", "Unary and streaming rpcs that ended, by rpc and status code.",
                            [*m, "rpc", "code"], registry=r)
        # load and memory
        self.running = Gauge(PREFIX + "requests_running", "Requests being decoded.", m, registry=r)
        self.waiting = Gauge(PREFIX + "requests_waiting", "Requests in the admission queue.", m, registry=r)
        self.sessions = Gauge(PREFIX + "sessions_open", "Open sessions (named, or a request's ephemeral one).",
                              [*m, "kind"], registry=r)
        self.kv_bytes = Gauge(PREFIX + "kv_cache_bytes", "KV cache bytes: held by sessions (used) or by the "
                              "block pool (reserved).", [*m, "kind"], registry=r)
        self.kv_utilization = Gauge(PREFIX + "kv_cache_utilization_ratio", "Share (0..1) of the cache budget "
                                    "held by sessions: (kv_cache_bytes + query_cache_bytes used) / "
                                    "cache_budget_bytes (without a budget: KV used / reserved).", m, registry=r)
        self.cache_budget = Gauge(PREFIX + "cache_budget_bytes", "Bytes the KV cache and the method state may "
                                  "hold together (--kv-cache-bytes).", m, registry=r)
        self.evictions = Counter(PREFIX + "sessions_evicted", "Idle named sessions closed to make room in the "
                                 "cache budget (least recently used first).", m, registry=r)
        self.query_bytes = Gauge(PREFIX + "query_cache_bytes", "Method-state bytes (ReTopK's query-support "
                                 "caches): held by sessions (used) or allocated (reserved).", [*m, "kind"],
                                 registry=r)
        self.prefix_lookup = Counter(PREFIX + "prefix_cache_lookup_tokens", "Prompt tokens looked up in the "
                                     "prefix cache.", m, registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hit_tokens", "Prompt tokens whose KV blocks came from the "
                                   "prefix cache.", m, registry=r)
        self.prefix_key_lookup = Counter(PREFIX + "prefix_cache_key_lookup_tokens", "Prompt tokens looked up in the "
                                         "prefix cache, by API key name (at most MAX_KEY_LABELS, then other).",
                                         [*m, "key"], registry=r)
        self.prefix_key_hits = Counter(PREFIX + "prefix_cache_key_hit_tokens", "Prompt tokens whose KV blocks came "
                                       "from the prefix cache, by API key name (at most MAX_KEY_LABELS, then "
                                       "other).", [*m, "key"], registry=r)
        self.prefix_blocks = Gauge(PREFIX + "prefix_cache_blocks", "KV blocks the prefix cache holds.", m,
                                   registry=r)
        self.prefix_bytes = Gauge(PREFIX + "prefix_cache_bytes", "Bytes of the KV blocks the prefix cache holds "
                                  "(held), of them held by the cache alone (idle).", [*m, "kind"], registry=r)
        self.model_info = Gauge(PREFIX + "model_info", "The served model (value 1).",
                                [*m, "architecture", "layers", "heads", "kv_heads", "head_dim", "device",
                                 "backend", "default_method", "weight_format", "kv_dtype"], registry=r)


# Distinct API key names the per-key prefix cache counters label; later names are counted under "other".
MAX_KEY_LABELS = 32
# Decode steps whose per-head statistics wait to be folded into the metrics together (a scrape folds them sooner).
FOLD_STEPS = 16

_MODEL_ONLY = ("exact_share", "running", "waiting", "kv_utilization", "cache_budget", "evictions", "prompt_tokens",
               "prefix_lookup", "prefix_hits", "prefix_blocks", "generation_tokens", "ttft", "tpot", "e2e",
               "queue_wait", "prefill", "step", "batch")


class MetricsObserver(EngineObserver):
    """Records the engine's and the service's events into ``Metrics`` for one model.

    memory_interval_s  how often (at most) ``on_load`` re-reads the runner's cache sizes
    per_head           ask the engine for every step's per-head statistics, the source of the decision,
                       candidate, similarity, exact-share, KV-group-read and attention-time metrics; on a
                       GPU they cost a device synchronisation per layer, so a deployment may turn them off
                       (those metrics then stay empty)
    """

    def __init__(self, model: str, metrics: Metrics | None = None, memory_interval_s: float = 0.5,
                 per_head: bool = True) -> None:
        self.wants_step_stats = per_head
        self.model = model_label(model)
        self.metrics = metrics or Metrics()
        self.memory_interval_s = memory_interval_s
        self._memory = None  # the runner's memory() once started
        self._last_memory = -float("inf")
        self._busy = False  # the engine had work at its last on_load (it calls on_load again after its step)
        self._memory_stale = False  # a session opened or closed since the sizes were last read
        self._offsets: dict[tuple[int, int], np.ndarray] = {}
        self._waiting: list[tuple[list[list[int]], object]] = []  # steps to fold: (rows per method group, stats)
        self._fold_lock = threading.Lock()  # the engine thread appends and folds; a scrape folds too
        self.metrics.before_collect.hooks.append(self.fold)
        self._last_token: dict[int, float] = {}  # id(request) -> monotonic time of its latest token
        self._open = {"named": 0, "ephemeral": 0}
        self._keys: set[str] = set()  # ``key`` label values in use (_key_label)
        self.exporter: MetricsServer | None = None  # set by create_observer
        m, model = self.metrics, self.model
        # Children that exist before their first event, so rates and ratios read 0 instead of nothing.
        for reason in FinishReason:
            m.finished.labels(model, reason.name)
        for code in ErrorCode:
            m.errors.labels(model, code.value)
        for kind in ("named", "ephemeral"):
            m.sessions.labels(model, kind)
        for gauge in (m.kv_bytes, m.query_bytes):
            for kind in ("used", "reserved"):
                gauge.labels(model, kind)
        # The model-only children, looked up once (labels() costs a lock and a dict lookup per call).
        self._one = {name: getattr(m, name).labels(model) for name in _MODEL_ONLY}

    # ---- engine thread --------------------------------------------------------------------------------
    def on_start(self, info, memory) -> None:
        self._memory = memory
        if self.wants_step_stats:  # the series exist at 0 from the start, so rates are defined
            m = self.metrics
            m.decisions.add(self.model, np.zeros((info.num_layers, info.num_heads, NUM_PATHS), np.int64))
            for counter in (m.group_reads, m.group_steps):
                counter.add(self.model, np.zeros(info.num_layers, np.int64))
        self.metrics.model_info.labels(
            self.model, info.architecture, str(info.num_layers), str(info.num_heads), str(info.num_kv_heads),
            str(info.head_dim), str(info.device), str(info.backend), info.default_method.name, info.weight_format,
            info.kv_dtype).set(1)

    def on_queue_wait(self, request, seconds: float) -> None:
        self._one["queue_wait"].observe(seconds)

    def on_prefill(self, request, num_tokens: int, seconds: float) -> None:
        self._one["prompt_tokens"].inc(num_tokens)
        self._one["prefill"].observe(seconds)

    def on_prefix_lookup(self, request, num_tokens: int, cached_tokens: int) -> None:
        self._one["prefix_lookup"].inc(num_tokens)
        self._one["prefix_hits"].inc(cached_tokens)
        key = self._key_label(request.spec.owner)
        self.metrics.prefix_key_lookup.labels(self.model, key).inc(num_tokens)
        self.metrics.prefix_key_hits.labels(self.model, key).inc(cached_tokens)

    def _key_label(self, owner: str) -> str:
        """The ``key`` label of an API key's name: the name itself for the first MAX_KEY_LABELS names, "other" after
        (a deployment with many keys keeps a bounded number of series; names are operator-chosen, never secrets)."""
        label = owner or "anonymous"
        if label not in self._keys:
            if len(self._keys) >= MAX_KEY_LABELS:
                return "other"
            self._keys.add(label)
        return label

    def on_first_token(self, request, seconds: float) -> None:
        self._one["ttft"].observe(seconds)

    def on_token(self, request) -> None:
        now = time.monotonic()
        previous = self._last_token.get(id(request))
        if previous is not None:
            self._one["tpot"].observe(now - previous)
        self._last_token[id(request)] = now
        self._one["generation_tokens"].inc()

    def on_step(self, requests: list, seconds: float, stats: list | None) -> None:
        self._one["step"].observe(seconds)
        self._one["batch"].observe(len(requests))
        if not stats or not self.wants_step_stats:  # off: a client's own step-stats request must not half-fill them
            return
        groups: dict[object, list[int]] = {}  # rows of a method group share one attention time
        for i, r in enumerate(requests):
            groups.setdefault(r.method, []).append(i)
        with self._fold_lock:
            self._waiting.append((list(groups.values()), stats))
            if len(self._waiting) < FOLD_STEPS:
                return
        self.fold()

    def fold(self) -> None:
        """Fold the steps waiting into the per-head metrics (any thread; the module docstring says when)."""
        with self._fold_lock:
            waiting, self._waiting = self._waiting, []
            start = 0
            for end in range(1, len(waiting) + 1):  # runs of steps of one (layers, heads) shape
                if end == len(waiting) or waiting[end][1].shape[1:] != waiting[start][1].shape[1:]:
                    self._fold_steps(waiting[start:end])
                    start = end

    def _fold_steps(self, steps: list) -> None:
        """Steps of one (layers, heads) shape: their rows' statistics as one batch, counted and bucketed at once."""
        m, model = self.metrics, self.model
        stats = StepStatsBatch.concat([s for _, s in steps])
        path = stats.path.numpy().astype(np.int64)  # (rows, layers, heads)
        rows, layers, heads = path.shape
        np.clip(path, 0, NUM_PATHS - 1, out=path)
        offsets = self._offsets.get((layers, heads))
        if offsets is None:
            offsets = self._offsets[layers, heads] = np.arange(layers * heads).reshape(1, layers, heads) * NUM_PATHS
        flat = offsets + path  # (rows, layers, heads): index of (layer, head, path)
        counts = np.bincount(flat.reshape(-1), minlength=layers * heads * NUM_PATHS).reshape(layers, heads, NUM_PATHS)
        m.decisions.add(model, counts)
        group_read = stats.group_read.numpy()  # (rows, layers, H_kv) bool
        kv_heads = group_read.shape[-1]
        m.group_reads.add(model, group_read.sum(axis=(0, 2), dtype=np.int64))  # (layers,)
        m.group_steps.add(model, np.full(layers, rows * kv_heads, np.int64))
        if counts[..., Path.REUSE].any():
            m.candidate_size.observe_many(model, stats.n_scored.numpy()[path == Path.REUSE])
        m.max_similarity.observe_many(model, stats.max_sim.numpy())
        # Per step: each method group's attention time by its path mix (bincount of a (step, group) id per row);
        # the exact-path share of the latest step.
        first, ids, seconds = 0, np.empty(rows, np.int64), []
        for groups, step in steps:
            for g in groups:
                ids[[first + i for i in g]] = len(seconds)
                seconds.append(step.attention_s[g[0]])
            first += len(step)
        mix = np.bincount((ids[:, None] * NUM_PATHS + path.reshape(rows, -1)).reshape(-1),
                          minlength=len(seconds) * NUM_PATHS).reshape(len(seconds), NUM_PATHS)
        for per_path, s in zip(mix, seconds, strict=True):
            m.attention.labels(model, step_path_label(per_path)).observe(s)
        per_path = np.bincount(path[rows - len(steps[-1][1]):].reshape(-1), minlength=NUM_PATHS)  # latest step's
        total = int(per_path.sum())
        if total:
            self._one["exact_share"].set(float(per_path[list(EXACT_PATHS)].sum()) / total)

    def on_finish(self, request, reason: str, usage, timings) -> None:
        self._last_token.pop(id(request), None)
        self.metrics.finished.labels(self.model, reason).inc()
        if timings is not None:
            self._one["e2e"].observe(timings.total_s)

    def on_load(self, queued: int, running: int, sessions: int) -> None:
        m, model = self.metrics, self.model
        self._one["waiting"].set(queued)
        self._one["running"].set(running)
        self._open["named"] = sessions
        m.sessions.labels(model, "named").set(sessions)
        self._busy = bool(queued or running)
        now = time.monotonic()
        due = now - self._last_memory >= self.memory_interval_s or (self._memory_stale and not self._busy)
        if self._memory is not None and due:
            self._last_memory = now
            self._record_memory()

    def _record_memory(self) -> None:
        self._memory_stale = False
        m, model, usage = self.metrics, self.model, self._memory()
        m.kv_bytes.labels(model, "used").set(usage.kv_used)
        m.query_bytes.labels(model, "used").set(usage.method_state_used)
        m.kv_bytes.labels(model, "reserved").set(usage.kv_reserved)
        if usage.budget:
            self._one["kv_utilization"].set(usage.utilization)
        else:
            self._one["kv_utilization"].set(min(1.0, usage.kv_used / usage.kv_reserved) if usage.kv_reserved else 0.0)
        self._one["cache_budget"].set(usage.budget)
        m.query_bytes.labels(model, "reserved").set(usage.method_state_reserved)
        self._one["prefix_blocks"].set(usage.prefix_cache_blocks)
        m.prefix_bytes.labels(model, "held").set(usage.prefix_cache_bytes)
        m.prefix_bytes.labels(model, "idle").set(usage.prefix_cache_idle_bytes)

    def on_session_opened(self, session_id: str, ephemeral: bool) -> None:
        self._count_session(ephemeral, +1)

    def on_session_closed(self, session_id: str, ephemeral: bool) -> None:
        self._count_session(ephemeral, -1)

    def on_session_evicted(self, session_id: str) -> None:
        self._one["evictions"].inc()

    def _count_session(self, ephemeral: bool, delta: int) -> None:
        # The engine reports load only while it has work; a session opened or closed by a command
        # while idle updates the cache sizes here. While it has work (a wave's admissions and closes: 8 a wave
        # at 8 streams, each a read of every pool) they are left to its on_load after the step, which reads
        # them within memory_interval_s, and at once when the step left no work.
        kind = "ephemeral" if ephemeral else "named"
        self._open[kind] = max(0, self._open[kind] + delta)
        self.metrics.sessions.labels(self.model, kind).set(self._open[kind])
        if self._memory is None:
            return
        if self._busy:
            self._memory_stale = True
        else:
            self._record_memory()

    # ---- engine or asyncio thread -------------------------------------------------------------------
    def on_error(self, request, code: str) -> None:
        if request is not None:
            self._last_token.pop(id(request), None)
        self.metrics.errors.labels(self.model, code).inc()

    def on_rpc(self, method: str, code: str, seconds: float) -> None:
        self.metrics.rpcs.labels(self.model, method, code).inc()


def step_path_label(per_path: np.ndarray) -> str:
    """One label for a step's mix of head paths (counts per Path code): refresh > fallback > promoted > the
    most frequent (the first three are ReTopK's exact passes, which read whole KV groups)."""
    for p in (Path.REFRESH, Path.FALLBACK, Path.PROMOTED):
        if per_path[p]:
            return PATH_NAMES[p]
    top = int(np.argmax(per_path))
    return PATH_NAMES.get(top, str(top))


class MetricsServer:
    """The HTTP exporter serving ``/metrics`` of one registry; ``close()`` stops it."""

    def __init__(self, registry: CollectorRegistry, port: int = DEFAULT_METRICS_PORT, host: str = "0.0.0.0") -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host, self.port = host, int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def create_observer(config) -> MetricsObserver:
    """The server's observer (called by ``retopk_server.service.server.make_observer``).

    Per-head path counters follow ``config.metrics_per_head``. Starts the exporter on
    ``config.host:config.metrics_port`` unless metrics_port is 0; it lives as long
    as the process (a daemon thread), like the gRPC server it accompanies. A port that cannot be bound is a
    RuntimeError naming metrics_port: a server that was asked for metrics does not run silently without them.
    """
    observer = MetricsObserver(config.model, per_head=config.metrics_per_head)
    if config.metrics_port:
        try:
            exporter = MetricsServer(observer.metrics.registry, config.metrics_port, config.host)
        except OSError as e:  # the port is taken or the host is not an address of this machine
            raise RuntimeError(f"metrics_port: cannot serve metrics on {config.host}:{config.metrics_port}: {e}"
                               ) from None
        log.info("metrics on http://%s:%d/metrics", config.host, exporter.port)
        observer.exporter = exporter
    return observer


__all__ = ["DEFAULT_METRICS_PORT", "Metrics", "MetricsObserver", "MetricsServer", "create_observer",
           "model_label"]
