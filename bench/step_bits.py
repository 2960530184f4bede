"""The whole decode step's bits, recorded by one build and compared with another's: every step's logits and path
statistics, and the session it leaves (tokens, KV cache, method state).

bench.kernel_bits covers the fused kernel's dense modes and the block products on random inputs. A change that must
keep every bit of ReTopK's sparse path (reuse / fallback / refresh, the FIFO, the thresholds and counters) or of
anything else in a decode step is checked here on the model itself: the embedded model (its GGUF weights as the
server serves them) greedy-decodes --steps tokens after the first --length tokens of the KJV, once per method of
--methods ("default" is the server's default method) at each torch thread count of --threads, each in a fresh
session. Record with the library before the change and with the library after it, each from its own checkout and
build, then compare: ``torch.equal``'s strictness and more, every tensor's bits (NaN, -0.0 included). Each record
must run its own checkout's packages, and an editable install puts one checkout's server/ on every checkout's path:
hence PYTHONPATH (``record`` warns when a package comes from elsewhere).

    (in the baseline checkout) PYTHONPATH=.:server:client python -m bench.step_bits record /tmp/before.pt
    (in the changed checkout)  PYTHONPATH=.:server:client python -m bench.step_bits record /tmp/after.pt
    python -m bench.step_bits compare /tmp/before.pt /tmp/after.pt   # exit status 1 when any bit differs

The record (torch.save) holds ``meta`` and ``runs``. ``runs["<method> <T>t"]`` per method and thread count:

    prefill_logits  (V,) float32          the logits after the prompt (the first token is their argmax)
    logits          (steps, V) float32    each decode step's logits (the next token is their argmax)
    path            (steps, layers, H)    each head's path code (retopk_core.methods.base.Path)
    max_sim         (steps, layers, H)    max cached-query cosine (NaN where the method has none)
    n_scored        (steps, layers, H)    keys scored with the exact query
    tokens          (length + steps,)     the exported session's token ids
    k, v            the exported session's KV cache, (layers, blocks, H_kv, block, d) in the cache's dtype
    state.<field>   the exported method state, (layers, *per-slot shape) (runtime/session_state.py)

``meta["settings"]`` (model, corpus, length, steps, methods as resolved, threads, weights, kv_dtype, activations as
the runner resolved them, the library's SIMD level) must be equal for two records to be compared: ``compare``
refuses (exit status 2) naming the first that differs. ``meta["source"]`` (the command, the checkout's commit, the
library's path, torch's version, the CPU, the packages imported from another checkout) is printed, not compared.
The bits also depend on the CPU: compare records made on the same machine. The defaults (the default method and
Full, 1K tokens, 256 steps, 1 and 2 threads) record in a few minutes and write a few hundred MB.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
from pathlib import Path as FsPath

import torch

from bench.e2e_cpu import parse_method
from bench.eval.common import load_corpus
from bench.provenance import checkout_commit, cpu_model
from retopk_core.models import DEFAULT_MODEL
from retopk_server.runtime import ModelRunner, RuntimeConfig
from retopk_server.runtime.runtime_config import ACTIVATION_CHOICES, KV_DTYPES, WEIGHTS

STEPWISE = ("logits", "path", "max_sim", "n_scored")  # a step's fields: dim 0 is the decode step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.step_bits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="decode with this checkout's build and write every step's bits")
    r.add_argument("path", type=FsPath)
    r.add_argument("--length", type=int, default=1024, help="prompt tokens (default: %(default)s)")
    r.add_argument("--steps", type=int, default=256, help="greedy decode steps (default: %(default)s)")
    r.add_argument("--methods", nargs="+", default=["default", "full"],
                   help='method specs "name[:key=value,...]", "default": the server\'s (default: %(default)s)')
    r.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads (default: %(default)s)")
    r.add_argument("--corpus", default="kjv", help="prompt text file, or 'kjv' (default)")
    r.add_argument("--model", default=DEFAULT_MODEL, help="model name or local checkpoint path")
    r.add_argument("--weights", default="auto", choices=WEIGHTS, help="RuntimeConfig.weights")
    r.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="RuntimeConfig.kv_dtype")
    r.add_argument("--activations", default="auto", choices=ACTIVATION_CHOICES, help="RuntimeConfig.activations")
    c = sub.add_parser("compare", help="compare two records bit for bit")
    c.add_argument("before", type=FsPath)
    c.add_argument("after", type=FsPath)
    return p.parse_args(argv)


def make_runner(args: argparse.Namespace, model=None, tokenizer=None) -> ModelRunner:
    """The runner a server with these options would hold, but without the prefix cache: each run's prompt is
    prefilled whole, as a fresh server's first one is, whichever run came before it. ``model``, ``tokenizer``: an
    already loaded transformers model to serve instead of loading ``args.model`` (ModelRunner's)."""
    return ModelRunner(RuntimeConfig(model=args.model, weights=args.weights, kv_dtype=args.kv_dtype,
                                     activations=args.activations, prefix_cache=False), model, tokenizer)


def prompt(runner: ModelRunner, corpus: str, length: int) -> list[int]:
    """The first ``length`` tokens of the corpus (about 4 characters a token: 8 per token is ample)."""
    ids = runner.encode(load_corpus(corpus)[:8 * length])[:length]
    if len(ids) < length:
        raise ValueError(f"corpus {corpus!r} has {len(ids)} tokens, fewer than --length {length}")
    return ids


@torch.inference_mode()
def decode_run(runner: ModelRunner, spec, ids: list[int], steps: int) -> dict[str, torch.Tensor]:
    """One fresh session of ``spec``: prefill ``ids``, ``steps`` greedy steps -> the fields of the module docstring."""
    session = runner.open_session(spec)
    try:
        first = runner.prefill(session, ids)  # (V,)
        tok, rows = int(first.argmax()), []
        for _ in range(steps):
            logits, stats = runner.decode([session], [tok], with_stats=True)
            rows.append((logits[0], stats[0].path, stats[0].max_sim, stats[0].n_scored))
            tok = int(logits[0].argmax())
        saved = runner.export_session(session)
    finally:
        runner.close_session(session)
    run = {"prefill_logits": first.clone()}
    for name, column in zip(STEPWISE, zip(*rows, strict=True), strict=True):
        run[name] = torch.stack(column)  # (steps, ...)
    run.update(tokens=saved.token_ids, k=saved.k, v=saved.v)
    run.update({f"state.{f}": t for f, t in (saved.state or {}).items()})
    return run


def record(runner: ModelRunner, ids: list[int], methods: list[str], threads: list[int],
           steps: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every method of ``methods`` at every thread count of ``threads`` -> runs by "<method> <T>t"."""
    before = torch.get_num_threads()
    runs = {}
    try:
        for text in methods:
            for t in threads:
                torch.set_num_threads(t)
                runs[f"{text} {t}t"] = decode_run(runner, parse_method(text), ids, steps)
    finally:
        torch.set_num_threads(before)
    return runs


def foreign_packages() -> list[str]:
    """The packages a record runs that are imported from outside this checkout (an editable install of another
    one puts its server/ on the path): "name from path" each."""
    import retopk_core
    import retopk_server

    root = FsPath(__file__).resolve().parents[1]
    found = ((m.__name__, FsPath(m.__file__).resolve().parent) for m in (retopk_core, retopk_server))
    return [f"{name} from {where}" for name, where in found if not where.is_relative_to(root)]


def meta(args: argparse.Namespace, runner: ModelRunner, argv: list[str]) -> dict[str, dict]:
    """settings: what the bits depend on besides the build (compared); source: where they came from (shown)."""
    from retopk_core.cpu import build, decoder_ops

    settings = {"model": args.model, "corpus": args.corpus, "length": args.length, "steps": args.steps,
                "methods": {text: parse_method(text).describe() for text in args.methods}, "threads": args.threads,
                "weights": runner.info.weight_format, "kv_dtype": runner.info.kv_dtype,
                "activations": runner.decoder.activations, "isa": decoder_ops.ISA_NAMES[decoder_ops.isa()]}
    source = {"command": "python -m bench.step_bits " + shlex.join(argv), "commit": checkout_commit(),
              "library": str(build.LIBRARY), "torch": str(torch.__version__), "cpu": cpu_model(),
              "host": platform.node(), "foreign": ", ".join(foreign_packages()) or None}
    return {"settings": settings, "source": source}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width (floats' bit patterns, so NaN equals NaN and -0.0 differs from 0.0)."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def field_difference(name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> str | None:
    """None when ``a`` and ``b`` are the same bits, else what differs: for a step's field the first differing step,
    how many steps differ, and for floats the largest |a - b| at that step."""
    if a is None or b is None:
        return f"{name} (in one record only)"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{name} ({a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)})"
    moved = as_bits(a) != as_bits(b)
    if not bool(moved.any()):
        return None
    if name not in STEPWISE:
        return name
    steps = moved.flatten(1).any(1).nonzero().flatten()  # (differing steps,)
    i = int(steps[0])
    size = ""
    if a.is_floating_point():
        size = f", max |a - b| {float((a[i].double() - b[i].double()).abs().nan_to_num(float('inf')).max()):.3g}"
    return f"{name} (first at step {i}, {steps.numel()} of {len(a)} steps{size})"


def run_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Each field of two runs whose bits differ, described by ``field_difference``, in the record's order."""
    names = list(dict.fromkeys([*a, *b]))
    found = (field_difference(n, a.get(n), b.get(n)) for n in names)
    return [d for d in found if d is not None]


def setting_difference(a: dict, b: dict) -> str | None:
    """The first setting two records do not share, named with both values; None when all match."""
    for key in dict.fromkeys([*a, *b]):
        if a.get(key) != b.get(key):
            return f"{key}: {a.get(key)!r} vs {b.get(key)!r}"
    return None


def compare(before: dict, after: dict) -> int:
    """Print each run's differing fields -> 0 when every bit is the same, 1 when some differ, 2 (nothing
    compared) when the records' settings differ."""
    for label, rec in (("before", before), ("after", after)):
        print(f"step_bits {label}: " + ", ".join(f"{k} {v}" for k, v in rec["meta"]["source"].items()))
    refused = setting_difference(before["meta"]["settings"], after["meta"]["settings"])
    if refused is not None:
        print(f"step_bits: the records' settings differ, not compared: {refused}")
        return 2
    bad = 0
    for run in dict.fromkeys([*before["runs"], *after["runs"]]):
        a, b = before["runs"].get(run), after["runs"].get(run)
        found = ["the run (in one record only)"] if a is None or b is None else run_differences(a, b)
        bad += bool(found)
        print(f"  {run}: " + ("differ: " + "; ".join(found) if found else f"same bits ({len(a)} fields)"))
    runs = len(set(before["runs"]) | set(after["runs"]))
    print(f"step_bits: {runs} runs, {bad} differ")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.command == "compare":
        return compare(torch.load(args.before), torch.load(args.after))
    from retopk_core.cpu import launch

    if not launch.available():
        print("step_bits: the fused CPU library is not built (python -m retopk_core.cpu.build): nothing to check")
        return 2
    for where in foreign_packages():
        print(f"step_bits: warning: {where}, not this checkout (run with PYTHONPATH=.:server:client)")
    runner = make_runner(args)
    ids = prompt(runner, args.corpus, args.length)
    runs = record(runner, ids, args.methods, args.threads, args.steps)
    torch.save({"meta": meta(args, runner, argv), "runs": runs}, args.path)
    print(f"step_bits: {len(runs)} runs of {args.steps} steps after {args.length} tokens -> {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
