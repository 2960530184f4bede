"""What a turn that ends early leaves in its session, an edited history, and a retried request (docs/reliability.md,
"Turn integrity"), over gRPC with the real service code and the fake runner, whose model reads the whole context:
every expectation is the fake's definition (``greedy_reference``) applied to the conversation the rule says the
session holds.

The rule: a turn that streamed k >= 1 tokens leaves its input and exactly those k tokens in the session (KV cache,
pending token, conversation); a turn that streamed none leaves the session as it was before the turn.
"""

from __future__ import annotations

import time

import pytest

from retopk_client import Client, DeadlineExceeded, FailedPrecondition, RetopkError
from tests.server.fake_runner import FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def turn(client: Client, text: str, n: int = 6, **kw) -> list[int]:
    return list(client.complete(text, session_id="s", temperature=0, max_new_tokens=n, ignore_eos=True,
                                **kw).token_ids)


def idle(client: Client) -> object:
    """The session once no request holds it (a cancelled stream ends at the engine's next step)."""
    deadline = time.monotonic() + 20
    while (info := client.get_session("s")).busy and time.monotonic() < deadline:
        time.sleep(0.02)
    return info


@pytest.mark.parametrize("how", ["cancelled", "expired", "client gone"])
def test_a_turn_ended_mid_stream_keeps_its_input_and_exactly_the_tokens_sent(fake_server, how):
    server = fake_server(FakeRunner(step_delay_s=0.02))
    with Client(server.address, timeout=30) as client:
        client.create_session(session_id="s")
        before = enc("Hello") + turn(client, "Hello")
        received = []
        other = Client(server.address, timeout=30)
        kwargs = dict(session_id="s", temperature=0, max_new_tokens=500, ignore_eos=True)
        if how == "expired":
            with pytest.raises(DeadlineExceeded):
                for chunk in other.generate(" more", timeout=0.4, **kwargs):
                    received += chunk.token_ids
        else:
            stream = other.generate(" more", **kwargs)
            for chunk in stream:
                received += chunk.token_ids
                if len(received) == 3:
                    break
            stream.cancel() if how == "cancelled" else other.close()  # gone: its channel closes mid-stream
        other.close()
        info = idle(client)
        kept = info.num_tokens - len(before) - len(" more")
        sent = greedy_reference(before + enc(" more"), kept, stop_at_eos=False)
        assert kept >= len(received) >= 1 and received == sent[:len(received)] and info.turns == 2
        # the next turn continues from exactly that state
        assert turn(client, " last") == greedy_reference(before + enc(" more") + sent + enc(" last"), 6)


def test_a_turn_ended_before_its_first_token_leaves_the_session_as_before(fake_server):
    server = fake_server(FakeRunner(prefill_delay_s=0.05), max_step_tokens=4)  # a prompt takes many iterations
    with Client(server.address, timeout=30) as client:
        client.create_session(session_id="s")
        before = enc("Hello") + turn(client, "Hello")
        with pytest.raises(DeadlineExceeded):
            client.complete(" a long prompt that is still prefilling", session_id="s", timeout=0.2,
                            request_id="slow")
        info = idle(client)
        assert info.num_tokens == len(before) and info.turns == 1
        assert turn(client, " last") == greedy_reference(before + enc(" last"), 6)
        # nothing was answered, so a retry with the same id runs (and now gets its tokens)
        again = client.complete(" a long prompt that is still prefilling", session_id="s", request_id="slow",
                                temperature=0, max_new_tokens=3, ignore_eos=True)
        assert again.usage.generated_tokens == 3


def test_a_retried_request_is_answered_once(fake_server):
    server = fake_server(FakeRunner(step_delay_s=0.02))
    with Client(server.address, timeout=30) as client:
        client.create_session(session_id="s")
        first = client.complete("Hello", session_id="s", temperature=0, max_new_tokens=6, request_id="t1")
        retried = client.complete("Hello", session_id="s", temperature=0, max_new_tokens=6, request_id="t1")
        assert list(retried.token_ids) == list(first.token_ids) and retried.usage == first.usage
        info = client.get_session("s")
        assert info.turns == 1 and info.num_tokens == len("Hello") + 6  # not run twice into the session
        # the same id with another input is another request: it runs
        assert turn(client, " next", request_id="t1") == greedy_reference(enc("Hello") + list(first.token_ids)
                                                                          + enc(" next"), 6)
        # a turn that ended early after tokens: its retry is refused, naming the id and what the session kept
        stream = client.generate(" more", session_id="s", temperature=0, max_new_tokens=500, ignore_eos=True,
                                 request_id="t3")
        next(stream)
        stream.cancel()
        idle(client)
        with pytest.raises(FailedPrecondition, match="request_id: request 't3' already ran in session 's' and "
                                                     "ended early"):
            client.complete(" more", session_id="s", temperature=0, max_new_tokens=500, ignore_eos=True,
                            request_id="t3")
        assert client.get_session("s").turns == 3


def chat(client: Client, messages: list[dict], history: bool = False) -> list[int]:
    return list(client.complete(messages=messages, session_id="s", temperature=0, max_new_tokens=6,
                                ignore_eos=True, chat_history=history).token_ids)


def rendered(messages: list[dict]) -> list[int]:
    """The fake's chat template (FakeRunner.encode_chat)."""
    return enc("".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>")


def test_an_edited_history_rewinds_to_the_common_prefix_and_equals_a_fresh_session(fake_server):
    runner = FakeRunner()
    server = fake_server(runner)
    with Client(server.address, timeout=30) as client:
        client.create_session(session_id="s")
        history = []
        for text in ("Hi there", "Tell me more"):
            history.append({"role": "user", "content": text})
            reply = chat(client, history[-1:])
            history.append({"role": "assistant", "content": "".join(map(chr, reply))})
        held = client.get_session("s").num_tokens
        edited = [history[0], history[1], {"role": "user", "content": "Tell me less"}]  # the last question edited
        runner.log.clear()
        reply = chat(client, edited, history=True)
        full = rendered(edited)
        assert reply == greedy_reference(full, 6, stop_at_eos=False)  # a fresh session fed the edited history
        common = len(f"<user>Hi there\n<assistant>{history[1]['content']}\n<user>Tell me ")
        assert sum(n for kind, n in runner.log if kind == "prefill") == len(full) - common  # only the rest fed
        assert client.get_session("s").num_tokens == len(full) + 6 and held > common
        # regenerate: the history without the last reply
        again = chat(client, edited, history=True)
        assert again == reply
        with pytest.raises(RetopkError, match="chat_history: needs chat input"):
            client.complete("text", session_id="s", chat_history=True)
