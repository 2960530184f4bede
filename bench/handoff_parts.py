"""Where a handoff's time goes: the drain's path of one long session (bench/handoff.py) timed part by part.

Two servers run in this process as in bench/handoff.py; a session of ``--tokens`` prompt tokens is prefilled on A.
Each round first hands it over whole (service/handoff.py's ``keep_sessions`` to B, timed as the process's CPU time
and the wall time; the copy on B is closed again), then runs the same path's parts one after another on this
thread, each timed as this thread's CPU time (``time.thread_time``) and wall time:

    export      A's copy of the session out of its pools (engine/session_transfer.export_session)
    encode      the artifact's parts (engine/session_file.parts: the narrowed method state, the CRC-32)
    frame       the ImportSession requests, serialized (service/handoff.import_requests)
    transfer    the requests over loopback gRPC to a server that only counts them (the process's CPU time: both
                ends, gRPC's own work)
    parse       the receiving end's protobuf parse of each request
    receive     reading each request's bytes into session_file.Receiver (its spool, engine/spool.py)
    finish      the Receiver's check and parse (session_file.read: the CRC-32, the tensors mapping the spool)
    check       B's checks of the artifact (Engine.check_artifact)
    import      B's import into its pools (engine/session_transfer.import_session), then closed again

The parts run while both engines are idle (no request is in flight: the calls on their tables from this thread do
not race the engine threads). Medians over ``--rounds`` (after one untimed round) are printed and, with ``--out``,
written as JSON. On a shared machine the wall times follow the load; the CPU times are the figures to compare.

    python -m bench.handoff_parts --tokens 8000 --rounds 3 --threads 1
"""

from __future__ import annotations

import asyncio
import statistics
import time

from bench import local_server
from bench.local_server import LocalServer, server_config, write_result


def own_options(p) -> None:
    p.add_argument("--tokens", type=int, default=8000, help="prompt tokens of the session (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (default %(default)s)")


def parse_args(argv=None):
    return local_server.parse_args(__doc__, 2 << 30, own_options, argv)


def main(argv=None) -> dict:
    return local_server.main(parse_args, measure, argv)


async def _counting_server():
    """A gRPC server whose one method, /count.Count/Put, takes a stream of raw messages and counts their bytes."""
    import grpc

    async def put(requests, _context):
        return str(sum([len(r) async for r in requests])).encode()

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "count.Count", {"Put": grpc.stream_unary_rpc_method_handler(put)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel.stream_unary("/count.Count/Put")


def measure(args, model, tokenizer) -> dict:
    """The run of ``main`` on a loaded (model, tokenizer)."""
    import torch

    from retopk_client import Client
    from retopk_proto.retopk.v1 import retopk_pb2 as pb
    from retopk_server.engine import session_file, session_transfer
    from retopk_server.service.handoff import import_requests, keep_sessions

    config = server_config(args, max_prompt_tokens=args.tokens, prefix_cache=False)
    a, b = (LocalServer(config, model, tokenizer) for _ in range(2))
    with Client(a.address, timeout=3600) as client:
        vocab = client.model_info().vocab_size
        prompt = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        client.create_session(session_id="moving")
        client.complete(token_ids=prompt, session_id="moving", max_new_tokens=1, temperature=0, ignore_eos=True)
    counter, put = asyncio.run_coroutine_threadsafe(_counting_server(), a.loop).result()
    times: dict[str, list[tuple[float, float]]] = {}

    def timed(name, f, *args, clock=time.thread_time):
        c0, w0 = clock(), time.perf_counter()
        out = f(*args)
        times.setdefault(name, []).append((clock() - c0, time.perf_counter() - w0))
        return out

    def hand_over() -> None:
        moved = asyncio.run_coroutine_threadsafe(keep_sessions(a.engine, time.monotonic() + 3600, b.address, None,
                                                               None), a.loop).result()[0]
        assert moved == 1, "the session was not handed over"
        b.engine.commands.close_session("moving").result()

    async def sent(requests) -> bytes:
        return await put(iter(requests))

    def transfer(requests) -> int:
        return int(asyncio.run_coroutine_threadsafe(sent(requests), a.loop).result())

    def receive(messages) -> session_file.Receiver:
        receiver = session_file.Receiver()
        for m in messages:
            receiver.feed(m.data)
        return receiver

    def parts_of_one() -> None:
        artifact = timed("export", session_transfer.export_session, a.engine.sessions, "moving")
        parts = timed("encode", session_file.parts, artifact)
        requests = timed("frame", lambda p: list(import_requests(p)), parts)
        assert timed("transfer (process CPU)", transfer, requests, clock=time.process_time) == \
            sum(len(m) for m in requests)
        messages = timed("parse", lambda r: [pb.ImportSessionRequest.FromString(m) for m in r], requests)
        del requests, parts  # as on B, which holds neither
        receiver = timed("receive", receive, messages)
        del messages
        got = timed("finish", receiver.finish)
        timed("check", b.engine.check_artifact, got)
        timed("import", session_transfer.import_session, b.engine.sessions, got, "", None, None, True, True)
        b.engine.sessions.close("moving")

    for r in range(args.rounds + 1):
        timed("handoff (keep_sessions; process CPU)", hand_over, clock=time.process_time)
        parts_of_one()
        if r == 0:
            times.clear()
    asyncio.run_coroutine_threadsafe(counter.stop(None), a.loop).result()
    for server in (a, b):
        server.close()

    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    medians = {name: {"cpu_s": statistics.median(c for c, _ in v), "wall_s": statistics.median(w for _, w in v)}
               for name, v in times.items()}
    result = {"tokens": args.tokens, "threads": args.threads, "rounds": args.rounds, "load": load, "parts": medians}
    print(f"session of {args.tokens} tokens, {args.threads} threads, median of {args.rounds} (load {' '.join(load)}):")
    print(f"  {'part':40s} {'CPU ms':>8s} {'wall ms':>8s}")
    for name, t in result["parts"].items():
        print(f"  {name:40s} {t['cpu_s'] * 1e3:8.1f} {t['wall_s'] * 1e3:8.1f}")
    return write_result(args, result)


if __name__ == "__main__":
    main()
