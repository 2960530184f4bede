"""retopk_server.metrics without a model: the observer's records, read back through Prometheus' own text
parser, against counts written from the definitions here (plain loops over the inputs).

The engine tests drive the real scheduler over tests/server/fake_runner.py (every head takes the
"exact" path there); the per-step tests feed hand-made StepStats with a mix of ReTopK paths. A KV group
counts as read, here as in the issue, when any of its query heads took fallback, refresh, promoted, exact
or dense (written out as READ_CODES, not taken from the core).
"""

from __future__ import annotations

import asyncio
import math
import socket
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from retopk_core.methods.base import PATH_NAMES, Path
from retopk_server.config import ServerConfig
from retopk_server.engine import Engine, EngineConfig, EngineError, GenerationRequest, RequestStream
from retopk_server.metrics import (
    CANDIDATE_BUCKETS,
    SIMILARITY_BUCKETS,
    Metrics,
    MetricsObserver,
    MetricsServer,
    create_observer,
    model_label,
    step_path_label,
)
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.stats import StepStats, StepStatsBatch
from tests.server.engine.engine_helpers import collect
from tests.server.fake_runner import HEADS, LAYERS, FakeRunner

pytestmark = pytest.mark.timeout(60)

READ_CODES = {1, 2, 3, 4, 7}  # fallback, refresh, exact, dense, promoted
RETOPK_CODES = (0, 1, 2, 7)  # reuse, fallback, refresh, promoted


def group_read_loops(path: torch.Tensor, kv_heads: int) -> list[list[bool]]:
    """(layers, heads) path codes -> [layer][group] read, by plain loops over the heads of each group."""
    layers, heads = path.shape
    size = heads // kv_heads
    return [[any(int(path[layer, g * size + i]) in READ_CODES for i in range(size)) for g in range(kv_heads)]
            for layer in range(layers)]


def scrape(metrics: Metrics) -> dict[str, list]:
    """sample name -> [(labels, value)] of the registry's text exposition."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict, name: str, **labels) -> float:
    hits = [v for lab, v in samples.get(name, []) if all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def bucket_counts(samples: dict, name: str) -> dict[float, float]:
    return {float(lab["le"]): v for lab, v in samples[name + "_bucket"]}


def random_stats(gen: torch.Generator, layers: int, heads: int, attention_s: float = 0.002, kv_heads: int = 1,
                 reuse_weight: int = 1) -> StepStats:
    """ReTopK paths (reuse / fallback / refresh / promoted), reuse drawn reuse_weight times as often."""
    codes = torch.tensor([RETOPK_CODES[0]] * (reuse_weight - 1) + list(RETOPK_CODES), dtype=torch.int8)
    path = codes[torch.randint(0, len(codes), (layers, heads), generator=gen)]
    max_sim = torch.rand(layers, heads, generator=gen) * 2 - 1
    max_sim[0, 0] = float("nan")
    n_scored = torch.randint(1, 5000, (layers, heads), generator=gen).to(torch.int32)
    return StepStats(path, max_sim, n_scored, attention_s, num_kv_heads=kv_heads)


def test_step_counts_per_head_and_distributions_match_plain_loops():
    gen = torch.Generator().manual_seed(0)
    layers, heads, kv_heads = 4, 6, 3
    observer = MetricsObserver("/models/My-Model/")
    assert observer.model == "My-Model" == model_label("My-Model")
    requests = [SimpleNamespace(method=MethodSpec("retopk")) for _ in range(3)]
    # reuse 4x as likely, so that some groups (2 heads) stay unread and the read counts are not trivial
    steps = [[random_stats(gen, layers, heads, kv_heads=kv_heads, reuse_weight=4) for _ in requests]
             for _ in range(6)]
    for stats in steps:
        observer.on_step(requests, 0.01, StepStatsBatch.of_rows(stats))

    expected: dict[tuple[int, int, str], int] = {}
    reuse_sizes, sims = [], {layer: [] for layer in range(layers)}
    for stats in steps:
        for s in stats:
            for layer in range(layers):
                for head in range(heads):
                    name = PATH_NAMES[int(s.path[layer, head])]
                    expected[layer, head, name] = expected.get((layer, head, name), 0) + 1
                    if int(s.path[layer, head]) == Path.REUSE:
                        reuse_sizes.append(int(s.n_scored[layer, head]))
                    sim = float(s.max_sim[layer, head])
                    if not math.isnan(sim):
                        sims[layer].append(sim)
    samples = scrape(observer.metrics)
    got = {(int(lab["layer"]), int(lab["head"]), lab["path"]): v
           for lab, v in samples["retopk_attention_decisions_total"]}
    assert {lab["model"] for lab, _ in samples["retopk_attention_decisions_total"]} == {"My-Model"}
    assert len(got) == layers * heads * 4  # bounded: layers x heads x 4 ReTopK paths
    for key in got:
        assert got[key] == expected.get(key, 0), key
    assert sum(got.values()) == layers * heads * len(requests) * len(steps)

    # KV group reads per layer: each step's group_read is the plain-loop definition, and the counters add it up
    reads_expected = [0] * layers
    for stats in steps:
        for s in stats:
            loops = group_read_loops(s.path, kv_heads)
            assert s.group_read.tolist() == loops
            for layer in range(layers):
                reads_expected[layer] += sum(loops[layer])
    reads = {int(lab["layer"]): v for lab, v in samples["retopk_kv_group_reads_total"]}
    group_steps = {int(lab["layer"]): v for lab, v in samples["retopk_kv_group_steps_total"]}
    assert reads == dict(enumerate(reads_expected))
    assert group_steps == {layer: kv_heads * len(requests) * len(steps) for layer in range(layers)}
    assert 0 < sum(reads_expected) < layers * kv_heads * len(requests) * len(steps)  # a real mix

    cases = [("retopk_candidate_set_size", reuse_sizes, CANDIDATE_BUCKETS, {})]
    cases += [("retopk_max_query_similarity", sims[layer], SIMILARITY_BUCKETS, {"layer": str(layer)})
              for layer in range(layers)]  # one histogram per layer
    assert {lab["layer"] for lab, _ in samples["retopk_max_query_similarity_count"]} == {str(i) for i in range(layers)}
    for name, values, bounds, labels in cases:
        buckets = {float(lab["le"]): v for lab, v in samples[name + "_bucket"]
                   if all(lab.get(k) == x for k, x in labels.items())}
        for b in bounds:
            assert buckets[b] == sum(1 for x in values if x <= b), (name, b, labels)
        assert buckets[math.inf] == len(values) == value(samples, name + "_count", model="My-Model", **labels)
        assert value(samples, name + "_sum", model="My-Model", **labels) == pytest.approx(sum(values), rel=1e-9)

    last = [int(p) for s in steps[-1] for p in s.path.reshape(-1)]
    share = sum(p in READ_CODES for p in last) / len(last)  # an exact path is one that reads the group
    assert value(samples, "retopk_exact_path_share_ratio", model="My-Model") == pytest.approx(share)
    assert samples["process_resident_memory_bytes"][0][1] > 0  # the process's own metrics, for the dashboard
    # one attention-time observation per step (one method group), labelled by the step's path mix
    assert value(samples, "retopk_attention_step_seconds_count", model="My-Model", path="refresh") == len(steps)


def test_step_path_label_names_the_costliest_path_of_the_mix():
    def label(**counts) -> str:
        per_path = [0] * 8
        for name, n in counts.items():
            per_path[Path[name.upper()]] = n
        return step_path_label(per_path)

    assert label(reuse=9, refresh=1, fallback=5, promoted=3) == "refresh"
    assert label(reuse=9, fallback=1, promoted=3) == "fallback"
    assert label(reuse=9, promoted=1) == "promoted"  # gqa_policy "group" can read a group with no head below tau
    assert label(reuse=9, dense=2) == "reuse" and label(exact=4) == "exact"


def test_attention_time_is_one_observation_per_method_group_and_labelled_by_its_paths():
    observer = MetricsObserver("m")
    reuse = StepStats(torch.zeros(2, 3, dtype=torch.int8), torch.ones(2, 3), torch.full((2, 3), 40, dtype=torch.int32),
                      0.004, num_kv_heads=3)
    fallback_path = torch.zeros(2, 3, dtype=torch.int8)
    fallback_path[1, 2] = Path.FALLBACK
    mixed = StepStats(fallback_path, torch.ones(2, 3), torch.full((2, 3), 40, dtype=torch.int32), 0.004,
                      num_kv_heads=3)
    exact = StepStats(torch.full((2, 3), Path.EXACT, dtype=torch.int8), torch.full((2, 3), float("nan")),
                      torch.full((2, 3), 100, dtype=torch.int32), 0.001, num_kv_heads=3)
    a, b = MethodSpec("retopk"), MethodSpec("exact_topk")
    requests = [SimpleNamespace(method=a), SimpleNamespace(method=a), SimpleNamespace(method=b)]
    observer.on_step(requests, 0.01, StepStatsBatch.of_rows([reuse, reuse, exact]))
    observer.on_step(requests, 0.01, StepStatsBatch.of_rows([reuse, mixed, exact]))
    samples = scrape(observer.metrics)
    for path, n, total in (("reuse", 1, 0.004), ("fallback", 1, 0.004), ("exact", 2, 0.002)):
        assert value(samples, "retopk_attention_step_seconds_count", model="m", path=path) == n
        assert value(samples, "retopk_attention_step_seconds_sum", model="m", path=path) == pytest.approx(total)
    # candidate sizes only from reuse heads: step 1 two rows x 6 heads, step 2 six + five
    assert value(samples, "retopk_candidate_set_size_count", model="m") == 2 * 6 + 6 + 5
    similarity = sum(v for _, v in samples["retopk_max_query_similarity_count"])
    assert similarity == 4 * 6  # NaN rows skipped


async def _run_requests(engine: Engine, specs: list[dict]):
    streams = []
    for i, fields in enumerate(specs):
        stream = RequestStream()
        try:
            engine.submit(GenerationRequest(request_id=f"r{i}", **fields), stream)
        except EngineError as e:
            streams.append(e)
            continue
        streams.append(stream)
    return await asyncio.gather(*(collect(s) for s in streams if isinstance(s, RequestStream)))


def test_engine_with_fake_runner_reports_paths_tokens_latencies_and_load():
    runner = FakeRunner()
    observer = MetricsObserver("fake")
    engine = Engine(lambda: runner, EngineConfig(max_running=4), observer)
    engine.start()
    try:
        specs = [{"text": "hello there", "max_new_tokens": 5, "ignore_eos": True},
                 {"text": "abc", "max_new_tokens": 7, "ignore_eos": True},
                 {"text": "xyz.", "max_new_tokens": 3}]
        results = asyncio.run(_run_requests(engine, specs))
        bad = asyncio.run(_run_requests(engine, [{"chat": [{"role": "robot", "content": "x"}], "max_new_tokens": 2}]))
        session = engine.commands.create_session("named-1", None).result(5)
        assert session.session_id == "named-1"
        samples = scrape(observer.metrics)
    finally:
        engine.stop()
    generated = [sum(len(e.token_ids) for e in events) for events, error in results]
    assert all(error is None for _, error in results)
    assert bad[0][1] is not None and bad[0][1].code.value == "INVALID_ARGUMENT"
    decode_steps = sum(n - 1 for n in generated)  # the first token of each request comes from its prefill
    paths = samples["retopk_attention_decisions_total"]
    # the four ReTopK paths exist from the start at 0 (so rate() works); only "exact" moved here
    assert {lab["path"] for lab, _ in paths} == {"exact", "reuse", "fallback", "refresh", "promoted"}
    assert {lab["path"] for lab, v in paths if v > 0} == {"exact"}
    assert sum(v for _, v in paths) == LAYERS * HEADS * decode_steps
    assert len(paths) == LAYERS * HEADS * 5
    # every head exact: the fake model's one KV group is read on every decode step of every request
    kv_heads = runner.info.num_kv_heads
    for name in ("retopk_kv_group_reads_total", "retopk_kv_group_steps_total"):
        assert {int(lab["layer"]): v for lab, v in samples[name]} == {
            layer: kv_heads * decode_steps for layer in range(LAYERS)}, name
    assert value(samples, "retopk_generation_tokens_total", model="fake") == sum(generated)
    assert value(samples, "retopk_prompt_tokens_total", model="fake") == sum(len(s["text"]) for s in specs)
    assert value(samples, "retopk_time_to_first_token_seconds_count", model="fake") == len(specs)
    assert value(samples, "retopk_time_per_output_token_seconds_count", model="fake") == decode_steps
    assert value(samples, "retopk_e2e_request_seconds_count", model="fake") == len(specs)
    assert value(samples, "retopk_queue_wait_seconds_count", model="fake") == len(specs) + 1
    reasons = {lab["finish_reason"]: v for lab, v in samples["retopk_requests_finished_total"]}
    assert reasons["LENGTH"] == 2 and reasons["EOS_TOKEN"] == 1 and reasons["STOP_SEQUENCE"] == 0
    assert value(samples, "retopk_request_errors_total", model="fake", code="INVALID_ARGUMENT") == 1
    assert value(samples, "retopk_decode_step_seconds_count", model="fake") >= max(generated) - 1
    assert value(samples, "retopk_sessions_open", model="fake", kind="named") == 1
    assert value(samples, "retopk_sessions_open", model="fake", kind="ephemeral") == 0
    assert value(samples, "retopk_requests_running", model="fake") == 0
    assert value(samples, "retopk_model_info", model="fake", layers=LAYERS, heads=HEADS) == 1
    # the named session holds its method state (FakeRunner: 32 bytes) and no KV yet
    assert value(samples, "retopk_query_cache_bytes", model="fake", kind="used") == 32
    assert value(samples, "retopk_kv_cache_bytes", model="fake", kind="used") == 0



def test_router_load_gauges_follow_the_engines_load_and_the_kv_pool():
    """requests waiting / running and the KV utilisation (used / reserved pool bytes, 0..1) that a picker scores."""
    from retopk_server.runtime.memory import MemoryUsage

    usage = [MemoryUsage()]
    observer = MetricsObserver("m", per_head=False, memory_interval_s=0.0)
    info = SimpleNamespace(architecture="A", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, device="cpu",
                           backend="torch", default_method=SimpleNamespace(name="full"), weight_format="int4",
                           kv_dtype="bfloat16")
    observer.on_start(info, lambda: usage[0])
    observer.on_load(0, 0, 0)
    samples = scrape(observer.metrics)
    assert value(samples, "retopk_kv_cache_utilization_ratio", model="m") == 0  # nothing reserved yet
    usage[0] = MemoryUsage(kv_used=3 * 1024, kv_reserved=4 * 1024)
    observer.on_load(5, 2, 1)
    samples = scrape(observer.metrics)
    assert value(samples, "retopk_requests_waiting", model="m") == 5
    assert value(samples, "retopk_requests_running", model="m") == 2
    assert value(samples, "retopk_kv_cache_utilization_ratio", model="m") == 0.75
    assert value(samples, "retopk_kv_cache_bytes", model="m", kind="reserved") == 4 * 1024

def test_sessions_opened_or_closed_while_busy_update_the_cache_sizes_when_the_load_ends():
    """Idle (a command), a session's open or close re-reads the runner's cache sizes at once; while the engine has
    work, its on_load after the step does: within memory_interval_s, and at once when the step left no work."""
    from retopk_server.runtime.memory import MemoryUsage

    usage, reads = [MemoryUsage(kv_used=1024, kv_reserved=4096)], []

    def memory():
        reads.append(usage[0])
        return usage[0]

    observer = MetricsObserver("m", per_head=False, memory_interval_s=3600.0)
    observer.on_start(SimpleNamespace(architecture="A", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4,
                                      device="cpu", backend="torch", default_method=SimpleNamespace(name="full"),
                                      weight_format="int4", kv_dtype="bfloat16"), memory)

    def kv_used() -> float:
        return value(scrape(observer.metrics), "retopk_kv_cache_bytes", model="m", kind="used")

    observer.on_session_opened("a", False)  # idle: read at once
    assert len(reads) == 1 and kv_used() == 1024
    observer.on_load(0, 2, 1)  # busy now (the first on_load reads: no read yet)
    assert len(reads) == 2
    usage[0] = MemoryUsage(kv_used=3072, kv_reserved=4096)
    for i in range(4):
        observer.on_session_opened(f"e{i}", True)
        observer.on_session_closed(f"e{i}", True)
    observer.on_load(3, 2, 1)  # still busy, the interval not passed
    assert len(reads) == 2 and kv_used() == 1024
    assert value(scrape(observer.metrics), "retopk_sessions_open", model="m", kind="ephemeral") == 0
    observer.on_load(0, 0, 1)  # the load ended: the sessions' change is read now
    assert len(reads) == 3 and kv_used() == 3072
    observer.on_load(0, 0, 1)  # nothing changed since: no read
    assert len(reads) == 3
    usage[0] = MemoryUsage(kv_used=0, kv_reserved=4096)
    observer.on_session_closed("a", False)  # idle again: at once
    assert len(reads) == 4 and kv_used() == 0


def test_per_layer_and_per_head_series_exist_at_zero_from_startup():
    observer = MetricsObserver("m")
    runner = FakeRunner()
    observer.on_start(runner.info, runner.memory)
    samples = scrape(observer.metrics)
    for name in ("retopk_kv_group_reads_total", "retopk_kv_group_steps_total"):
        assert sorted((int(lab["layer"]), v) for lab, v in samples[name]) == [(layer, 0.0) for layer in range(LAYERS)]
    decisions = samples["retopk_attention_decisions_total"]
    assert {lab["path"] for lab, _ in decisions} == {"reuse", "fallback", "refresh", "promoted"}
    assert len(decisions) == LAYERS * HEADS * 4 and not any(v for _, v in decisions)


def test_every_metric_has_the_prefix_and_a_model_label():
    observer = MetricsObserver("m")
    observer.on_step([SimpleNamespace(method=None)], 0.001,
                     StepStatsBatch.of_rows([StepStats(torch.zeros(1, 1, dtype=torch.int8), torch.ones(1, 1),
                                                       torch.ones(1, 1, dtype=torch.int32), num_kv_heads=1)]))
    observer.on_rpc("Generate", "OK", 0.1)
    families = list(text_string_to_metric_families(generate_latest(observer.metrics.registry).decode()))
    assert len(families) >= 20
    for family in families:
        if family.name.startswith("process_"):  # the process's own (prometheus_client's standard names)
            continue
        assert family.name.startswith("retopk_"), family.name
        for s in family.samples:
            assert s.labels.get("model") == "m", (s.name, s.labels)


def test_exporter_serves_the_registry_over_http():
    observer = MetricsObserver("m")
    observer.on_rpc("Tokenize", "OK", 0.01)
    server = MetricsServer(observer.metrics.registry, port=0, host="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.close()
    assert 'retopk_rpcs_total{code="OK",model="m",rpc="Tokenize"} 1.0' in text


def test_create_observer_serves_on_the_configured_port_and_names_the_field_when_it_is_taken():
    assert create_observer(ServerConfig(host="127.0.0.1", metrics_port=0)).exporter is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="metrics_port"):
            create_observer(ServerConfig(host="127.0.0.1", metrics_port=port))
    observer = create_observer(ServerConfig(host="127.0.0.1", metrics_port=port))
    try:
        assert observer.exporter.port == port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert b"retopk_requests_running" in response.read()
    finally:
        observer.exporter.close()


def test_per_head_off_asks_for_no_stats_and_ignores_stats_a_client_asked_for():
    """metrics_per_head=false: no per-step statistics requested, and none recorded when a client's own
    return_step_stats request makes the engine compute them for a batch."""
    gen = torch.Generator().manual_seed(1)
    on = create_observer(ServerConfig(host="127.0.0.1", metrics_port=0))
    off = create_observer(ServerConfig(host="127.0.0.1", metrics_port=0, metrics_per_head=False))
    assert on.wants_step_stats and not off.wants_step_stats
    runner = FakeRunner()
    requests = [SimpleNamespace(method=MethodSpec("retopk"))]
    for observer in (on, off):
        observer.on_start(runner.info, runner.memory)
        observer.on_step(requests, 0.01, StepStatsBatch.of_rows([random_stats(gen, LAYERS, HEADS)]))
    got_on, got_off = scrape(on.metrics), scrape(off.metrics)
    assert sum(v for _, v in got_on["retopk_attention_decisions_total"]) == LAYERS * HEADS
    assert "retopk_attention_decisions_total" not in got_off
    assert "retopk_candidate_set_size_count" not in got_off
    assert "retopk_kv_group_reads_total" not in got_off and "retopk_kv_group_steps_total" not in got_off
    assert sum(v for _, v in got_on["retopk_kv_group_steps_total"]) == LAYERS * runner.info.num_kv_heads
    for samples in (got_on, got_off):  # the step itself is still timed
        assert value(samples, "retopk_decode_step_seconds_count", model=on.model) == 1
