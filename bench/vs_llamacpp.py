"""Decode speed against llama.cpp, the yardstick a CPU user would reach for, on the same GGUF file.

For each context length L the same prompt (the first L tokens of a text, tokenized by retopk's tokenizer;
the same token ids are fed to both engines) is prefilled and then decoded greedily, one token at a time,
with the same thread count, by:

- llama.cpp (llama-cpp-python, built from source with the machine's SIMD by ``make bench-llamacpp-deps``)
  on the model's GGUF file, flash attention off and on (its CPU flash attention can be the slower one);
- retopk's runner, once per method of ``--methods`` ("default": the server's default method), with the
  runtime options of ``--runtime KEY=VALUE`` (any ``RuntimeConfig`` field, e.g.
  ``weights=float32 kv_dtype=float32``).

The engines take turns in rounds (llama.cpp off, llama.cpp on, then the retopk methods; the machine's
speed drifts and turns spread the drift over all of them). In every turn an engine starts from an empty
cache, prefills the prompt (timed: prefill tokens/s), takes one untimed warm-up step and times
``--new-tokens`` greedy steps (each step's argmax included). Past the model's trained positions both
engines scale RoPE linearly by ``--rope-factor`` (llama.cpp ``rope_freq_scale = 1/factor``, retopk
``rope_scaling={"rope_type": "linear", "factor": factor}``).

Reported per length, as soon as it is measured: ms per generated token (median over rounds, min-max),
prefill tokens/s (median), the yardstick (the better of llama.cpp's two settings) and each engine's ratio
to it (llama.cpp best ms / ms: above 1 is faster than llama.cpp), and the weight-read floor: the bytes of
weights one decode step reads (the GGUF's tensors for llama.cpp; the runner's model for retopk) over this
machine's read bandwidth, measured in the same run with a ``torch.sum`` over a buffer four times the L3
cache ("DRAM"), and over a buffer the size of the weights themselves ("cached": what a step could reach
when the weights stay in the cache). "same tokens" counts the leading greedy tokens equal to the
yardstick's (a check that both engines ran the same model on the same prompt; rounding may flip a near-tie).

    make bench-llamacpp-deps   # once: llama-cpp-python 0.3.36 from source into the venv (5-15 min on 2 cores)
    python -m bench.vs_llamacpp --out docs/bench/vs_llamacpp
    python -m bench.vs_llamacpp --lengths 1024 --rounds 1 --new-tokens 4          # a quick check
    python -m bench.vs_llamacpp --methods full default --runtime weights=float32 kv_dtype=float32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path as FsPath
from typing import TYPE_CHECKING

from bench.provenance import checkout_commit, cpu_model
from retopk_core.hugepages import enable_transparent_hugepages
from retopk_core.models import DEFAULT_MODEL

# torch and what imports it load inside the functions: main() first asks for huge pages, which must
# precede torch's first allocation (retopk_core/hugepages.py), and importing this module changes nothing.
if TYPE_CHECKING:
    from retopk_server.runtime import ModelRunner

DEFAULT_LENGTHS = [1024, 4096, 8000, 16384, 32000]
DEFAULT_METHODS = ["full", "default"]
BUILD_HINT = ("llama.cpp's Python binding is not importable in this environment ({error}). Build it into the "
              "project venv (llama-cpp-python 0.3.36 from source with -DGGML_NATIVE=ON, 5-15 minutes on "
              "2 cores; benchmark only, never part of `make test`):\n    make bench-llamacpp-deps")
# Fields of RuntimeConfig this script sets itself (the model, the RoPE scaling per length, the method).
OWN_RUNTIME_FIELDS = ("model", "rope_scaling", "default_method")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="an embedded model name or a .gguf file: the one file both engines load (default: %(default)s)")
    p.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS,
                   help="context lengths (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens timed per engine, length and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds in which the engines take turns")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                   help='retopk method specs "name[:key=value,...]", "default" = the server\'s default method '
                        "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="threads of both engines (default: %(default)s)")
    p.add_argument("--runtime", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="retopk RuntimeConfig options, e.g. weights=int4 kv_dtype=bfloat16 (values parsed as the "
                        f"server's key=value options; {', '.join(OWN_RUNTIME_FIELDS)} are set by this script)")
    p.add_argument("--rope-factor", type=float, default=4.0,
                   help="linear RoPE factor of both engines at lengths past the model's trained positions "
                        "(default: %(default)s)")
    p.add_argument("--flash-attn", choices=["both", "off", "on"], default="both",
                   help="llama.cpp's attention settings to run (default: both, the faster is the yardstick; one "
                        "halves llama.cpp's share of a long run, e.g. off at 32K where it was the faster at 1K-16K)")
    p.add_argument("--corpus", default="kjv", help="prompt text file, or 'kjv' for the King James Bible (default)")
    p.add_argument("--out", type=FsPath, default=None, help="write <out>.json (after every length) and <out>.png")
    p.add_argument("--check", action="store_true",
                   help="only check that llama.cpp runs here: prefill and decode a few tokens of --model with both "
                        "attention settings, print its CPU features (make bench-llamacpp-deps runs this after "
                        "building; a build whose kernels this CPU cannot run crashes here)")
    args = p.parse_args(argv)
    for name in ("new_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.lengths) < 2:
        p.error("--lengths must be at least 2")
    if args.rope_factor < 1:
        p.error("--rope-factor must be at least 1")
    try:
        args.runtime_options = parse_runtime(args.runtime) if args.runtime else {}
    except ValueError as e:
        p.error(str(e))
    return args


def parse_runtime(pairs: list[str]) -> dict:
    """["weights=float32", "backend=cpu"] -> RuntimeConfig keyword arguments (values parsed as the server's
    key=value options). Any field of RuntimeConfig but those this script sets; ValueError otherwise."""
    from retopk_server.runtime import RuntimeConfig
    from retopk_shared.name_value import parse_params

    fields = {f.name for f in dataclasses.fields(RuntimeConfig)} - set(OWN_RUNTIME_FIELDS)
    options = {}
    for pair in pairs:
        parsed = parse_params(pair)  # ValueError on anything but NAME=VALUE
        for key in parsed:
            if key not in fields:
                raise ValueError(f"--runtime {key}: not a RuntimeConfig option this script passes on "
                                 f"(one of {', '.join(sorted(fields))})")
        options.update(parsed)
    return options


# ---- arithmetic (pure) ---------------------------------------------------------------------------
def positions_needed(length: int, new_tokens: int) -> int:
    """Positions one turn uses: the prompt, the warm-up step and the timed steps."""
    return length + 1 + new_tokens


def rope_factor(needed: int, trained: int, factor: float) -> float | None:
    """The linear RoPE factor a turn needing ``needed`` positions runs with: None within the model's
    ``trained`` positions, else ``factor``; ValueError when even that does not reach."""
    if needed <= trained:
        return None
    if needed > trained * factor:
        raise ValueError(f"{needed} positions exceed the model's {trained} trained positions x RoPE factor {factor}")
    return float(factor)


def floor_ms(weight_bytes: int, bandwidth: float) -> float:
    """The weight-read floor of one decode step: every weight read once at ``bandwidth`` bytes/s."""
    return 1e3 * weight_bytes / bandwidth


def summarize(L: int, label: str, engine: str, step_ms: list[float], prefill_s: list[float], tokens: list[int],
              **extra) -> dict:
    """One engine's row at one length from its rounds: ``step_ms`` the mean ms per generated token of each
    round, ``prefill_s`` each round's prefill seconds, ``tokens`` the greedy tokens of the first round."""
    prefill = [L / s for s in prefill_s]
    return {"L": L, "label": label, "engine": engine, "ms_per_token": statistics.median(step_ms),
            "ms_min": min(step_ms), "ms_max": max(step_ms), "ms_rounds": list(step_ms),
            "prefill_tok_s": statistics.median(prefill), "prefill_rounds_tok_s": prefill, "tokens": list(tokens),
            **extra}


def compare(rows: list[dict], bandwidth: float | None = None, cached: dict | None = None) -> list[dict]:
    """Fill in, for the rows of ONE length, the yardstick (the llama.cpp row with the lowest ms/token) and
    each row's ratios to it: ``vs_llamacpp`` = yardstick ms / the row's ms (above 1: faster than llama.cpp),
    ``prefill_vs_llamacpp`` = the row's prefill tokens/s / llama.cpp's best, ``same_tokens`` against the
    yardstick's tokens. With ``bandwidth`` (bytes/s, DRAM) each row with ``weight_bytes`` gets ``floor_ms``
    and ``x_floor`` (ms / floor); ``cached`` maps weight_bytes -> the bandwidth measured over a buffer that
    size (``floor_cached_ms``). Returns the rows, updated in place."""
    from retopk_server.engine.turn import common_prefix  # torch-free; kept out of import time as the rest
    llama = [r for r in rows if r["engine"] == "llama.cpp"]
    best = min(llama, key=lambda r: r["ms_per_token"]) if llama else None
    best_prefill = max((r["prefill_tok_s"] for r in llama), default=None)
    for r in rows:
        r["yardstick"] = best["label"] if best else None
        r["yardstick_ms"] = best["ms_per_token"] if best else None
        r["vs_llamacpp"] = best["ms_per_token"] / r["ms_per_token"] if best else None
        r["prefill_vs_llamacpp"] = r["prefill_tok_s"] / best_prefill if best_prefill else None
        r["same_tokens"] = common_prefix(r["tokens"], best["tokens"]) if best else None
        wb = r.get("weight_bytes")
        if wb and bandwidth:
            r["floor_ms"] = floor_ms(wb, bandwidth)
            r["x_floor"] = r["ms_per_token"] / r["floor_ms"]
        if wb and cached and cached.get(wb):
            r["floor_cached_ms"] = floor_ms(wb, cached[wb])
    return rows


def _num(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def table(rows: list[dict]) -> str:
    """Markdown: one line per (length, engine)."""
    lines = ["| L | engine | ms/token (median) | min-max | prefill tok/s | decode vs llama.cpp best "
             "| prefill vs llama.cpp best | weights MB | read floor ms (DRAM / cached) | x floor (DRAM) "
             "| same tokens |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        wb = r.get("weight_bytes")
        floors = f"{_num(r.get('floor_ms'), '.1f')} / {_num(r.get('floor_cached_ms'), '.1f')}"
        same = "-" if r.get("same_tokens") is None else f"{r['same_tokens']}/{len(r['tokens'])}"
        lines.append(f"| {r['L']} | {r['label']} | {r['ms_per_token']:.1f} | {r['ms_min']:.1f}-{r['ms_max']:.1f} "
                     f"| {r['prefill_tok_s']:.0f} | {_num(r.get('vs_llamacpp'), '.2f', 'x')} "
                     f"| {_num(r.get('prefill_vs_llamacpp'), '.2f', 'x')} | {_num(wb and wb / 1e6, '.1f')} "
                     f"| {floors} | {_num(r.get('x_floor'), '.2f', 'x')} | {same} |")
    return "\n".join(lines)


# ---- the machine ---------------------------------------------------------------------------------
def l3_bytes(default: int = 64 << 20) -> int:
    """The L3 (last-level) cache size from sysfs, or ``default`` where it is not there."""
    base = FsPath("/sys/devices/system/cpu/cpu0/cache")
    sizes = []
    for index in base.glob("index*"):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes) if sizes else default


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a ``torch.sum`` over a float32 buffer of ``nbytes`` (best of ``repeats``, after one
    untimed pass), with torch's current thread count."""
    import torch

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    torch.sum(buf)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.sum(buf)
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def dram_bandwidth() -> float:
    """Read bandwidth over a buffer of four times the L3 cache (at least 1 GiB): from memory, not cache."""
    return read_bandwidth(max(1 << 30, 4 * l3_bytes()))


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of weights one decode step of the runner reads, as the runner reports them (every matmul's
    weights in their format, the LM head included, and the norms)."""
    return int(runner.info.weight_bytes)


def openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; [] elsewhere)."""
    try:
        maps = FsPath("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1] and "/" in line})


def gguf_facts(path: FsPath) -> tuple[int, int]:
    """(bytes of the GGUF file's tensors, the model's trained context length) from its header. Every
    tensor is read per step (SmolLM2's output layer is its token embedding)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    return sum(int(t.n_bytes) for t in reader.tensors), int(reader.fields[f"{arch}.context_length"].contents())


def gguf_path(model: str) -> FsPath:
    """The GGUF file of an embedded model name or a .gguf path; SystemExit for a transformers checkpoint."""
    from retopk_core.models import resolve_model

    source = resolve_model(model)
    if source.gguf_file is None:
        raise SystemExit(f"--model {model!r} is a transformers checkpoint; llama.cpp needs a .gguf file")
    return FsPath(source.path) / source.gguf_file


def import_llama_cpp():
    """The llama_cpp module, or SystemExit(2) saying how to build it."""
    try:
        import llama_cpp
    except ImportError as e:
        print(BUILD_HINT.format(error=e), flush=True)
        raise SystemExit(2) from None
    return llama_cpp


# ---- the engines ---------------------------------------------------------------------------------
@dataclass
class Turn:
    """One engine's turn: prefill seconds, the seconds of each timed step, the greedy tokens (the one
    after the prompt, the warm-up step's, then the timed steps')."""

    prefill_s: float
    step_s: list[float]
    tokens: list[int]


class LlamaCppEngine:
    """llama.cpp on one GGUF file at one context size and flash-attention setting."""

    engine = "llama.cpp"

    def __init__(self, llama_cpp, path: FsPath, threads: int, n_ctx: int, flash_attn: bool,
                 rope: float | None) -> None:
        import numpy as np

        self.lib, self.np = llama_cpp, np
        self.label = f"llama.cpp flash_attn={'on' if flash_attn else 'off'}"
        kwargs = {"rope_freq_scale": 1.0 / rope} if rope else {}  # 0 (the default) = the model's own
        self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   flash_attn=flash_attn, logits_all=False, verbose=False, **kwargs)
        self.n_vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        # With logits_all=False eval() keeps no logits: read the last token's row of the context directly.
        row = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self.np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax())

    def turn(self, prompt: list[int], n: int) -> Turn:
        llm = self.llm
        llm.reset()  # n_tokens = 0: the next eval() drops every cached position
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = self._argmax()
        prefill = time.perf_counter() - t0
        tokens, steps = [tok], []
        for i in range(n + 1):  # the first step warms up
            t0 = time.perf_counter()
            llm.eval([tok])
            tok = self._argmax()
            if i:
                steps.append(time.perf_counter() - t0)
            tokens.append(tok)
        return Turn(prefill, steps, tokens)

    def close(self) -> None:
        self.llm.close()


class RetopkEngine:
    """One retopk method through the runner: a fresh session per turn."""

    engine = "retopk"

    def __init__(self, runner: ModelRunner, spec, label: str) -> None:
        self.runner, self.spec, self.label = runner, spec, label

    def turn(self, prompt: list[int], n: int) -> Turn:
        runner = self.runner
        session = runner.open_session(self.spec)
        try:
            t0 = time.perf_counter()
            logits = runner.prefill(session, prompt)
            tok = int(logits.argmax())
            prefill = time.perf_counter() - t0
            tokens, steps = [tok], []
            for i in range(n + 1):  # the first step warms up
                t0 = time.perf_counter()
                logits, _ = runner.decode([session], [tok])
                tok = int(logits[0].argmax())
                if i:
                    steps.append(time.perf_counter() - t0)
                tokens.append(tok)
        finally:
            runner.close_session(session)
        return Turn(prefill, steps, tokens)

    def close(self) -> None:
        pass


def check_llama_cpp(model: str, threads: int) -> None:
    """Prefill 32 tokens and decode 2 with llama.cpp on ``model``'s GGUF, flash attention off and on."""
    llama_cpp = import_llama_cpp()
    path = gguf_path(model)
    for flash_attn in (False, True):
        engine = LlamaCppEngine(llama_cpp, path, threads, 64, flash_attn, None)
        try:
            engine.turn(list(range(100, 132)), 2)
        finally:
            engine.close()
    print(f"llama.cpp {llama_cpp.__version__} prefills and decodes {path.name} here "
          f"({llama_cpp.llama_print_system_info().decode(errors='replace').strip()})", flush=True)


def measure(L: int, engines: list, prompt: list[int], n: int, rounds: int, progress=None,
            weights: dict | None = None) -> list[dict]:
    """The engines take turns on ``prompt`` for ``rounds`` rounds -> one summarized row per engine (in
    order). ``weights``: engine label -> weight bytes a step reads. ``progress`` advances once per turn."""
    turns: list[list[Turn]] = [[] for _ in engines]
    for _ in range(rounds):
        for i, e in enumerate(engines):
            turns[i].append(e.turn(prompt, n))
            if progress is not None:
                progress.update(1)
    rows = []
    for e, ts in zip(engines, turns, strict=True):
        extra = {"weight_bytes": weights[e.label]} if weights and e.label in weights else {}
        if hasattr(e, "spec"):
            extra["method"] = e.spec.describe()
        rows.append(summarize(L, e.label, e.engine, [1e3 * sum(t.step_s) / len(t.step_s) for t in ts],
                              [t.prefill_s for t in ts], ts[0].tokens, **extra))
    return rows


# ---- the run -------------------------------------------------------------------------------------
def make_runner(args, spec, rope: float | None) -> ModelRunner:
    """retopk's runner with --runtime's options, RoPE scaled linearly by ``rope`` (None: not scaled)."""
    from retopk_server.runtime import ModelRunner, RuntimeConfig

    scaling = {"rope_type": "linear", "factor": rope} if rope else None
    return ModelRunner(RuntimeConfig(model=args.model, default_method=spec, rope_scaling=scaling,
                                     **args.runtime_options))


def runtime_line(options: dict, runner: ModelRunner) -> str:
    """The header's line on retopk's runner: --runtime's options, then the weights' formats, the KV cache, the block
    products' activations and the backend, each named once (the weights by matmul_format: weight_format, the JSON's
    retopk_weights, ends with the activations where they are not float32)."""
    return (f"#   retopk runtime {options or 'defaults'}: weights {runner.decoder.matmul_format}, KV cache "
            f"{runner.info.kv_dtype}, activations {runner.decoder.activations}, backend {runner.info.backend}")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.check:
        check_llama_cpp(args.model, args.threads)
        return []
    load_before = os.getloadavg()[0]  # other processes' share of the cores, before this one loads anything
    enable_transparent_hugepages()  # before torch is imported: see retopk_core/hugepages.py
    import gc

    import torch

    # After torch: a process holds one libgomp.so.1, the first loaded, and so retopk runs on torch's own
    # OpenMP runtime as in its server (llama.cpp's OpenMP calls then go to it too: meta "openmp").
    llama_cpp = import_llama_cpp()  # before minutes of loading: say how to build it, exit 2

    from bench.e2e_cpu import parse_method, plot
    from bench.eval.common import load_corpus, progress_bar

    torch.set_num_threads(args.threads)
    methods = [(text, parse_method(text)) for text in args.methods]
    path = gguf_path(args.model)
    gguf_bytes, trained = gguf_facts(path)
    try:
        ropes = {L: rope_factor(positions_needed(L, args.new_tokens), trained, args.rope_factor) for L in args.lengths}
    except ValueError as e:
        raise SystemExit(f"--lengths: {e}") from None
    runner, runner_rope = make_runner(args, methods[0][1], ropes[args.lengths[0]]), ropes[args.lengths[0]]
    ids = runner.encode(load_corpus(args.corpus)[:8 * max(args.lengths)], add_special_tokens=False)  # ~4 chars a token
    if len(ids) < max(args.lengths):
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than the longest length {max(args.lengths)}")
    meta = {"command": "python -m bench.vs_llamacpp " + shlex.join(sys.argv[1:] if argv is None else argv),
            "commit": checkout_commit(), "model": args.model, "gguf": str(path), "gguf_tensor_bytes": gguf_bytes,
            "trained_positions": trained, "threads": args.threads, "rounds": args.rounds,
            "new_tokens": args.new_tokens, "methods": {t: s.describe() for t, s in methods},
            "runtime": args.runtime_options, "llama_cpp": llama_cpp.__version__,
            "llama_cpp_system": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            "torch": torch.__version__, "cpu": cpu_model(), "l3_bytes": l3_bytes(), "host": platform.node(),
            "load_average_before": load_before, "cores": os.cpu_count(), "openmp": openmp_runtimes(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "retopk_weights": runner.info.weight_format, "retopk_kv_dtype": runner.info.kv_dtype,
            "retopk_activations": runner.decoder.activations, "retopk_backend": runner.info.backend}
    print(f"# vs_llamacpp: {path.name} ({gguf_bytes / 1e6:.1f} MB of tensors, {trained} trained positions), "
          f"{args.threads} threads, {args.rounds} rounds of {args.new_tokens} tokens", flush=True)
    print(runtime_line(args.runtime_options, runner), flush=True)
    print(f"#   llama.cpp {llama_cpp.__version__} ({meta['llama_cpp_system']})", flush=True)
    for text, spec in methods:
        print(f"#   retopk {text} = {spec.describe()}", flush=True)
    if load_before > 0.5:
        print(f"# WARNING: load average {load_before:.2f} before the run on {os.cpu_count()} cores: other processes "
              "compete for the cores, and these timings are not an idle machine's (llama.cpp's threads wait on "
              "each other at every operation, so it loses most)", flush=True)
    if (meta["omp_wait_policy"] or "").upper() == "PASSIVE":  # `make test` sets it; a shell may keep it
        print("# WARNING: OMP_WAIT_POLICY=PASSIVE: both engines' OpenMP threads sleep between operations instead of "
              "spinning, which slows llama.cpp's decode most (its threads meet at every operation), "
              "retopk's less: unset it for the yardstick (history.md, 2026-12-06, session 21)", flush=True)
    rows: list[dict] = []

    def save() -> None:  # after every length, so a stopped run keeps what it measured
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))

    settings = {"both": (False, True), "off": (False,), "on": (True,)}[args.flash_attn]  # llama.cpp's flash_attn
    bar = progress_bar(len(args.lengths) * args.rounds * (len(settings) + len(methods)), "vs_llamacpp")
    with bar:
        for L in args.lengths:
            rope = ropes[L]
            if rope != runner_rope:
                runner = None
                gc.collect()
                runner, runner_rope = make_runner(args, methods[0][1], rope), rope
            n_ctx = L + args.new_tokens + 16
            engines = [LlamaCppEngine(llama_cpp, path, args.threads, n_ctx, fa, rope) for fa in settings]
            engines += [RetopkEngine(runner, spec, f"retopk {text}") for text, spec in methods]
            try:
                bandwidth = dram_bandwidth()
                retopk_bytes = weight_bytes(runner)
                cached = {b: read_bandwidth(b) for b in {gguf_bytes, retopk_bytes}}
                weights = {e.label: gguf_bytes if e.engine == "llama.cpp" else retopk_bytes for e in engines}
                with torch.inference_mode():
                    length_rows = measure(L, engines, ids[:L], args.new_tokens, args.rounds, bar, weights)
            finally:
                for e in engines:
                    e.close()
            load = os.getloadavg()[0]  # this run's threads included
            for r in length_rows:
                r["rope_factor"], r["load_average"] = rope, load
            compare(length_rows, bandwidth, cached)
            rows.extend(length_rows)
            scaled = f"RoPE linear x{rope:g}" if rope else "RoPE as trained"
            bar.write(f"\n## L = {L} ({scaled}; read bandwidth {bandwidth / 1e9:.1f} GB/s from DRAM, "
                      + ", ".join(f"{cached[b] / 1e9:.1f} GB/s over {b / 1e6:.0f} MB" for b in sorted(cached))
                      + f"; load average {load:.1f} with this run's {args.threads} threads; "
                      f"yardstick {length_rows[0]['yardstick']})\n" + table(length_rows))
            save()
    print("\n" + table(rows))
    if args.out:
        plot(rows, args.out.with_suffix(".png"))
    return rows


if __name__ == "__main__":
    main()
