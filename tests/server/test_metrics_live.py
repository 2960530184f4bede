"""The metrics of a real `retopk-server` (embedded model, ReTopK) read over HTTP, by Prometheus' own
text parser and by a real Prometheus server.

One server process with its exporter on a free port serves the whole module. Requests ask for their
per-step statistics in the stream, so the path counts the exporter reports are checked against an
independent record: the paths the stream itself carried, summed per (layer, head, path), and likewise
the KV group reads per layer. The server's ReTopK runs gqa_policy "promote", so promoted heads can occur.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from retopk_client.types import PATH_NAMES
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from tests._live_server import free_port, launch_server, served_weight_format

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "docker" / "grafana" / "dashboards" / "retopk.json"
RETOPK_PATHS = {"reuse", "fallback", "refresh", "promoted"}
PROMPT = ("The river ran past the old mill and the miller counted the sacks of grain one by one, "
          "while the children watched the water turn the great wooden wheel.")
MAX_NEW = 6


class Live:
    def __init__(self, server, metrics_port: int) -> None:
        self.server, self.metrics_port = server, metrics_port
        self.channel = grpc.insecure_channel(server.address)
        self.stub = pb_grpc.ReTopKServiceStub(self.channel)

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            return response.read().decode()

    def samples(self) -> dict[str, list]:
        out: dict[str, list] = {}
        for family in text_string_to_metric_families(self.scrape()):
            for s in family.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
        return out

    def generate(self, **fields) -> list:
        return list(self.stub.Generate(pb.GenerateRequest(**fields), timeout=300))


@pytest.fixture(scope="module")
def live():
    metrics_port = free_port()
    # Small K and T_r so that a short prompt and a few steps take reuse, fallback and refresh.
    server = launch_server("--metrics-port", str(metrics_port), "--method", "retopk",
                           "--method-params",
                           "top_k=16,window=4,cache_size=4,recall=2,refresh_every=3,gqa_policy=promote",
                           "--max-running", "4")
    live = Live(server, metrics_port)
    try:
        yield live
    finally:
        live.channel.close()
        server.stop()


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def wait_for(predicate, timeout: float = 20.0):
    """The engine records a request's finish just after streaming its last message; poll briefly."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.1)


@pytest.fixture(scope="module")
def prometheus(live):
    """A real Prometheus scraping the exporter every second, started before the requests so that it
    watches them (None when the binary is missing; only the test that needs it skips)."""
    if shutil.which("prometheus") is None:
        yield None
        return
    prom = Prometheus(f"127.0.0.1:{live.metrics_port}")
    try:
        prom.wait_query('up{job="retopk"}', lambda r: bool(r) and r[0]["value"][1] == "1")
        yield prom
    finally:
        prom.close()


@pytest.fixture(scope="module")
def driven(live, prometheus):
    """Two concurrent ReTopK requests with per-step stats, one bad request; the stream's own path record."""
    before = live.samples()
    info = live.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    results: list = [None, None]

    def run(i: int) -> None:
        results[i] = live.generate(text=f"{PROMPT} ({i})", max_new_tokens=MAX_NEW, ignore_eos=True,
                                   return_step_stats=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    with pytest.raises(grpc.RpcError) as bad:
        live.generate(token_ids=pb.TokenIds(ids=[10 ** 8]), max_new_tokens=2)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stream_paths: Counter = Counter()
    stream_reads: Counter = Counter()  # layer -> KV groups the streams reported read in full
    decode_steps = generated = 0
    for responses in results:
        assert responses is not None and responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        generated += responses[-1].usage.generated_tokens
        for r in responses:
            for st in r.step_stats:
                decode_steps += 1
                for i, code in enumerate(st.path):
                    stream_paths[i // st.num_heads, i % st.num_heads, PATH_NAMES[code]] += 1
                assert st.num_kv_heads == info.num_kv_heads and len(st.group_read) == st.num_layers * st.num_kv_heads
                for i, read in enumerate(st.group_read):
                    stream_reads[i // st.num_kv_heads] += read

    def both_recorded():
        s = live.samples()
        done = (total(s, "retopk_e2e_request_seconds_count") >= 2
                and total(s, "retopk_request_errors_total", code="INVALID_ARGUMENT") >= 1)
        return s if done else None

    after = wait_for(both_recorded)
    assert after is not None, "the exporter never reported both requests finished"
    return Driven(info, before, after, stream_paths, stream_reads, decode_steps, generated)


@dataclass
class Driven:
    info: pb.ModelInfo
    before: dict  # samples before the requests
    after: dict  # samples after them
    stream_paths: Counter  # (layer, head, path name) -> decisions the streams reported
    stream_reads: Counter  # layer -> KV groups read in full, as the streams reported
    decode_steps: int
    generated: int


def test_path_counts_per_layer_and_head_add_up_and_histograms_moved(driven):
    info, after = driven.info, driven.after
    layers, heads = info.num_layers, info.num_heads
    assert driven.decode_steps == 2 * (MAX_NEW - 1)  # every token but the first (from prefill) is a decode step
    decisions = after["retopk_attention_decisions_total"]
    assert {lab["model"] for lab, _ in decisions} == {"smollm2-135m"}
    counts = {(int(lab["layer"]), int(lab["head"]), lab["path"]): v for lab, v in decisions}
    assert {p for _, _, p in counts} == RETOPK_PATHS
    assert len(counts) == layers * heads * 4  # bounded: layers x heads x 4 ReTopK paths
    # every head decides once per decode step: the counts add up to layers x heads x decode steps
    assert sum(counts.values()) == layers * heads * driven.decode_steps
    for layer in range(layers):
        for head in range(heads):
            assert sum(counts[layer, head, p] for p in RETOPK_PATHS) == driven.decode_steps
    # ... and match, per (layer, head, path), what the streams reported step by step
    for key, n in counts.items():
        assert n == driven.stream_paths.get(key, 0), key
    assert all(driven.stream_paths[k] > 0 for k in driven.stream_paths)

    moved = {name: total(after, name) - total(driven.before, name) for name in (
        "retopk_time_to_first_token_seconds_count", "retopk_time_per_output_token_seconds_count",
        "retopk_e2e_request_seconds_count", "retopk_queue_wait_seconds_count", "retopk_prefill_seconds_count",
        "retopk_decode_step_seconds_count", "retopk_attention_step_seconds_count",
        "retopk_candidate_set_size_count", "retopk_max_query_similarity_count", "retopk_generation_tokens_total",
        "retopk_prompt_tokens_total")}
    assert moved["retopk_time_to_first_token_seconds_count"] == 2
    assert moved["retopk_e2e_request_seconds_count"] == 2
    assert moved["retopk_prefill_seconds_count"] == 2
    assert moved["retopk_queue_wait_seconds_count"] == 2  # the bad request never reached the queue
    assert moved["retopk_time_per_output_token_seconds_count"] == driven.decode_steps
    assert moved["retopk_generation_tokens_total"] == driven.generated == 2 * MAX_NEW
    assert moved["retopk_prompt_tokens_total"] > 2 * 20
    assert moved["retopk_decode_step_seconds_count"] >= MAX_NEW - 1
    assert moved["retopk_attention_step_seconds_count"] >= MAX_NEW - 1
    reuse = sum(v for (_, _, p), v in counts.items() if p == "reuse")
    assert moved["retopk_candidate_set_size_count"] == reuse  # one candidate-set size per reusing head
    assert moved["retopk_max_query_similarity_count"] > 0
    assert total(after, "retopk_requests_finished_total", finish_reason="LENGTH") == 2
    assert total(after, "retopk_request_errors_total", code="INVALID_ARGUMENT") >= 1
    assert total(after, "retopk_kv_cache_bytes", kind="reserved") > 0
    assert total(after, "retopk_query_cache_bytes", kind="reserved") > 0
    assert total(after, "retopk_model_info", layers=str(layers), heads=str(heads)) == 1
    assert total(after, "retopk_model_info", weight_format=served_weight_format(), kv_dtype="float16") == 1


def test_kv_group_read_counters_add_up_and_match_the_streams(driven):
    """Per layer: steps = KV groups x decode steps (of both requests), reads = what the streams' group_read
    said; a read group holds 1..G full-read heads, which bounds the total reads by the head counts."""
    info, after = driven.info, driven.after
    layers, kv_heads = info.num_layers, info.num_kv_heads
    reads = {int(lab["layer"]): v for lab, v in after["retopk_kv_group_reads_total"]}
    steps = {int(lab["layer"]): v for lab, v in after["retopk_kv_group_steps_total"]}
    assert steps == {layer: kv_heads * driven.decode_steps for layer in range(layers)}
    assert reads == {layer: driven.stream_reads[layer] for layer in range(layers)}
    full_heads = sum(n for (_, _, p), n in driven.stream_paths.items() if p != "reuse")
    group = info.num_heads // kv_heads
    assert -(-full_heads // group) <= sum(reads.values()) <= min(full_heads, sum(steps.values()))
    assert sum(reads.values()) > 0  # refresh_every=3: every group is read on a refresh step


# ---- the dashboard against the live exposition --------------------------------------------------------
METRIC_NAME = re.compile(r"\bretopk_[A-Za-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL string of the dashboard: panel targets (rows included) and query variables."""
    found: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    found.append(value)
                elif key == "definition" and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard)
    return found


def exported_names(text: str) -> set[str]:
    """Sample names of the exposition, plus each histogram's base name with its suffixes considered."""
    names = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            names.add(s.name)
    return names


def test_every_dashboard_query_refers_only_to_exported_metrics(live, driven):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20
    exported = exported_names(live.scrape())
    used = {name for q in queries for name in METRIC_NAME.findall(q)}
    assert used, "the dashboard queries no retopk_ metric"
    used |= {"process_resident_memory_bytes"} & {n for q in queries for n in q.replace("(", " ").split()}
    missing = sorted(n for n in used if n not in exported)
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
    # the panels the issue asks for are there
    titles = " | ".join(p.get("title", "") for p in dashboard["panels"]).lower()
    for words in ("request rate", "errors", "time to first token", "time per output token", "end-to-end",
                  "waiting", "sessions", "cache memory", "resident memory", "tokens per second",
                  "reuse rate, layer x head", "similarity by layer",
                  "exact-path share, layer x head", "candidate-set size", "similarity", "group-read rate",
                  "group-read rate by layer"):
        assert words in titles, words


# ---- a real Prometheus scraping the server ------------------------------------------------------------
# The per-head reuse rate of the dashboard, over a window that covers the whole test.
REUSE_RATE = ('sum by (layer, head) (rate(retopk_attention_decisions_total{path="reuse"}[10m]))'
              ' / sum by (layer, head) (rate(retopk_attention_decisions_total[10m]))')


def grafana_to_promql(expr: str) -> str:
    """The dashboard's Grafana variables replaced by what Grafana would send for "All", 1-minute windows."""
    return (expr.replace("$__rate_interval", "1m").replace("$__range", "5m").replace("$model", ".*"))


class Prometheus:
    def __init__(self, target: str) -> None:
        binary = shutil.which("prometheus")
        self.dir = tempfile.TemporaryDirectory(prefix="retopk-prom-")
        config = Path(self.dir.name) / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                          "scrape_configs:\n  - job_name: retopk\n    static_configs:\n"
                          f"      - targets: ['{target}']\n")
        self.port = free_port()
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={Path(self.dir.name) / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def query(self, expr: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:  # 400 / 422: a bad expression, with Prometheus' error in the body
            return json.loads(e.read())

    def wait_query(self, expr: str, ok, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.process.stderr.read()}")
            try:
                last = self.query(expr)
                if last.get("status") == "success" and ok(last["data"]["result"]):
                    return last["data"]["result"]
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"{expr!r} gave no acceptable answer within {timeout} s; last: {last}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.dir.cleanup()


def test_prometheus_scrapes_the_server_and_answers_the_reuse_rate(prometheus, driven):
    if prometheus is None:
        pytest.skip("needs the `prometheus` binary (Debian package prometheus; scripts/install_system_deps.sh)")
    time.sleep(2.5)  # two more scrapes after the last request
    layers, heads = driven.info.num_layers, driven.info.num_heads
    result = prometheus.wait_query(REUSE_RATE, lambda r: len(r) == layers * heads)
    values = [float(r["value"][1]) for r in result]
    assert all(0.0 <= v <= 1.0 for v in values), values
    assert any(v > 0 for v in values)
    overall = prometheus.query('sum(retopk_attention_decisions_total{path="reuse"}) / '
                               "sum(retopk_attention_decisions_total)")["data"]["result"]
    reuse = sum(n for (_, _, p), n in driven.stream_paths.items() if p == "reuse")
    assert float(overall[0]["value"][1]) == pytest.approx(reuse / sum(driven.stream_paths.values()))
    # every dashboard query parses and evaluates in Prometheus
    for expr in dashboard_queries(json.loads(DASHBOARD.read_text())):
        if expr.startswith("label_values("):
            metric = expr[len("label_values("):].split(",")[0]
            assert prometheus.query(metric)["data"]["result"], expr
            continue
        answer = prometheus.query(grafana_to_promql(expr))
        assert answer.get("status") == "success", (expr, answer)



def test_rpc_statuses_count_what_the_client_received(live):
    """retopk_rpcs_total{rpc, code} counts the status each client got: a complete() that read its last response
    is OK (it closes the stream then), a passed deadline is DEADLINE_EXCEEDED (gRPC cancels the handler then as
    it does when a client goes away), a client that goes away mid-stream is CANCELLED; every label is a gRPC
    status name."""
    from retopk_client import Client

    def count(code: str, rpc: str = "Generate") -> float:
        return total(live.samples(), "retopk_rpcs_total", rpc=rpc, code=code)

    received: Counter = Counter()
    before = {code.name: count(code.name) for code in grpc.StatusCode}
    with Client(live.server.address, timeout=300) as client:
        for _ in range(2):
            completion = client.complete(PROMPT, max_new_tokens=2, temperature=0)
            assert completion.usage.generated_tokens == 2
            received["OK"] += 1
    for _ in range(2):  # 3 s: long enough for a busy server to start the rpc (one it never saw, it cannot count)
        with pytest.raises(grpc.RpcError) as e:
            list(live.stub.Generate(pb.GenerateRequest(text=PROMPT, max_new_tokens=2000, ignore_eos=True),
                                    timeout=3.0))
        received[e.value.code().name] += 1
    call = live.stub.Generate(pb.GenerateRequest(text=PROMPT, max_new_tokens=2000, ignore_eos=True), timeout=300)
    next(call)
    call.cancel()
    received["CANCELLED"] += 1
    with pytest.raises(grpc.RpcError) as e:
        live.generate(text="")
    received[e.value.code().name] += 1
    assert received == {"OK": 2, "DEADLINE_EXCEEDED": 2, "CANCELLED": 1, "INVALID_ARGUMENT": 1}

    def deltas():
        return {code: count(code) - before[code] for code in before if count(code) != before[code]}

    wait_for(lambda: deltas() == dict(received), timeout=30)
    assert deltas() == dict(received), (deltas(), received)
    names = {s.name for s in grpc.StatusCode}
    assert {labels["code"] for labels, _ in live.samples()["retopk_rpcs_total"]} <= names
    with pytest.raises(grpc.RpcError) as e:
        live.stub.GetSession(pb.GetSessionRequest(session_id="nobody"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert wait_for(lambda: count("NOT_FOUND", "GetSession") == 1)
