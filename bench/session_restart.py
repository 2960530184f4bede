"""A restart with --session-dir: each saved session's first token after the restart vs an uninterrupted turn's.

Server A runs in this process (the real gRPC service, engine and runtime on the embedded model, its own
runner) with ``--session-dir`` on a temporary directory. ``--sessions`` sessions each take a prompt of
``--tokens`` random token ids, then a short turn whose time to first token (the server's own timing) is the
uninterrupted figure. A is drained (every session written to the directory: the drain's time is reported),
server B starts on the same directory with a new runner (its start's time is reported: it sizes its pools for the
saved sessions before it takes calls), and each session's next short turn there loads it on first use (read,
checked, imported) before its prefill: that turn's time to first token is the restart figure.
Both turns feed the same number of new tokens; both times are the client's, from sending the turn to its first
token (the server's own timing starts after the load). Medians and the worst ratio are printed, JSON with ``--out``.

B preloads the saved sessions in the background from its start, while no call runs (service/saved_sessions.py).
By default the turns come right after the restart, in the order the sessions were made (the least recently used
first: the preload's last), so that each turn finds its session on disk or being loaded; with ``--after-preload``
they come once B holds every session (clients returning after the restart's background load, whose time is
reported). Like for like: on both servers the turns come one at a time, each sent once the one before has ended,
from the same client, feeding as many tokens into a session of the same length; what differs is only whether the
session had to come back from the directory first. The load average is reported with the result (under load the
times mean little; their ratios, from one run, compare). Since the two phases lie minutes apart and a shared
machine's load drifts between them, each restored session's first turn is also compared with that session's next
turn on B, sent right after it (in memory by then: an uninterrupted turn seconds later, under the same load).
The uninterrupted figure is one turn of each session, and a session's worst ratio can come from that one turn
being fast as much as from its restored turn being slow; so the restored turn is also compared with the median of
``--baseline-turns`` uninterrupted turns of its session: the one on A, the next turn on B and as many more after
that on B (printed beside the ratio to A's turn, which stays as it was; the extra turns come after every figure
measured before, so the saved sessions and the restored turns are what they were).

    python -m bench.session_restart --sessions 16 --tokens 1000 --threads 2 --out docs/bench/session_restart.json
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path as FsPath

from bench import local_server
from bench.local_server import LocalServer, server_config, write_result


def own_options(p) -> None:
    p.add_argument("--sessions", type=int, default=16, help="saved sessions (default %(default)s)")
    p.add_argument("--tokens", type=int, default=1000, help="prompt tokens of each session (default %(default)s)")
    p.add_argument("--turn", type=int, default=8, help="new tokens of each timed turn (default %(default)s)")
    p.add_argument("--after-preload", action="store_true", help="the turns after B preloaded every session")
    p.add_argument("--baseline-turns", type=int, default=3,
                   help="uninterrupted turns of each session whose median the restored turn is also compared with: "
                        "the one on A, then the next turns on B (default %(default)s)")


def parse_args(argv=None):
    return local_server.parse_args(__doc__, 4 << 30, own_options, argv)


def main(argv=None) -> dict:
    return local_server.main(parse_args, measure, argv)


def measure(args, model, tokenizer) -> dict:
    """The run of ``main`` on a loaded (model, tokenizer) (the tests pass the embedded model they hold). The
    session directory is removed afterwards: at 16 sessions of 1,000 tokens it holds several hundred MB."""
    with tempfile.TemporaryDirectory(prefix="retopk-sessions-") as directory:
        return _measure(args, model, tokenizer, directory)


def _measure(args, model, tokenizer, directory: str) -> dict:
    import torch

    from retopk_client import Client

    config = server_config(args, max_sessions=max(64, args.sessions), max_sessions_per_key=args.sessions,
                           session_dir=directory)
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)

    def short_turn(client: Client, sid: str, last: int) -> tuple[float, int]:
        """(seconds from sending the turn to its first token, as the client sees them: a restored session's
        load from the directory included; the turn's last token)."""
        ids = [last] + torch.randint(0, vocab, (args.turn - 1,), generator=gen).tolist()
        t0 = time.perf_counter()
        with client.generate(token_ids=ids, session_id=sid, temperature=0, max_new_tokens=2,
                             ignore_eos=True) as stream:
            chunks = [next(stream)]
            first = time.perf_counter() - t0
            chunks += list(stream)
        return first, chunks[-1].token_ids[-1]

    first = LocalServer(config, model, tokenizer)
    before, last = [], {}
    with Client(first.address, timeout=3600) as client:
        for i in range(args.sessions):
            sid = f"s{i}"
            client.create_session(session_id=sid)
            prompt = torch.randint(0, vocab, (args.tokens,), generator=gen).tolist()
            out = client.complete(token_ids=prompt, session_id=sid, temperature=0, max_new_tokens=1, ignore_eos=True)
            first_token, last[sid] = short_turn(client, sid, out.token_ids[-1])
            before.append(first_token)
    t0 = time.perf_counter()
    first.close()  # the drain writes every session
    drain_s = time.perf_counter() - t0
    saved = sum(p.stat().st_size for p in FsPath(directory).iterdir())

    t0 = time.perf_counter()
    second = LocalServer(config, model, tokenizer)  # from here on B takes calls: its pools sized for the saved ones
    start_s = time.perf_counter() - t0
    after, again, baseline_turns, preload_s = [], [], [], None
    with Client(second.address, timeout=3600) as client:
        if args.after_preload:
            t0 = time.perf_counter()
            while len(client.list_sessions()) < args.sessions and time.perf_counter() - t0 < 600:
                time.sleep(0.05)
            preload_s = time.perf_counter() - t0
        for i in range(args.sessions):
            first_token, last[f"s{i}"] = short_turn(client, f"s{i}", last[f"s{i}"])
            after.append(first_token)
            turns = [before[i]]  # the session's uninterrupted turns: A's, then B's with the session in memory
            for _ in range(max(1, args.baseline_turns - 1)):
                first_token, last[f"s{i}"] = short_turn(client, f"s{i}", last[f"s{i}"])
                turns.append(first_token)
            again.append(turns[1])  # the same session's next turn, in memory now
            baseline_turns.append(turns)
    second.close()

    ratios = [a / b for a, b in zip(after, before, strict=True)]
    adjacent = [a / b for a, b in zip(after, again, strict=True)]
    to_median = [a / statistics.median(turns) for a, turns in zip(after, baseline_turns, strict=True)]
    result = {"sessions": args.sessions, "tokens": args.tokens, "turn_tokens": args.turn, "threads": args.threads,
              "load_average": os.getloadavg(), "saved_bytes": saved, "drain_s": drain_s, "start_s": start_s,
              "after_preload": args.after_preload, "preload_wait_s": preload_s, "first_token_uninterrupted_s": before,
              "first_token_after_restart_s": after, "median_uninterrupted_s": statistics.median(before),
              "median_after_restart_s": statistics.median(after), "median_ratio": statistics.median(ratios),
              "worst_ratio": max(ratios), "first_token_next_turn_s": again,
              "median_ratio_to_next_turn": statistics.median(adjacent), "worst_ratio_to_next_turn": max(adjacent),
              "first_token_uninterrupted_turns_s": baseline_turns,
              "median_ratio_to_session_median": statistics.median(to_median),
              "worst_ratio_to_session_median": max(to_median)}
    print(f"{args.sessions} sessions of {args.tokens} tokens, {saved / 2**20:.0f} MiB saved, drain {drain_s:.2f} s, "
          f"B's start {start_s:.2f} s, {args.threads} threads, load average {result['load_average'][0]:.1f}")
    if preload_s is not None:
        print(f"  B preloaded every session {preload_s:.2f} s after its start")
    print(f"  first token of a {args.turn}-token turn: uninterrupted median {result['median_uninterrupted_s']:.3f} s, "
          f"after the restart median {result['median_after_restart_s']:.3f} s")
    print(f"  ratio after / uninterrupted: median {result['median_ratio']:.2f}, worst {result['worst_ratio']:.2f}")
    print(f"  ratio after / the same session's next turn on B: median {result['median_ratio_to_next_turn']:.2f}, "
          f"worst {result['worst_ratio_to_next_turn']:.2f}")
    print(f"  ratio after / the median of the session's {len(baseline_turns[0])} uninterrupted turns (A's, B's next): "
          f"median "
          f"{result['median_ratio_to_session_median']:.2f}, worst {result['worst_ratio_to_session_median']:.2f}")
    return write_result(args, result)


if __name__ == "__main__":
    main()
