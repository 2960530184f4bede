"""One saved session's load, the restart's extra work in its first turn, timed by parts: the file's read (the
CRC-32 pass, then the parse that maps its tensors), the bounds check, the import into the pools, and the drop of
the tensors that map the deleted file (service/saved_sessions.py lets go of them on a low-priority thread).

A session of ``--tokens`` random tokens is prefilled on the embedded model's runner and exported once. Each round
writes it afresh (in the page cache, as a drain leaves it) in every variant and loads it through the server's own
functions on the server's threads (engine/session_file.py's ``read`` and session_transfer's ``check_artifact`` on
a worker, the runner's ``import_session`` on a thread of its own, as the engine's), the variants taking turns:
the CRC-32's primitive (ISA-L's, where the ``isal`` package is installed, and zlib's: engine/parallel_crc.py)
times the file's method state (int64 fields narrowed to int32, as the server writes them, or as the session
holds them). The imported sessions stay open (the pools are sized for them first, as a restart's are), so no
import grows a pool. Medians and minima are printed, JSON with ``--out``: each part's wall time, and the CPU time
of the thread that ran it (``time.thread_time``; with ``--threads 1`` and ISA-L's CRC on one core that is all of
its work but the read's CRC pieces on other threads: what a loaded machine's wall time hides).

    python -m bench.session_load --tokens 1000 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from retopk_core.models import DEFAULT_MODEL

PARTS = ("read", "check", "import", "drop", "total")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or local checkpoint path")
    p.add_argument("--tokens", type=int, default=1000, help="the session's tokens (default %(default)s)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON there")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """``measure`` on the model ``--model`` names, with transparent huge pages on."""
    from retopk_core.hugepages import enable_transparent_hugepages
    from retopk_core.models import load_model

    args = parse_args(argv)
    enable_transparent_hugepages()
    return measure(args, *load_model(args.model))


def measure(args, model, tokenizer) -> dict:
    """The run of ``main`` on a loaded (model, tokenizer) (the tests pass the embedded model they hold)."""
    import torch

    from retopk_server.config import ServerConfig
    from retopk_server.engine import parallel_crc, session_file
    from retopk_server.engine.session_artifact import SessionArtifact, model_fingerprint
    from retopk_server.engine.session_transfer import check_artifact
    from retopk_server.runtime import ModelRunner

    torch.set_num_threads(args.threads)
    config = ServerConfig(model=args.model, kv_cache_bytes=4 << 30)
    runner = ModelRunner(config.runtime_config(), model=model, tokenizer=tokenizer)
    source = runner.open_session()
    gen = torch.Generator().manual_seed(0)
    runner.prefill(source, torch.randint(0, runner.info.vocab_size, (args.tokens,), generator=gen).tolist())
    artifact = SessionArtifact(state=runner.export_session(source), model=model_fingerprint(runner.info), owner="",
                               session_id="s")
    runner.close_session(source)

    primitives = {"zlib": zlib.crc32}
    if parallel_crc.part_crc32 is not zlib.crc32:
        primitives = {"isal": parallel_crc.part_crc32, **primitives}
    variants = [(crc, narrow) for crc in primitives for narrow in (True, False)]
    name = {(crc, narrow): f"{crc}, {'int32' if narrow else 'int64'} state" for crc, narrow in variants}
    runner.make_room([(artifact.state.length, artifact.state.method)] * (args.rounds * len(variants)))
    times = {name[v]: {part: [] for part in PARTS} for v in variants}
    cpu_times = {name[v]: {part: [] for part in PARTS} for v in variants}
    # the server's threads: the read and the check on a worker (asyncio.to_thread), the import on the engine's own
    # thread (an import from this main thread ran 2-4x slower here, loaded)
    worker, engine = ThreadPoolExecutor(1, "worker"), ThreadPoolExecutor(1, "engine")
    sizes = {}
    directory = Path(tempfile.mkdtemp(prefix="retopk-session-load-"))
    for round_ in range(args.rounds):
        for crc, narrow in variants if round_ % 2 == 0 else variants[::-1]:
            path = directory / "s.session"
            path.write_bytes(b"".join(bytes(p) for p in session_file.parts(artifact, narrow)))
            sizes[name[crc, narrow]] = path.stat().st_size
            parallel_crc.part_crc32 = primitives[crc]
            t0 = time.perf_counter()
            loaded, read_cpu = worker.submit(_on_cpu, session_file.read, path).result()
            path.unlink()  # as SessionStore.take_file does
            t1 = time.perf_counter()
            check_cpu = worker.submit(_on_cpu, check_artifact, runner, loaded, "").result()[1]
            t2 = time.perf_counter()
            import_cpu = engine.submit(_on_cpu, runner.import_session, loaded.state, None, True).result()[1]
            t3 = time.perf_counter()
            c = time.thread_time()
            del loaded  # the tensors mapping the deleted file
            drop_cpu = time.thread_time() - c
            t4 = time.perf_counter()
            walls = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)
            cpus = (read_cpu, check_cpu, import_cpu, drop_cpu, read_cpu + check_cpu + import_cpu + drop_cpu)
            for part, seconds, cpu in zip(PARTS, walls, cpus, strict=True):
                times[name[crc, narrow]][part].append(seconds)
                cpu_times[name[crc, narrow]][part].append(cpu)
    parallel_crc.part_crc32 = primitives[next(iter(primitives))]
    directory.rmdir()  # each round unlinked its file
    worker.shutdown()
    engine.shutdown()
    result = {"tokens": args.tokens, "rounds": args.rounds, "threads": args.threads, "file_bytes": sizes,
              "load_average": os.getloadavg(), "seconds": times, "thread_cpu_seconds": cpu_times}
    print(f"one session of {args.tokens} tokens, {args.rounds} rounds, {args.threads} threads, load average "
          f"{result['load_average'][0]:.1f}; ms, median / minimum")
    for title, table in (("wall time", times), ("CPU time of the thread that ran it", cpu_times)):
        print(f"{title + ':':24s} {'MiB':>6s} " + " ".join(f"{part:>14s}" for part in PARTS))
        for variant, parts in table.items():
            print(f"{variant:24s} {sizes[variant] / 2**20:6.1f} " + " ".join(
                f"{statistics.median(v) * 1e3:6.1f} / {min(v) * 1e3:5.1f}" for v in parts.values()))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _on_cpu(fn, *args):
    """(fn(*args), the CPU seconds this thread spent in it)."""
    start = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - start


if __name__ == "__main__":
    main()
