"""A session artifact's payload written two ways, alternating in one process: the hand-written parts
(engine/safetensors_parts.py: the header, then views of the tensors) vs ``safetensors.torch.save`` (one ``bytes``).

The tensors have the shapes of an embedded-model (SmolLM2-135M) session of ``--tokens`` tokens under the default
ReTopK method: keys and values in bfloat16 blocks of 256 positions, the query-support FIFO (128 queries of 64
dimensions and their 64 supports per head and layer). Each round encodes the payload and hashes it (what an
export does before its first byte goes out); reported: the median time of each, and the process's resident
memory above its level before the call, at its peak during the call (sampled every millisecond) and still held
by the result.

    python -m bench.artifact_writer --tokens 8000 --rounds 6
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import threading
import time

import torch

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK, FIFO, TOP_K = 30, 3, 9, 64, 256, 128, 64


def session_tensors(tokens: int) -> dict[str, torch.Tensor]:
    blocks = -(-tokens // BLOCK)
    kv = (LAYERS, blocks, KV_HEADS, BLOCK, HEAD_DIM)
    return {"token_ids": torch.randint(0, 49152, (tokens,)),
            "kv.k": torch.randn(kv).to(torch.bfloat16), "kv.v": torch.randn(kv).to(torch.bfloat16),
            "state.queries": torch.randn(LAYERS, HEADS, FIFO, HEAD_DIM),
            "state.support": torch.randint(0, tokens, (LAYERS, HEADS, FIFO, TOP_K)),
            "state.tau": torch.randn(LAYERS, HEADS), "state.fill": torch.full((LAYERS,), FIFO)}


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(fn):
    """fn() -> (its result, seconds, peak resident bytes above the start, held bytes above the start)."""
    gc.collect()
    start, peak, done = resident(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    return out, seconds, max(peak[0], resident()) - start, resident() - start


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    import safetensors.torch

    from retopk_server.engine.safetensors_parts import payload_parts

    tensors = session_tensors(args.tokens)
    metadata = {"retopk": json.dumps({"messages": [{"role": "user", "content": "x" * 100}] * 100})}

    def parts():
        out = payload_parts(tensors, metadata)
        digest = hashlib.sha256()
        for part in out:
            digest.update(part)
        return out

    def library():
        out = safetensors.torch.save(tensors, metadata)
        hashlib.sha256(out).hexdigest()
        return out

    assert b"".join(parts()) == library()  # the same bytes
    runs: dict[str, list[tuple[float, int, int]]] = {"parts": [], "save": []}
    for i in range(args.rounds):
        for name, fn in ((("parts", parts), ("save", library)) if i % 2 else (("save", library), ("parts", parts))):
            out, seconds, peak, held = measured(fn)
            del out
            runs[name].append((seconds, peak, held))
    result = {"tokens": args.tokens, "payload_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
              "load_average": os.getloadavg()}
    for name, rows in runs.items():
        result[name] = {"median_s": statistics.median(r[0] for r in rows),
                        "median_peak_mib": statistics.median(r[1] for r in rows) / 2**20,
                        "median_held_mib": statistics.median(r[2] for r in rows) / 2**20}
    result["save_over_parts_time"] = result["save"]["median_s"] / result["parts"]["median_s"]
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
