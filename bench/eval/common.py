"""What the evaluation scripts share: the corpus, documents, the runner, method specs, batched
teacher forcing and greedy answering, the path mix, and writing results (markdown + JSON + PNG).

Every method of a run decodes in the SAME forward: one session per method, all fed the same token on
a teacher-forced step (the runner groups rows by method), so methods see identical inputs and the
model's dense work is shared.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.eval import corpora
from retopk_core.methods.base import PATH_NAMES, group_reads
from retopk_core.methods.base import Path as StepPath
from retopk_core.models import DEFAULT_MODEL
from retopk_server.runtime.runtime_config import ACTIVATION_CHOICES, DEFAULT_METHOD_PARAMS, KV_DTYPES, WEIGHTS
from retopk_shared.name_value import parse_params

KJV = corpora.KJV  # the default corpus


# ---- corpus -------------------------------------------------------------------------------------
def load_corpus(corpus: str | None) -> str:
    """A corpus name of ``bench.eval.corpora`` (None: the KJV) or a UTF-8 text file path -> its text."""
    return corpora.load(corpus)


def split_documents(text: str, encode, n_docs: int, length: int) -> list[list[int]]:
    """n_docs documents of exactly ``length`` tokens, deterministic.

    The text is cut into n_docs equal character spans; document i is the first ``length`` tokens of
    span i, starting at its first line break (so no document starts mid-verse). A span too short for
    ``length`` tokens wraps around into the following text. ``encode(str) -> list[int]``.
    """
    if n_docs <= 0 or length <= 0:
        raise ValueError("n_docs and length must be positive")
    span = len(text) // n_docs
    docs = []
    for i in range(n_docs):
        start = i * span
        nl = text.find("\n", start)
        start = nl + 1 if 0 <= nl < start + span else start
        chars = 6 * length  # ~4 chars a token in English; grow if that was not enough
        while True:
            piece = text[start:start + chars]
            if start + chars > len(text):
                piece += "\n" + text[:start + chars - len(text)]
            ids = encode(piece)
            if len(ids) >= length or chars > 8 * len(text):
                break
            chars *= 2
        if len(ids) < length:
            raise SystemExit(f"the corpus has fewer than {length} tokens")
        docs.append(ids[:length])
    return docs


# ---- model and runner ----------------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="embedded model name or a local transformers checkpoint dir / .gguf file")
    g.add_argument("--device", default="cpu")
    g.add_argument("--weights", default="float32", choices=WEIGHTS,
                   help="matmul weight format (RuntimeConfig.weights; float32 = the dequantized reference model; "
                        "the server's auto is as-stored on a CPU)")
    g.add_argument("--kv-dtype", default="float32", choices=KV_DTYPES,
                   help="KV cache dtype (RuntimeConfig.kv_dtype; the server's auto: float16 on a CPU, bfloat16 on "
                        "CUDA)")
    g.add_argument("--activations", default="float32", choices=ACTIVATION_CHOICES,
                   help="the block products' activations (RuntimeConfig.activations; the server's --activations, "
                        "whose default is auto). float32 by default, unlike the server and the timing benches: an "
                        "evaluation's reference is the float32 model, and the recorded block-weight runs that name "
                        "no --activations (docs/bench/ppl_weights_as_stored_kv_bfloat16.json) were float32's; "
                        "the results' weights show any other")
    g.add_argument("--backend", default="torch", choices=["torch", "triton", "cpu"])
    g.add_argument("--rope-scaling", default=None, metavar="TYPE:FACTOR",
                   help="extend the context past the model's positions, e.g. linear:4 or yarn:8")
    g.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (0 = torch default). 1 by default: on a shared machine more threads "
                        "than free cores make every step many times slower")
    g.add_argument("--corpus", default=KJV, help=f"documents and haystacks: {', '.join(corpora.CORPORA)} (Debian "
                   "packages, bench/eval/corpora.py) or a UTF-8 text file (default: kjv)")


# The evaluations' shared budget K: the server's default K (defined once, in the server's runtime config).
DEFAULT_TOP_K = DEFAULT_METHOD_PARAMS["top_k"]


def add_method_args(p: argparse.ArgumentParser, default_methods: str) -> None:
    g = p.add_argument_group("methods")
    g.add_argument("--methods", default=default_methods,
                   help="comma-separated method names, each optionally with parameters after a colon and "
                        "separated by '+': e.g. 'full,exact_topk,retopk,retopk:tau=0.9+refresh_every=32'")
    g.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                   help="shared active-token budget K of every sparse method (default: the server's; paper: 512 "
                        "at 16K-128K; 64 keeps K/L at 1/32..1/128 for 2K-8K contexts)")


def add_batch_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=0,
                   help="methods decoded per forward (0 = all): each session holds its own KV cache (SmolLM2 at "
                        "8K: about 0.4 GB), so this bounds memory; the batches of a document share its prefill")


def eval_parser(doc: str, default_methods: str | None = None, batch: bool = False) -> argparse.ArgumentParser:
    """The parser an evaluation script starts from: the model options, then --methods / --top-k (with
    ``default_methods``), then --batch (``batch``); the script adds its own options."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    if default_methods is not None:
        add_method_args(p, default_methods)
    if batch:
        add_batch_arg(p)
    return p


def start_run(args, runner=None) -> tuple[object, float]:
    """(runner, start time): ``runner`` when a caller passes one (the suite shares it), else --model's."""
    started = time.time()
    return runner or make_runner(args), started


def corpus_documents(args, runner, n_docs: int, lengths: list[int]) -> dict[int, list[list[int]]]:
    """{L: ``n_docs`` documents of L tokens} from --corpus (``split_documents`` over ``load_corpus``)."""
    text = load_corpus(args.corpus)
    return {L: split_documents(text, lambda s: runner.encode(s, add_special_tokens=False), n_docs, L)
            for L in lengths}


def make_runner(args):
    """A ModelRunner from the parsed --model/--device/--weights/--kv-dtype/--activations/--backend/--rope-scaling
    options."""
    from retopk_server.runtime import ModelRunner, RuntimeConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    rope = None
    if args.rope_scaling:
        kind, _, factor = args.rope_scaling.partition(":")
        rope = {"rope_type": kind, "factor": float(factor or 1)}
    return ModelRunner(RuntimeConfig(model=args.model, device=args.device, weights=args.weights,
                                     kv_dtype=args.kv_dtype, activations=args.activations, backend=args.backend,
                                     rope_scaling=rope))


# ---- methods -------------------------------------------------------------------------------------
def method_defaults(name: str, top_k: int, head_dim: int) -> dict:
    """Parameters of each method at the shared budget K, scaled from the paper's K = 512, d = 128:
    StreamingLLM 64 sinks + 448 recent -> K/8 sinks; TokenSelect 64 initial + 416 selected + 32 local ->
    K/8 + K/16 local; Loki rank 64 of d = 128 -> d/2; Quest pages of 16 (at most K)."""
    K = top_k
    return {"full": {}, "exact_topk": {"top_k": K}, "retopk": {"top_k": K},
            "streaming_llm": {"top_k": K, "sinks": max(1, K // 8)},
            "quest": {"top_k": K, "page_size": min(16, K)}, "sparq": {"top_k": K},
            "loki": {"top_k": K, "rank": max(1, head_dim // 2)},
            "tokenselect": {"top_k": K, "initial": max(1, K // 8), "local": max(1, K // 16)},
            }.get(name, {"top_k": K})


@dataclass(frozen=True)
class MethodRun:
    """A method as one row of a result table: its label and the runtime spec."""

    label: str
    spec: object  # retopk_server.runtime.MethodSpec

    @property
    def name(self) -> str:
        return self.spec.name


def method_run(name: str, budget: int, head_dim: int, label: str | None = None, **params) -> MethodRun:
    """The method at the shared budget (``method_defaults``), ``params`` overriding (top_k included)."""
    from retopk_server.runtime import MethodSpec

    merged = {**method_defaults(name, params.get("top_k", budget), head_dim), **params}
    if label is None:
        label = name + (" " + " ".join(f"{k}={v}" for k, v in params.items()) if params else "")
    return MethodRun(label, MethodSpec.of(name, **merged))


def parse_methods(text: str, top_k: int, head_dim: int) -> list[MethodRun]:
    """'full,exact_topk,retopk:tau=0.9+refresh_every=32' -> MethodRuns (labels unique)."""
    runs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, rest = item.partition(":")
        try:
            params = parse_params(rest, sep="+")  # the one NAME=VALUE grammar; "+" since "," separates methods
        except ValueError as e:
            raise SystemExit(f"method parameters of {item!r}: {e}") from None
        runs.append(method_run(name.strip(), top_k, head_dim, **params))
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"--methods lists a method twice: {labels}")
    return runs


# ---- path mix ------------------------------------------------------------------------------------
PATH_KEYS = tuple(PATH_NAMES.values())  # every Path of the core, "promoted" included


@dataclass
class PathMix:
    """Accumulated per-(layer, head) decode decisions of one method over many steps, and the group reads.

    A head on a path of the core's ``FULL_READ_PATHS`` reads every key of its KV group; a (layer,
    sequence, KV group, step) is a *group read* when any of its heads did (``group_reads``). Under GQA
    that, not the per-head path, is what a step costs. ``kv_heads`` is the model's KV-head count.
    """

    kv_heads: int
    counts: dict = field(default_factory=lambda: {k: 0 for k in PATH_KEYS})
    reuse_candidates: float = 0.0  # sum of candidate counts M_t over reuse head-steps
    scored: float = 0.0  # sum of exactly scored keys over all head-steps
    length: float = 0.0  # sum of context lengths L over all head-steps
    group_reads: int = 0  # (layer, KV group) pairs whose keys were read in full, over all steps
    groups: int = 0  # (layer, KV group) pairs, over all steps
    steps: int = 0

    def add(self, stats, length: int) -> None:
        """stats: a runtime StepStats (path, n_scored: (layers, heads))."""
        path = stats.path.to(torch.int64)
        for code, n in zip(*torch.unique(path, return_counts=True), strict=True):
            self.counts[PATH_NAMES[int(code)]] += int(n)
        reuse = path == StepPath.REUSE
        self.reuse_candidates += float(stats.n_scored[reuse].double().sum())
        self.scored += float(stats.n_scored.double().sum())
        self.length += float(length) * path.numel()
        read = group_reads(path, self.kv_heads)  # (layers, H_kv) bool
        self.group_reads += int(read.sum())
        self.groups += read.numel()
        self.steps += 1

    def merge(self, other: PathMix) -> PathMix:
        """Add another mix (another document, example) of the same method into this one."""
        if other.kv_heads != self.kv_heads:
            raise ValueError(f"cannot merge mixes of {self.kv_heads} and {other.kv_heads} KV heads")
        for k, n in other.counts.items():
            self.counts[k] += n
        for name in ("reuse_candidates", "scored", "length", "group_reads", "groups", "steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def summary(self) -> dict:
        """Shares of head-steps per path; ``exact_path`` = ReTopK heads that took the exact support
        (fallback + refresh + promoted); ``group_read`` = the group-read rate."""
        total = max(1, sum(self.counts.values()))
        reuse = self.counts["reuse"]
        share = {k: self.counts[k] / total for k in ("reuse", "fallback", "refresh", "promoted")}
        return {**share, "exact_path": share["fallback"] + share["refresh"] + share["promoted"],
                "group_read": self.group_reads / self.groups if self.groups else float("nan"),
                "mean_candidates": self.reuse_candidates / reuse if reuse else float("nan"),
                "scored_share": self.scored / self.length if self.length else float("nan")}


MIX_KEYS = ("reuse", "fallback", "refresh", "promoted", "exact_path", "group_read", "mean_candidates", "scored_share")


def mix_columns(suffix: str = "", header: str = "") -> list[tuple[str, str, str]]:
    """Table columns of a PathMix summary (keys ``<name><suffix>``), the group-read rate beside the path mix."""
    h = f" {header}" if header else ""
    return [(f"reuse{suffix}", f"reuse{h}", "%"), (f"fallback{suffix}", f"fallback{h}", "%"),
            (f"refresh{suffix}", f"refresh{h}", "%"), (f"promoted{suffix}", f"promoted{h}", "%"),
            (f"group_read{suffix}", f"group reads{h}", "%"), (f"mean_candidates{suffix}", f"M_t{h}", ".1f"),
            (f"scored_share{suffix}", f"scored/L{h}", "%")]


# ---- shared prefill ------------------------------------------------------------------------------
SHARE_TAIL = 64  # tokens each session prefills itself after the shared prefix (>= every method's C)


@dataclass
class HeldPrefix:
    """A dense prefix held in a donor session of the stateless "full" method, so that several
    ``prefill_all`` calls on the same prompt (batches of methods) compute it once."""

    session: object
    ids: list


def prefill_tail(runs: list[MethodRun]) -> int:
    """Tokens each session must prefill itself so that every method's prefill hook sees the prompt's last
    queries it asks for (ReTopK: C): ``held_prefix``'s tail for a set of methods."""
    return max([SHARE_TAIL] + [r.spec.build().prefill_queries for r in runs])


@contextmanager
def held_prefix(runner, ids: list[int], share: bool = True, tail: int = SHARE_TAIL):
    """Prefill ids[:-tail] once into a donor session, closed on exit -> a HeldPrefix, or None when the
    prompt is too short (``prefill_all`` then prefills on its own)."""
    if not share or len(ids) <= 2 * tail:
        yield None
        return
    from retopk_server.runtime import MethodSpec

    donor = runner.open_session(MethodSpec("full"))
    try:
        runner.prefill(donor, ids[:-tail])
        yield HeldPrefix(donor, list(ids[:-tail]))
    finally:
        runner.close_session(donor)


def _from_prefix(runner, sessions: list, held: HeldPrefix, ids: list[int]) -> torch.Tensor:
    """Fork the held prefix into every session, then let each prefill the rest."""
    head = held.ids
    runner.fork_prefix(held.session, sessions, len(head))
    return torch.stack([runner.prefill(s, ids[len(head):]) for s in sessions])


def prefill_all(runner, sessions: list, ids: list[int], share: bool = True,
                held: HeldPrefix | None = None) -> torch.Tensor:
    """Prefill the same ids into every session -> (B, V) logits after the last id.

    With ``share`` the dense prefix ids[:-tail] is computed ONCE in a donor session of the stateless
    "full" method (or taken from ``held``, a ``held_prefix`` of the same prompt) and its keys/values
    are copied into every session's blocks; each session then prefills the last ``tail`` ids itself
    (a later-turn prefill), so its method sees the prompt's last queries with the whole prefix in its
    KV cache, as after a plain prefill (tests check that the logits and decode steps equal a plain
    prefill's for every method). The copy is the runner's ``fork_prefix``; for short prompts each session
    prefills everything.
    """
    want = max([SHARE_TAIL] + [runner.prefill_queries(s) for s in sessions])
    if not share or len(ids) <= 2 * want or any(s.length for s in sessions):
        return torch.stack([runner.prefill(s, ids) for s in sessions])
    if held is not None and len(ids) - len(held.ids) >= want and ids[:len(held.ids)] == held.ids:
        return _from_prefix(runner, sessions, held, ids)
    if len(sessions) < 2:
        return torch.stack([runner.prefill(s, ids) for s in sessions])
    with held_prefix(runner, ids, tail=want) as own:
        return _from_prefix(runner, sessions, own, ids)


def batches(runs: list, size: int | None) -> list[list]:
    """The methods in consecutive batches of at most ``size`` (None or 0: one batch): every session holds
    its own KV cache, so the batch size bounds memory at long contexts."""
    size = size or len(runs) or 1
    return [runs[i:i + size] for i in range(0, len(runs), size)]


# ---- batched teacher forcing ---------------------------------------------------------------------
@dataclass
class ForcedTrace:
    """One method's teacher-forced run: nll[j] = -log p(target j), plus its path mix."""

    mix: PathMix
    nll: list = field(default_factory=list)
    top1: list = field(default_factory=list)  # argmax == target


@torch.inference_mode()
def teacher_force(runner, runs: list[MethodRun], ids: list[int], prefix: int, progress=None,
                  on_step=None, share: bool = True, held: HeldPrefix | None = None) -> dict[str, ForcedTrace]:
    """Prefill ids[:prefix - 1] densely, then decode ids[prefix - 1 : -1] one token a step with every
    method in one batch; step j's logits predict ids[prefix + j], so all len(ids) - prefix scored
    predictions come from sparse decode steps. ``on_step(j, logits (B, V), stats)`` is called per step;
    ``held``: a ``held_prefix`` of ids[:prefix - 1] shared with other batches of methods.
    """
    if not 1 < prefix < len(ids):
        raise ValueError(f"prefix must lie in (1, {len(ids)}), got {prefix}")
    sessions = [runner.open_session(r.spec) for r in runs]
    traces = {r.label: ForcedTrace(PathMix(runner.info.num_kv_heads)) for r in runs}
    try:
        prefill_all(runner, sessions, ids[:prefix - 1], share, held)
        for j in range(len(ids) - prefix):
            tok = ids[prefix - 1 + j]
            logits, stats = runner.decode(sessions, [tok] * len(sessions), with_stats=True)
            target = ids[prefix + j]
            logp = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
            for b, r in enumerate(runs):
                tr = traces[r.label]
                tr.nll.append(float(-logp[b, target]))
                tr.top1.append(bool(int(logits[b].argmax()) == target))
                tr.mix.add(stats[b], prefix + j)
            if on_step is not None:
                on_step(j, logits, stats)
            if progress is not None:
                progress.update(1)
    finally:
        for s in sessions:
            runner.close_session(s)
    return traces


def ppl(nll: list[float]) -> float:
    return math.exp(sum(nll) / max(1, len(nll)))


# ---- greedy answering ----------------------------------------------------------------------------
@torch.inference_mode()
def answer(runner, runs: list[MethodRun], context: list[int], question: list[int], max_new: int,
           stop_ids: tuple[int, ...] = (), progress=None, share: bool = True,
           held: HeldPrefix | None = None) -> dict[str, dict]:
    """Prefill ``context`` densely, decode ``question`` token by token with each method (so the
    question's attention is the method's, as in the paper), then greedy-generate up to max_new
    tokens. ``held``: a ``held_prefix`` of ``context``. -> label -> {"ids": generated ids, "mix": PathMix}."""
    if not context or not question:
        raise ValueError("context and question must be non-empty")
    sessions = [runner.open_session(r.spec) for r in runs]
    mixes = [PathMix(runner.info.num_kv_heads) for _ in runs]
    out = [[] for _ in runs]
    try:
        prefill_all(runner, sessions, context, share, held)
        logits = None
        for tok in question:
            logits, stats = runner.decode(sessions, [tok] * len(sessions), with_stats=True)
            for b, st in enumerate(stats):
                mixes[b].add(st, sessions[b].length)
        live = list(range(len(runs)))
        nxt = {b: int(logits[b].argmax()) for b in live}
        for step in range(max_new):
            for b in list(live):
                if nxt[b] in stop_ids:
                    live.remove(b)
                else:
                    out[b].append(nxt[b])
            if not live or step == max_new - 1:
                break
            logits, stats = runner.decode([sessions[b] for b in live], [nxt[b] for b in live], with_stats=True)
            for i, b in enumerate(live):
                mixes[b].add(stats[i], sessions[b].length)
                nxt[b] = int(logits[i].argmax())
        if progress is not None:
            progress.update(1)
    finally:
        for s in sessions:
            runner.close_session(s)
    return {r.label: {"ids": out[b], "mix": mixes[b]} for b, r in enumerate(runs)}


# ---- results -------------------------------------------------------------------------------------
def command_line() -> str:
    module = Path(sys.argv[0]).stem
    return f"python -m bench.eval.{module} " + shlex.join(sys.argv[1:])


def run_meta(args, runner, started: float, **extra) -> dict:
    info = runner.info
    return {"command": command_line(), "model": info.name, "architecture": info.architecture,
            "layers": info.num_layers, "heads": info.num_heads, "kv_heads": info.num_kv_heads,
            "head_dim": info.head_dim, "max_context": info.max_context, "weights": info.weight_format,
            "kv_dtype": info.kv_dtype, "device": info.device, "backend": info.backend,
            "corpus": getattr(args, "corpus", None), "top_k": getattr(args, "top_k", None),
            "torch_threads": torch.get_num_threads(), "host": platform.node(), "python": platform.python_version(),
            "seconds": round(time.time() - started, 1), **extra}


def fmt(value, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec)


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec); a spec of '%' formats a share as a percentage."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for key, _, spec in columns:
            v = row.get(key)
            if spec == "%":
                cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%")
            else:
                cells.append(fmt(v, spec))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(out: Path, name: str, title: str, tables: list[tuple[str, str]], meta: dict, data: dict,
                  plots: list[str] = ()) -> None:
    """<out>/<name>.md (title, command, settings, tables, plot links) and <out>/<name>.json (meta + data)."""
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# {title}", "", f"`{meta['command']}`", "",
          f"model {meta['model']} ({meta['layers']} layers, {meta['heads']} heads, {meta['kv_heads']} KV heads), "
          f"weights {meta['weights']}, KV cache {meta['kv_dtype']} on {meta['device']}, backend {meta['backend']}, "
          f"corpus {meta.get('corpus')}, "
          f"{meta['seconds']} s", ""]
    for caption, table in tables:
        if caption:
            md += [f"**{caption}**", ""]
        md += [table, ""]
    for p in plots:
        md += [f"![{Path(p).stem}]({Path(p).name})", ""]
    (out / f"{name}.md").write_text("\n".join(md), encoding="utf-8")
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, **data}, indent=1, default=_jsonable),
                                      encoding="utf-8")


def _jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return str(obj)


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot().close(fig)
    return str(path)


def progress_bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=2.0)
