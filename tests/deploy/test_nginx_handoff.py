"""Acceptance of the handoff on drain: three real `retopk-server` processes (the embedded SmolLM2-135M) behind
Debian's nginx running docker/nginx/routing.conf and grpc-proxy.conf unchanged, each started with
``--handoff-peer <the router>``.

Nine sessions (full, Exact Top-K and the default ReTopK in turn) take three greedy chat turns through nginx. The
replica holding the most of them is drained (SIGTERM): it stops listening, then sends each idle session through
the router with its own ``x-session-id``, so nginx's consistent hash places it on the replica that takes the
drained one's place on the ring for that id. Then turn 4 of every session goes through nginx with the SDK
(``replay=True``, which would count a replay): no session is lost, none is replayed, each moved session holds
exactly what it held before the move (keys, values, method state, against an export taken before the drain),
nginx sent each import to the very replica that then served the session's turn 4, and turn 4's tokens equal those
of the same conversation run on a replica that never moved it.

Runs in `make test-full` (marker `full`); skips where no nginx binary exists (scripts/install_system_deps.sh
installs it).
"""

from __future__ import annotations

import pytest
import torch

from retopk_client import Client, RetryPolicy
from retopk_server.engine.session_file import decode
from tests.deploy.nginx_cluster import access_log, holder, logged_since, nginx_cluster

pytestmark = [pytest.mark.slow, pytest.mark.full, pytest.mark.timeout(900)]

REPLICAS, SESSIONS = 3, 9
METHODS = ("full", "exact_topk", None)  # None: the server's default ReTopK
TURNS = ["Name a colour.", "Why that one?", "And a fruit?", "Which is sweeter?"]


@pytest.fixture(scope="module")
def cluster():
    with nginx_cluster(REPLICAS, "--max-running", "8", "--drain-grace-s", "5", "--handoff-peer", "{router}") as c:
        yield c.servers, c.router, c.prefix


def chat(session, text: str) -> list[int]:
    reply = session.complete(messages=[{"role": "user", "content": text}], temperature=0, max_new_tokens=6,
                             ignore_eos=True)
    return list(reply.token_ids)


def test_a_drained_replica_hands_its_sessions_to_where_the_router_sends_them_next(cluster):
    servers, router, prefix = cluster
    client = Client(router, timeout=300, retry=RetryPolicy(max_attempts=3, initial_backoff=0.05))
    sessions = [client.session(method=METHODS[i % 3], replay=True) for i in range(SESSIONS)]
    outputs = {i: [chat(s, text) for text in TURNS[:3]] for i, s in enumerate(sessions)}
    homes = {i: holder(servers, s.id) for i, s in enumerate(sessions)}
    assert all(len(h) == 1 for h in homes.values())
    homes = {i: h[0] for i, h in homes.items()}
    victim = max(set(homes.values()), key=lambda r: sum(h == r for h in homes.values()))
    moved = [i for i, h in homes.items() if h == victim]
    control = next(r for r in range(REPLICAS) if r != victim)
    before = {i: decode(client.export_session(sessions[i].id)) for i in moved}

    # the reference: the same conversations on a replica directly, never moved
    with Client(servers[control].address, timeout=300) as direct:
        references = {}
        for i in moved:
            with direct.session(method=METHODS[i % 3]) as twin:
                assert [chat(twin, text) for text in TURNS[:3]] == outputs[i]
                references[i] = chat(twin, TURNS[3])

    mark = len(access_log(prefix))
    assert servers[victim].stop(timeout=120) == 0  # SIGTERM: drain, stop listening, hand over, exit
    assert "sessions handed over" in servers[victim].output()
    imports = logged_since(prefix, mark, "ImportSession", len(moved))
    assert len(imports) == len(moved) and all(status == "200" for _, _, status, _ in imports)
    landed = {key: upstream.split(", ")[-1] for key, upstream, _, _ in imports}

    for i in moved:  # the new home holds exactly what the drained replica held: tokens, keys, values, state
        held, sent = decode(client.export_session(sessions[i].id)).state, before[i].state
        assert torch.equal(held.token_ids, sent.token_ids) and (held.state is None) == (sent.state is None)
        for kv in ("k", "v"):
            assert torch.equal(held.positions(getattr(held, kv)), sent.positions(getattr(sent, kv))), (i, kv)
        for field, t in (sent.state or {}).items():
            assert torch.equal(held.state[field], t), (i, field)

    for i, s in enumerate(sessions):
        fourth = chat(s, TURNS[3])
        assert s.replays == 0 and client.get_session(s.id).turns == 4  # not lost, not replayed
        if i in moved:
            assert fourth == references[i], i
    for i in moved:
        [home] = holder(servers, sessions[i].id)
        assert home != victim and servers[home].address == landed[sessions[i].id]
    served = {key: upstream.split(", ")[-1] for key, upstream, _, _ in logged_since(prefix, mark, "Generate", SESSIONS)}
    assert all(served[sessions[i].id] == landed[sessions[i].id] for i in moved)  # the import went where turn 4 did
    assert moved and len(moved) < SESSIONS
    client.close()
