"""Record ReTopK's per-head decisions on a real model, for the replay pattern of bench.attention_cpu.

Runs the model (default the embedded SmolLM2-135M: 30 layers, 9 query heads in 3 KV groups of 3)
with the server's default method (``retopk_server.runtime.runtime_config.DEFAULT_METHOD_PARAMS``) and the
paper's per-head policy (gqa_policy = "head"), ``--params`` on top, over a passage of text: the first
--context tokens are prefilled densely, then --steps decode steps are fed the passage's next tokens
(teacher forcing: the model reads natural text, as in the perplexity evaluation; ``--greedy`` feeds its
own argmax instead, which on a small model tends to loop and so flatters reuse). For each (step, layer, head) the max
cached-query similarity and the path taken are written to a compact JSON file:

    meta      the model's shape, the method's hyperparameters, the passage, the command, the seconds
    paths     {code: name} of the path codes (retopk_core.methods.base.Path)
    max_sim   [step][layer][head] float, 4 decimals (null where the method had none)
    path      [step][layer] a string of one path code digit per head

    python -m bench.record_paths --context 4096 --steps 128 --out docs/bench/paths_smollm2_kjv.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path as FsPath

import torch

from bench.eval.common import load_corpus, progress_bar, split_documents
from retopk_core.methods.base import FULL_READ_PATHS, PATH_NAMES, group_reads
from retopk_core.models import DEFAULT_MODEL
from retopk_server.cli import parse_params  # the server's key=value grammar
from retopk_server.config import ServerConfig
from retopk_server.runtime import MethodSpec, ModelRunner, RuntimeConfig

DEFAULT_OUT = FsPath("docs/bench/paths_smollm2_kjv.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or a local checkpoint path")
    p.add_argument("--corpus", default="kjv", help="text file, or 'kjv' for the King James Bible (default)")
    p.add_argument("--start", type=int, default=0,
                   help="character offset of the passage in the text (it starts at the next line break)")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens prefilled before the first step")
    p.add_argument("--steps", type=int, default=128, help="decode steps recorded")
    p.add_argument("--greedy", action="store_true", help="feed the model's argmax instead of the passage's tokens")
    p.add_argument("--params", type=parse_params, default={},
                   help='method hyperparameters over the server default, e.g. "tau_calibration=0.85"')
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch default)")
    p.add_argument("--out", type=FsPath, default=DEFAULT_OUT, help="JSON file written (default: %(default)s)")
    return p.parse_args(argv)


def method_spec(params: dict | None = None) -> MethodSpec:
    """The server's default method with the paper's per-head GQA policy spelled out, ``params`` on top."""
    server = ServerConfig()
    return MethodSpec.of(server.method, **{**server.method_params, "gqa_policy": "head", **(params or {})})


@torch.inference_mode()
def record(runner: ModelRunner, spec: MethodSpec, ids: list[int], context: int, steps: int, greedy: bool,
           progress=None) -> tuple[list, list]:
    """Prefill ids[:context], decode ``steps`` tokens -> (max_sim, path) lists of (layers, heads) tensors."""
    session = runner.open_session(spec)
    sims, paths = [], []
    try:
        logits = runner.prefill(session, ids[:context])
        for j in range(steps):
            tok = int(logits.argmax()) if greedy else ids[context + j]
            out, stats = runner.decode([session], [tok], with_stats=True)
            logits = out[0]
            sims.append(stats[0].max_sim.float())
            paths.append(stats[0].path.to(torch.int8))
            if progress is not None:
                progress.update(1)
    finally:
        runner.close_session(session)
    return sims, paths


def encode_recording(sims: list, paths: list, meta: dict) -> dict:
    def num(x: float):
        return round(x, 4) if math.isfinite(x) else None

    return {"meta": meta, "paths": {str(k): v for k, v in PATH_NAMES.items()},
            "max_sim": [[[num(x) for x in row] for row in s.tolist()] for s in sims],
            "path": [["".join(str(c) for c in row) for row in p.tolist()] for p in paths]}


def summary(paths: torch.Tensor, num_kv_heads: int) -> str:
    """paths (steps, layers, heads) -> the path mix, the per-head exact share and the group-read rate."""
    total = paths.numel()
    mix = ", ".join(f"{PATH_NAMES[int(c)]} {100 * int(n) / total:.1f}%"
                    for c, n in zip(*torch.unique(paths.long(), return_counts=True), strict=True))
    exact = sum((paths == p).sum() for p in FULL_READ_PATHS) / total
    groups = group_reads(paths, num_kv_heads).float()  # (steps, layers, H_kv)
    by_layer = " ".join(f"{100 * x:.0f}" for x in groups.mean((0, 2)).tolist())
    return (f"paths: {mix}\nheads on an exact path: {100 * float(exact):.1f}%; group-read rate "
            f"{100 * float(groups.mean()):.1f}%\ngroup-read rate by layer (%): {by_layer}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    spec = method_spec(args.params)
    runner = ModelRunner(RuntimeConfig(model=args.model, default_method=spec))
    info = runner.info
    loaded = time.time()
    text = load_corpus(args.corpus)
    start = text.find("\n", args.start) + 1 if args.start else 0
    n = args.context + args.steps
    ids = split_documents(text[start:], lambda s: runner.encode(s, add_special_tokens=False), 1, n)[0]
    print(f"# record_paths: {info.name}, {info.num_layers} layers, {info.num_heads} heads in {info.num_kv_heads} "
          f"KV groups; {spec.name} {dict(spec.params)}; {args.context} + {args.steps} tokens; "
          f"{torch.get_num_threads()} threads (model loaded in {loaded - started:.0f} s)", flush=True)
    with progress_bar(args.steps, "record_paths") as bar:
        sims, paths = record(runner, spec, ids, args.context, args.steps, args.greedy, bar)
    method = spec.build().describe()
    if method.get("refresh_every") and args.steps > method["refresh_every"]:
        print(f"note: steps past {method['refresh_every']} include scheduled refreshes", flush=True)
    meta = {"command": "python -m bench.record_paths " + shlex.join(sys.argv[1:] if argv is None else argv),
            "model": info.name, "layers": info.num_layers, "heads": info.num_heads, "kv_heads": info.num_kv_heads,
            "head_dim": info.head_dim, "method": method, "corpus": args.corpus, "start_char": start,
            "context": args.context, "steps": args.steps, "fed": "argmax" if args.greedy else "passage",
            "passage_head": runner.decode_tokens(ids[:24]), "torch_threads": torch.get_num_threads(),
            "host": platform.node(), "seconds": round(time.time() - started, 1)}
    rec = encode_recording(sims, paths, meta)
    print(summary(torch.stack(paths), info.num_kv_heads))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e3:.0f} kB) in {meta['seconds']:.0f} s")
    return rec


if __name__ == "__main__":
    main()
