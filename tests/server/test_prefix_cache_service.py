"""The prefix cache through the real service and engine, on a tiny real model (runtime_helpers): who shares
cached blocks (one API key; a salt; every key with --prefix-cache-shared), what usage reports, the server
options, and the order in which memory comes back under the budget (idle cached blocks before idle sessions,
blocks in use never)."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.metrics import MAX_KEY_LABELS, Metrics, MetricsObserver
from retopk_server.runtime.memory import MemoryUsage
from tests.server.fake_runner import FakeTokenizer
from tests.server.runtime.runtime_helpers import prompt_ids, runner_for, tiny_model
from tests.server.test_tenancy import auth, line

pytestmark = pytest.mark.timeout(120)

DOC = prompt_ids(40, seed=11)
OTHER = prompt_ids(40, seed=12)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture
def server(fake_server, tmp_path, model):
    """A server on a real runner (blocks and chunks of 4) with alice and bob in a keys file."""
    path = tmp_path / "keys.txt"
    path.write_text(line("alice") + "\n" + line("bob") + "\n")

    def make(prefix_cache: bool = True, **overrides):
        runner = runner_for(model, kv_block_size=4, prefill_chunk=4, prefix_cache=prefix_cache,
                            kv_cache_bytes=overrides.pop("kv_cache_bytes", None))
        runner.tokenizer = FakeTokenizer()  # token ids in, characters out: the tiny model has no tokenizer
        return fake_server(runner, api_keys_file=str(path), **overrides)

    return make


def usage(server, who: str, ids: list[int], salt: str | None = None, **fields) -> pb.Usage:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=2, **fields)
    if salt is not None:
        request.cache_salt = salt
    return list(server.stub.Generate(request, metadata=auth(who)))[-1].usage


def test_one_keys_prefix_is_not_anothers(server):
    s = server()
    first = usage(s, "alice", DOC)
    assert (first.prompt_tokens, first.cached_prompt_tokens) == (40, 0)
    asked = DOC[:24] + OTHER[:6]  # 6 shared blocks; Full attention leaves only the last token to the prefill
    assert usage(s, "bob", asked).cached_prompt_tokens == 0
    assert usage(s, "alice", asked, salt="s1").cached_prompt_tokens == 0
    assert usage(s, "alice", asked).cached_prompt_tokens == 24
    assert usage(s, "alice", asked, salt="s1").cached_prompt_tokens == 28  # its own 7 full blocks, cached now


def test_global_sharing_crosses_keys_but_not_salts(server):
    s = server(prefix_cache_shared=True)
    usage(s, "alice", DOC)
    asked = DOC[:24] + OTHER[:6]
    assert usage(s, "bob", asked, salt="secret").cached_prompt_tokens == 0
    assert usage(s, "bob", asked).cached_prompt_tokens == 24


def test_the_cache_can_be_turned_off(server):
    s = server(prefix_cache=False)
    usage(s, "alice", DOC)
    assert usage(s, "alice", DOC).cached_prompt_tokens == 0
    assert s.runner.prefix_cache is None


def test_a_named_sessions_first_turn_hits_and_its_later_turns_keep_their_own_cache(server):
    s = server()
    usage(s, "alice", DOC)
    s.stub.CreateSession(pb.CreateSessionRequest(session_id="chat"), metadata=auth("alice"))
    assert usage(s, "alice", DOC[:30], session_id="chat").cached_prompt_tokens == 28
    assert usage(s, "alice", OTHER[:8], session_id="chat").cached_prompt_tokens == 0


def test_n_choices_report_the_prompts_cached_tokens_in_each(server):
    s = server()
    usage(s, "alice", DOC)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=DOC[:20] + OTHER[:3]), max_new_tokens=2, n=3)
    finals = [r for r in s.stub.Generate(request, metadata=auth("alice")) if r.HasField("usage")]
    assert sorted(r.usage.cached_prompt_tokens for r in finals) == [20, 20, 20]


def test_a_salt_longer_than_the_limit_is_invalid(server):
    s = server()
    limit = s.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth("alice")).limits.max_cache_salt_chars
    assert limit == 256
    usage(s, "alice", DOC[:5], salt="x" * limit)
    with pytest.raises(grpc.RpcError) as e:
        usage(s, "alice", DOC[:5], salt="x" * (limit + 1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("cache_salt:")


def test_idle_cached_blocks_go_before_an_idle_session_and_blocks_in_use_stay(server, model):
    block = runner_for(model, kv_block_size=4).pool.block_nbytes
    s = server(kv_cache_bytes=12 * block)  # 12 blocks in all (the full method has no state)
    s.stub.CreateSession(pb.CreateSessionRequest(session_id="keep"), metadata=auth("alice"))
    usage(s, "alice", OTHER[:16], session_id="keep")  # 5 blocks, its first 4 cached too
    usage(s, "bob", DOC[:24])  # its 6 blocks stay in the cache, idle, once the request is over
    cache = s.runner.prefix_cache
    assert (len(cache), cache.idle_blocks, s.runner.pool.capacity) == (10, 6, 12)
    # 6 blocks: one is free, five idle cached blocks must go; the idle session must not
    assert usage(s, "bob", prompt_ids(22, seed=13)).prompt_tokens == 22
    assert s.engine.sessions.evictions == 0
    kept = s.stub.GetSession(pb.GetSessionRequest(session_id="keep"), metadata=auth("alice"))
    assert (kept.num_tokens, kept.kv_bytes) == (18, 5 * block)  # its prompt, 2 tokens generated; every block
    # the blocks the session holds stayed cached: alice's prompt still finds them
    assert usage(s, "alice", OTHER[:16] + DOC[:2]).cached_prompt_tokens == 16


def by(owner: str) -> SimpleNamespace:
    """A request as the observer sees it: its spec names the caller's key (service/auth.py)."""
    return SimpleNamespace(spec=SimpleNamespace(owner=owner))


def test_the_per_key_counters_label_at_most_max_key_labels_names():
    """Key names label the per-key counters up to MAX_KEY_LABELS; the names after share "other", so a deployment
    with many keys keeps a bounded number of series. The anonymous owner (no keys configured) is "anonymous"."""
    observer = MetricsObserver("m", Metrics())
    names = [f"k{i}" for i in range(MAX_KEY_LABELS + 5)]
    for name in ["", *names]:
        observer.on_prefix_lookup(by(name), 10, 4)
    value = observer.metrics.registry.get_sample_value
    assert value("retopk_prefix_cache_key_hit_tokens_total", {"model": "m", "key": "anonymous"}) == 4
    assert value("retopk_prefix_cache_key_hit_tokens_total", {"model": "m", "key": names[MAX_KEY_LABELS - 2]}) == 4
    assert value("retopk_prefix_cache_key_hit_tokens_total", {"model": "m", "key": names[MAX_KEY_LABELS - 1]}) is None
    assert value("retopk_prefix_cache_key_lookup_tokens_total", {"model": "m", "key": "other"}) == 6 * 10
    series = {s.labels["key"] for metric in observer.metrics.registry.collect() for s in metric.samples
              if s.name == "retopk_prefix_cache_key_hit_tokens_total"}
    assert len(series) == MAX_KEY_LABELS + 1


def test_the_metrics_count_lookups_hits_and_cached_blocks():
    observer = MetricsObserver("m", Metrics())
    info = SimpleNamespace(architecture="A", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, device="cpu",
                           backend="torch", default_method=SimpleNamespace(name="full"), weight_format="",
                           kv_dtype="")
    observer.on_start(info, lambda: MemoryUsage(prefix_cache_blocks=3, prefix_cache_bytes=3072,
                                                prefix_cache_idle_bytes=1024))
    observer.on_prefix_lookup(by("alice"), 40, 24)
    observer.on_prefix_lookup(by("bob"), 30, 0)
    observer.on_load(0, 0, 0)
    value = observer.metrics.registry.get_sample_value
    assert value("retopk_prefix_cache_lookup_tokens_total", {"model": "m"}) == 70
    assert value("retopk_prefix_cache_hit_tokens_total", {"model": "m"}) == 24
    for key, lookup, hits in (("alice", 40, 24), ("bob", 30, 0)):
        assert value("retopk_prefix_cache_key_lookup_tokens_total", {"model": "m", "key": key}) == lookup
        assert value("retopk_prefix_cache_key_hit_tokens_total", {"model": "m", "key": key}) == hits
    assert value("retopk_prefix_cache_blocks", {"model": "m"}) == 3
    assert value("retopk_prefix_cache_bytes", {"model": "m", "kind": "held"}) == 3072
    assert value("retopk_prefix_cache_bytes", {"model": "m", "kind": "idle"}) == 1024
