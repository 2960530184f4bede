"""Acceptance of the multi-replica deployment: three real `retopk-server` processes (the embedded
SmolLM2-135M) behind Debian's nginx running docker/nginx/routing.conf and grpc-proxy.conf unchanged,
from a temporary prefix (pid, logs and temp paths there; nothing needs root), loopback only.

- 20 sessions x 3 chat turns through nginx with the SDK: every request of a session reaches one
  replica (nginx's access log names the upstream of each request; the session lives on that replica
  only), and each later turn prefills only its new tokens (usage), never the conversation again.
- Requests without a session carry no x-session-id and spread over every replica; those naming a shared
  prompt start with x-prefix-key all reach one replica, whose prefix cache serves that start.
- One replica killed (SIGKILL) after turn 2: its sessions answer NOT_FOUND through nginx (the next
  replica on the hash ring does not hold them), the SDK's replay (Session(replay=True)) continues each
  of them in a new session on a live replica with the whole conversation, and every other session's
  third turn runs in place, prefilling only its new tokens.

Runs in `make test-full` (marker `full`); skips where no nginx binary exists (scripts/install_system_deps.sh
installs it).
"""

from __future__ import annotations

import random
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from retopk_client import Client, NotFound, RetryPolicy
from retopk_client.client import Session
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from tests.deploy.nginx_cluster import access_log, holder, logged_since, nginx_cluster

pytestmark = [pytest.mark.slow, pytest.mark.full, pytest.mark.timeout(900)]

REPLICAS, SESSIONS, TURNS, SESSIONLESS = 3, 20, 3, 12
NEW_TOKENS = 3


@pytest.fixture(scope="module")
def cluster():
    with nginx_cluster(REPLICAS, "--max-running", "8") as c:
        yield c.servers, c.router, c.prefix


def turn(session: Session, k: int, i: int):
    message = {"role": "user", "content": f"Session {i}, turn {k}: name a colour."}
    return session.complete(messages=[message], max_new_tokens=NEW_TOKENS, ignore_eos=True)


def test_requests_naming_a_prefix_key_reach_the_replica_that_caches_it(cluster):
    """x-prefix-key (routing.conf): every request naming the key lands on one replica, whose prefix cache then
    serves the shared 600-token start to all but the first; the same requests without the key spread over the
    replicas (least_conn) and each replica's first one prefills the start again."""
    _, router, _ = cluster
    rng = random.Random(30)

    def cached(document: list[int], i: int, key: str | None) -> int:
        ids = document + [rng.randrange(100, 40000) for _ in range(100)]
        metadata = (("x-prefix-key", key),) if key else ()
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=1)
        return list(stub.Generate(request, metadata=metadata, timeout=300))[-1].usage.cached_prompt_tokens

    with grpc.insecure_channel(router) as channel:
        stub = pb_grpc.ReTopKServiceStub(channel)
        keyed, spread = ([rng.randrange(100, 40000) for _ in range(600)] for _ in range(2))
        # two blocks of 256 = one prefill chunk; the default method prefills its last 128 tokens in any case
        assert [cached(keyed, i, "doc-1") for i in range(5)] == [0, 512, 512, 512, 512]
        assert [cached(spread, i, None) for i in range(5)].count(0) >= 2


def test_sessions_stick_to_one_replica_spread_sessionless_and_survive_a_killed_replica(cluster):
    servers, router, prefix = cluster
    by_address = {s.address: i for i, s in enumerate(servers)}
    client = Client(router, timeout=120, retry=RetryPolicy(max_attempts=3, initial_backoff=0.05))
    pool = ThreadPoolExecutor(8)
    try:
        sessions = [client.session(method="full", replay=True) for _ in range(SESSIONS)]
        first_ids = [s.id for s in sessions]
        usages = defaultdict(list)

        # turns 1 and 2 of every session, concurrently
        for k in (1, 2):
            for i, done in enumerate(pool.map(lambda a, k=k: turn(sessions[a], k, a), range(SESSIONS))):
                usages[i].append(done.usage)
        homes = {}
        for i, s in enumerate(sessions):
            [homes[i]] = holder(servers, s.id)  # on exactly one replica
        assert len(set(homes.values())) >= 2, f"20 sessions all hashed onto one replica: {homes}"

        # sessionless requests: no x-session-id, least-connected over every replica
        mark = len(access_log(prefix))
        outs = list(pool.map(lambda j: client.complete(f"Count to {j}:", max_new_tokens=2, ignore_eos=True),
                             range(SESSIONLESS)))
        assert all(o.usage.generated_tokens == 2 and not o.session_id for o in outs)
        sessionless = logged_since(prefix, mark, "Generate", SESSIONLESS)
        assert len(sessionless) == SESSIONLESS and all(e[0] in ("", "-") for e in sessionless)  # nginx logs "-"
        assert {by_address[e[1]] for e in sessionless} == set(range(REPLICAS))

        # one replica dies between turns 2 and 3
        victim = max(set(homes.values()), key=lambda r: sum(h == r for h in homes.values()))
        lost = [i for i, h in homes.items() if h == victim]
        kept = [i for i in range(SESSIONS) if i not in lost]
        servers[victim].process.kill()
        servers[victim].process.wait(30)
        for i in lost:  # a clear status through the router: the replica that answers does not hold it
            with pytest.raises(NotFound, match="session"):
                client.get_session(sessions[i].id)
        for i, done in enumerate(pool.map(lambda a: turn(sessions[a], 3, a), range(SESSIONS))):
            usages[i].append(done.usage)
    finally:
        pool.shutdown()

    # every session's requests before the kill went to the one replica that holds it
    upstreams = defaultdict(set)
    for key, upstream, status, _ in access_log(prefix):
        if key in first_ids and status == "200":
            upstreams[key].add(upstream.split(", ")[-1])
    for i, sid in enumerate(first_ids):
        if i in kept:
            assert upstreams[sid] == {servers[homes[i]].address}, (i, upstreams[sid])
        else:
            assert servers[homes[i]].address in upstreams[sid]

    for i in kept:  # untouched: same session, same replica, three turns, only new tokens prefilled
        s = sessions[i]
        assert s.replays == 0 and s.id == first_ids[i]
        assert holder(servers, s.id) == [homes[i]]
        assert client.get_session(s.id).turns == TURNS
        for before, now in zip(usages[i], usages[i][1:], strict=False):
            new = now.session_tokens - now.generated_tokens - before.session_tokens  # this turn's own tokens
            # A sampled reply cut at NEW_TOKENS tokens may render back into other tokens (two pieces of a word
            # that the tokenizer merges, a character split across tokens): the session then rewinds to the
            # common prefix and feeds the rest of that reply again (engine/turn.py, ActiveRequest.feed).
            assert new <= now.prompt_tokens <= new + before.generated_tokens, (i, before, now)
            assert now.prompt_tokens < before.session_tokens  # the history was not fed again
    for i in lost:  # replayed once into a new session on a live replica, with the whole conversation
        s = sessions[i]
        assert s.replays == 1 and s.id != first_ids[i]
        [new_home] = holder(servers, s.id)
        assert new_home != victim
        third = usages[i][2]
        assert third.generated_tokens == NEW_TOKENS
        assert third.prompt_tokens == third.session_tokens - NEW_TOKENS > usages[i][1].session_tokens
        assert client.get_session(s.id).turns == 1
    assert lost and kept
    client.close()
