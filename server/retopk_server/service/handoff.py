"""At a drain, the sessions left go on elsewhere: to a peer (--handoff-peer) and/or to --session-dir.

``keep_sessions`` runs once the server's last requests ended (service/server.py), on the still running engine:
every idle named session, most recently used first, is exported (a session file's bytes, engine/session_file.py) and

- sent to the peer with ImportSession, carrying its own ``x-session-id`` and the servers' shared peer key
  (``x-retopk-peer-key``: the peer opens it for its owner). With the router as the peer, its consistent hash on
  ``x-session-id`` places each session on the replica that receives the session's next call: this replica no
  longer accepts connections, so the router picks, for each id, the replica that takes its place on the ring,
  as it will for the client's next call (docs/deploy.md). The client's next call then finds its session there,
  prefills nothing again and needs no replay.
- written to the session directory when there is no peer or the peer refused it (engine/session_store.py).

With --handoff-linger-s (a peer clients reach directly, not a router) the server still listens while it hands
the sessions over: each moved session is closed here and its (owner, id) recorded in ``HandoffNotices``, so that
a call on it, by its owner only, ends UNAVAILABLE with the trailer ``x-retopk-handoff: <new home>``
(service/handoff_notices.py); the SDK follows it to the same session id without replay, when that address is one it was
configured with. Another key asking for the id gets what an unknown id gets: no notice tells it the id exists.

It gets at least until ``deadline`` (what is left of the drain grace, at least service/server.py's
KEEP_SESSIONS_MIN_S) and as long as the sessions' bytes take at KEEP_BYTES_PER_S, a rate slower than a loaded
machine exports, encodes and writes them (the orchestrator's stop grace must cover it: the drain logs the time it
allows). Sessions not kept by then end with the process, the least recently used ones, each logged by name.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.engine import Engine, session_file
from retopk_server.engine.session_artifact import chunks
from retopk_server.engine.session_store import SessionStore
from retopk_server.service.gateway import PEER_METADATA
from retopk_server.service.handoff_notices import HandoffNotices
from retopk_server.service.limits import SESSION_CHUNK_BYTES
from retopk_shared.metadata import SESSION_METADATA

log = logging.getLogger("retopk_server")

KEEP_BYTES_PER_S = 16 << 20  # the drain allows the sessions' bytes this rate at least (module docstring)


_IMPORT = pb.DESCRIPTOR.services_by_name["ReTopKService"].methods_by_name["ImportSession"]
IMPORT_PATH = f"/{_IMPORT.containing_service.full_name}/{_IMPORT.name}"
# ImportSessionRequest's ``data``, a length-delimited field: its tag (field number, wire type 2) precedes the length
DATA_TAG = bytes([pb.ImportSessionRequest.DESCRIPTOR.fields_by_name["data"].number << 3 | 2])


def varint(n: int) -> bytes:
    """``n`` >= 0 as a protobuf varint: 7 bits a byte, least significant first, the high bit set on all but the
    last."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def import_requests(parts: tuple[bytes | memoryview, ...]):
    """The ImportSession stream of an artifact's parts (session_file.parts), each message serialized: an
    ImportSessionRequest holding only ``data`` is its tag, its length and its bytes, so each is one join of a view
    of the parts (building the message and serializing it would copy each byte twice more)."""
    for piece in chunks(parts, SESSION_CHUNK_BYTES):
        yield b"".join((DATA_TAG, varint(piece.nbytes), piece))


async def keep_sessions(engine: Engine, deadline: float, peer: str | None, peer_key: str | None,
                        store: SessionStore | None, notices: HandoffNotices | None = None,
                        address: str | None = None) -> tuple[int, int, int]:
    """Hand every idle session to ``peer`` or save it in ``store`` before ``deadline`` (time.monotonic()) ->
    (handed over, saved, lost). With ``notices`` (the server still listens) a session handed over is closed here
    and recorded as moved to ``address`` (default ``peer``)."""
    idle = await asyncio.wrap_future(engine.commands.idle_sessions())
    total = sum(nbytes for *_, nbytes in idle)
    deadline = max(deadline, time.monotonic() + total / KEEP_BYTES_PER_S)  # sized to the work
    log.info("drain: keeping %d idle sessions (%.1f MiB) within %.1f s", len(idle), total / 2**20,
             deadline - time.monotonic())
    moved, saved, lost = 0, 0, []
    if notices is not None:  # a call on one of them waits for its turn here, then gets the notice
        notices.expect((owner, session_id) for owner, session_id, _ in idle)
    channel = grpc.aio.insecure_channel(peer, options=[("grpc.max_send_message_length", 2 * SESSION_CHUNK_BYTES)]) \
        if peer else None
    try:
        send = None if channel is None else channel.stream_unary(  # its requests come serialized (import_requests)
            IMPORT_PATH, request_serializer=None, response_deserializer=pb.SessionInfo.FromString)
        for i, (owner, session_id, _) in enumerate(idle):
            left = deadline - time.monotonic()
            if left <= 0:
                lost += [(o, s) for o, s, _ in idle[i:]]
                log.warning("drain: out of time, %d sessions not kept (the least recently used)", len(idle) - i)
                break
            artifact = await asyncio.wrap_future(engine.commands.export_session(session_id, owner))
            parts = await asyncio.to_thread(session_file.parts, artifact)
            if send is not None:
                metadata = [(SESSION_METADATA, session_id)] + ([(PEER_METADATA, peer_key)] if peer_key else [])
                try:
                    await send(import_requests(parts), metadata=metadata, timeout=left)
                    moved += 1
                    if notices is not None:  # recorded first: a call from now on is told where it went
                        notices.record(owner, session_id, address or peer)
                        await asyncio.wrap_future(engine.commands.close_session(session_id, owner))
                    continue
                except grpc.RpcError as e:
                    log.warning("handing session %s/%s to %s failed: %s: %s", owner or "anonymous", session_id, peer,
                                e.code().name, e.details())
            if store is not None and await asyncio.to_thread(store.save, owner, session_id, artifact):
                saved += 1
            else:
                lost.append((owner, session_id))
            if notices is not None:  # not moved: a call waiting for it goes on without a notice
                notices.settle(owner, session_id)
    finally:
        if notices is not None:
            notices.finish()
        if channel is not None:
            await channel.close()
    log.info("drain: %d sessions handed over to %s, %d saved in %s, %d lost", moved, peer or "no peer", saved,
             store.directory if store is not None else "no session dir", len(lost))
    for owner, session_id in lost:
        log.warning("drain: session %s/%s lost", owner or "anonymous", session_id)
    return moved, saved, len(lost)
