"""Handoff of a long session between two local replicas vs prefilling it again, same process.

Two servers run in this process (the real gRPC service, engine and runtime, each its own runner on the
embedded model, over loopback). A session of ``--tokens`` prompt tokens is prefilled on A. Then, for
``--rounds`` rounds (after ``--warmup`` untimed ones), each measured on its own:

- handoff: what a draining A does with ``--handoff-peer B`` (service/handoff.py's ``keep_sessions``): export on
  A's engine thread, encode, ImportSession to B over gRPC, checked and written into B's pools; the copy on B
  is closed again for the next round;
- through a client: the SDK's ``export_session`` from A and ``import_session`` into B (the bytes cross twice);
- re-prefill: the baseline a replay pays, a fresh session on B fed the same tokens (its prefill time from the
  server's own timings, and the wall time of the whole call);
- first token: the next turn (a few tokens) of the handed-over session on B vs the same turn of the
  re-prefilled session on B, which never moved (time to first token from the server's timings).

Medians are printed with the ratio handoff / re-prefill and written as JSON with ``--out``.

    python -m bench.handoff --tokens 8000 --threads 2 --out docs/bench/handoff.json
"""

from __future__ import annotations

import asyncio
import statistics
import time

from bench import local_server
from bench.local_server import LocalServer, server_config, write_result


def own_options(p) -> None:
    p.add_argument("--tokens", type=int, default=8000, help="prompt tokens of the session (default %(default)s)")
    p.add_argument("--method", default=None, help="the session's method name (default: the server's ReTopK)")
    p.add_argument("--rounds", type=int, default=3, help="timed handoffs and re-prefills (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed handoffs first (the process's first large "
                                                         "allocations fault their pages in; default %(default)s)")


def parse_args(argv=None):
    return local_server.parse_args(__doc__, 2 << 30, own_options, argv)


def main(argv=None) -> dict:
    return local_server.main(parse_args, measure, argv)


def measure(args, model, tokenizer) -> dict:
    """The run of ``main`` on a loaded (model, tokenizer) (the tests pass the embedded model they hold)."""
    import torch

    from retopk_client import Client
    from retopk_server.service.handoff import keep_sessions

    # a re-prefill prefills: B's prefix cache would hold the prompt
    config = server_config(args, max_prompt_tokens=args.tokens, prefix_cache=False)
    servers = [LocalServer(config, model, tokenizer) for _ in range(2)]
    a, b = (Client(s.address, timeout=3600) for s in servers)
    vocab = a.model_info().vocab_size
    prompt = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    turn = dict(temperature=0, max_new_tokens=4, ignore_eos=True)

    a.create_session(method=args.method, session_id="moving")
    first = a.complete(token_ids=prompt, session_id="moving", max_new_tokens=1, temperature=0, ignore_eos=True)

    def hand_over() -> float:
        t0 = time.perf_counter()
        moved = asyncio.run_coroutine_threadsafe(keep_sessions(servers[0].engine, time.monotonic() + 3600,
                                                               servers[1].address, None, None),
                                                 servers[0].loop).result()[0]
        elapsed = time.perf_counter() - t0
        assert moved == 1, "the session was not handed over"
        return elapsed

    handoff, relay, sizes, reprefill, reprefill_wall = [], [], [], [], []
    for r in range(args.warmup + args.rounds):
        took = hand_over()
        b.close_session("moving")
        t0 = time.perf_counter()
        data = a.export_session("moving")
        b.import_session(data)
        relayed = time.perf_counter() - t0
        b.close_session("moving")
        if r < args.warmup:
            continue
        handoff.append(took)
        relay.append(relayed)
        sizes.append(len(data))
        sid = f"fresh-{r}"
        b.create_session(method=args.method, session_id=sid)
        t0 = time.perf_counter()
        done = b.complete(token_ids=prompt, session_id=sid, max_new_tokens=1, temperature=0, ignore_eos=True)
        reprefill_wall.append(time.perf_counter() - t0)
        reprefill.append(done.timings.prefill_seconds)
        if r < args.warmup + args.rounds - 1:
            b.close_session(sid)
    hand_over()  # the moved session's next turn runs on B, next to the re-prefilled one
    moved_turn = b.complete(token_ids=[first.token_ids[-1]], session_id="moving", **turn)
    fresh_turn = b.complete(token_ids=[done.token_ids[-1]], session_id=sid, **turn)
    for client in (a, b):
        client.close()
    for server in servers:
        server.close()

    result = {
        "tokens": args.tokens, "method": args.method or "default (server's ReTopK)", "threads": args.threads,
        "rounds": args.rounds, "artifact_bytes": statistics.median(sizes),
        "handoff_s": statistics.median(handoff), "handoff_all_s": handoff,
        "through_client_s": statistics.median(relay), "through_client_all_s": relay,
        "reprefill_s": statistics.median(reprefill), "reprefill_wall_s": statistics.median(reprefill_wall),
        "first_token_moved_s": moved_turn.timings.time_to_first_token_seconds,
        "first_token_unmoved_s": fresh_turn.timings.time_to_first_token_seconds,
        "same_tokens": list(moved_turn.token_ids) == list(fresh_turn.token_ids),
    }
    result["handoff_over_reprefill"] = result["handoff_s"] / result["reprefill_s"]
    result["first_token_ratio"] = result["first_token_moved_s"] / result["first_token_unmoved_s"]
    print(f"session of {args.tokens} tokens ({result['method']}), artifact {result['artifact_bytes'] / 2**20:.1f} MiB, "
          f"{args.threads} threads, median of {args.rounds}:")
    print(f"  handoff (A's drain path to B)        {result['handoff_s']:.3f} s")
    print(f"  through a client (export, import)    {result['through_client_s']:.3f} s")
    print(f"  re-prefill (server's prefill time)   {result['reprefill_s']:.3f} s "
          f"(call {result['reprefill_wall_s']:.3f} s)")
    print(f"  handoff / re-prefill                 {result['handoff_over_reprefill']:.4f}")
    print(f"  next turn's first token: moved {result['first_token_moved_s']:.3f} s, never moved "
          f"{result['first_token_unmoved_s']:.3f} s (ratio {result['first_token_ratio']:.2f}); same tokens: "
          f"{result['same_tokens']}")
    return write_result(args, result)


if __name__ == "__main__":
    main()
