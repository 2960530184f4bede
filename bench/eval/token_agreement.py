"""Greedy tokens of the runtime's weight and KV formats against the dequantized float32 model (issue 28's
criterion: equal tokens, or where rounding flips a near-tie, the chosen token's log-probability within 1e-3
of the other's).

The reference is transformers' own ``generate`` on the float32 model (the GGUF dequantized by transformers'
loader), greedy, ``--new-tokens`` per prompt. The prompts are short chat prompts, or with ``--prefix-tokens L``
long ones: ``--docs`` documents of L tokens of ``--corpus`` (``bench.eval.common.split_documents``, as
perplexity takes them: document 0 starts at the corpus's first line break), where small differences have L
positions to accumulate. RoPE is the model's own; L + ``--new-tokens`` must fit its positions. The cost is
transformers' float32 forward over L tokens per document, and the runtime's prefill of L per format.

The runtime (method ``full``, so that only the formats differ) is teacher-forced through the same tokens: it
prefills the prompt, then decodes the reference's tokens one by one. At every position where its argmax a
differs from the reference's token r, the gap log p(a) - log p(r) under the runtime's own distribution is
recorded: a flip with gap <= 1e-3 is a near-tie.

    python -m bench.eval.token_agreement --formats as-stored:float32 as-stored:bfloat16 float32:bfloat16
    python -m bench.eval.token_agreement --formats as-stored:float32 as-stored:float32:int8   # int8 activations
    python -m bench.eval.token_agreement --formats as-stored:float32 as-stored:float32:int16 --prefix-tokens 8000
    python -m bench.eval.token_agreement --prefix-tokens 8000 --docs 8 --only-docs 2 3   # documents 2, 3 of 8
    python -m bench.eval.token_agreement --formats as-stored:bfloat16:float32:float32  # float32 prefill GEMMs
    python -m bench.eval.token_agreement --formats as-stored:bfloat16:int16:blocks  # every prefill row on the blocks

With --prefix-tokens each row's ``documents`` names its documents' indices among the --docs (a flip's ``prompt``
indexes that list). ``--summarize FILES`` runs nothing: it merges the rows of --json files (a split run as several
processes) per format into documents, positions, flips over and within the 1e-3 bar, and the smallest margins.

    python -m bench.eval.token_agreement --summarize docs/bench/token_agreement_*_kjv8000_doc*of8*.json
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.eval.common import KJV, corpus_documents
from retopk_core.models import DEFAULT_MODEL
from retopk_server.runtime import MethodSpec, ModelRunner, RuntimeConfig
from retopk_server.runtime.decoder.linear import NEVER, wide_rows

TOLERANCE = 1e-3  # nats: a flip within this is a near-tie the criterion allows
# a format's optional PREFILL: Decoder.set_prefill_dtype's dtype, "blocks" its None (every row on the block products)
PREFILLS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "blocks": None}
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "What is 12 times 12?", "Give me a synonym for happy.", "Describe a cat in five words.",
    "What does a CPU do?", "Name a planet with rings.", "Why is the sky blue?", "Suggest a name for a dog.",
    "What is the boiling point of water?", "Tell me a fun fact about octopuses.", "How many days are in a leap year?",
    "What is the opposite of cold?", "Recommend a book for a long flight.", "What language is spoken in Brazil?",
    "Summarize the plot of Cinderella in one sentence.", "What is a noun?", "How do bees make honey?",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--formats", nargs="+", default=["as-stored:float32", "as-stored:bfloat16"],
                   help="WEIGHTS:KV_DTYPE[:ACTIVATIONS[:PREFILL]] of the runtime to compare (activations float32 "
                        "unless given; PREFILL float32 or bfloat16: the dtype of the quantized weights' prefill "
                        "GEMM copies, or blocks: no copy, every prefill row on the block products; else the "
                        "runner's: with a 16-bit KV cache on a CPU with AVX-512 BF16, bfloat16 copies, or the "
                        "blocks with int16 activations)")
    p.add_argument("--prompts", type=int, default=20, help=f"chat prompts (at most {len(PROMPTS)})")
    p.add_argument("--prefix-tokens", type=int, nargs="+", default=None, metavar="L",
                   help="instead of the chat prompts: --docs documents of exactly L tokens of --corpus per L "
                        "(costs transformers' float32 forward over L tokens per document; L + --new-tokens must "
                        "fit the model's positions)")
    p.add_argument("--docs", type=int, default=1, help="documents per --prefix-tokens L (default 1)")
    p.add_argument("--only-docs", type=int, nargs="+", default=None, metavar="I",
                   help="run only these of the --docs documents (indices from 0, in this order; default all), "
                        "so that one split can be spread over several processes")
    p.add_argument("--corpus", default=KJV, help="the --prefix-tokens documents' corpus: a bench.eval.corpora "
                   "name or a UTF-8 text file (default: kjv)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--summarize", nargs="+", default=None, metavar="FILE",
                   help="run nothing: merge these --json files' rows per format (summarize) and print them")
    p.add_argument("--smallest", type=int, default=3, help="with --summarize: the smallest margins to list")
    return p.parse_args(argv)


def parse_format(spec: str) -> tuple[str, str, str, str | None]:
    """"WEIGHTS:KV[:ACTIVATIONS[:PREFILL]]" -> (weights, kv, activations (float32 if absent), prefill (None if
    absent: the runner's choice)). PREFILL separates the prefill GEMMs' rounding from the KV cache's: the runner
    couples them (a 16-bit KV cache brings bfloat16 copies of the quantized weights for the prefill, or with int16
    activations the blocks). A copy that the activations never multiply through (decoder/linear.py's rule: int16
    against bfloat16) is refused, not run on the blocks under the copy's name."""
    parts = spec.split(":")
    if not 2 <= len(parts) <= 4 or (len(parts) == 4 and parts[3] not in PREFILLS):
        raise SystemExit(f"--formats {spec!r}: WEIGHTS:KV_DTYPE[:ACTIVATIONS[:PREFILL]], PREFILL one of "
                         f"{', '.join(PREFILLS)}")
    weights, kv, activations, prefill = parts + ["float32", None][len(parts) - 2:]
    if prefill is not None and PREFILLS[prefill] is not None and wide_rows(PREFILLS[prefill], activations) == NEVER:
        raise SystemExit(f"--formats {spec!r}: with {activations} activations the prefill never multiplies through "
                         f"a {prefill} copy (decoder/linear.py's WIDE_ROWS): PREFILL blocks is what runs")
    return weights, kv, activations, prefill


def reference(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (up to n tokens; it stops at EOS)."""
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
        out.append(y[0, len(ids):].tolist())
    return out


def document_indices(args) -> list[int] | None:
    """The --docs documents to run: --only-docs (each checked to lie in [0, --docs)), else all; None for the chat
    prompts."""
    if not args.prefix_tokens:
        return None
    if args.only_docs is None:
        return list(range(args.docs))
    bad = [i for i in args.only_docs if not 0 <= i < args.docs]
    if bad or len(set(args.only_docs)) != len(args.only_docs):
        raise SystemExit(f"--only-docs {args.only_docs}: each index once, in [0, {args.docs}) (--docs {args.docs})")
    return list(args.only_docs)


def prompt_sets(args, runner: ModelRunner) -> dict[str, list[list[int]]]:
    """{label: prompts}: "chat" -> the first --prompts chat prompts; or, with --prefix-tokens, "L=<L>" -> --docs
    corpus documents of L tokens each (those ``document_indices`` names). SystemExit when L + --new-tokens exceeds
    the model's positions."""
    if not args.prefix_tokens:
        return {"chat": [runner.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:args.prompts]]}
    limit = runner.info.max_context
    for L in args.prefix_tokens:
        if L < 1 or L + args.new_tokens > limit:
            raise SystemExit(f"--prefix-tokens {L}: L must be at least 1 and L + --new-tokens ({args.new_tokens}) at "
                             f"most {limit}, the model's positions (RoPE as its config has it)")
    pick = document_indices(args)
    docs = corpus_documents(args, runner, args.docs, sorted(set(args.prefix_tokens)))
    return {f"L={L}": [docs[L][i] for i in pick] for L in args.prefix_tokens}


def agreement(runner: ModelRunner, prompts: list[list[int]], continuations: list[list[int]]) -> dict:
    """Teacher-forced flips of the runtime against the reference's tokens -> counts, the largest gap, each flip as
    {"prompt": index, "step": position in the continuation, "top", "ref": token ids, "gap"}, and per prompt and step
    ("steps") log p(ref) and the margin log p(top) - log p(runner-up) under the runtime's distribution: how near a
    tie each position is, which says more about how often rounding can flip one than the few flips themselves."""
    tokens = flips = 0
    gaps: list[float] = []
    where: list[dict] = []
    steps: list[dict] = []
    for p, (ids, cont) in enumerate(zip(prompts, continuations, strict=True)):
        session = runner.open_session(MethodSpec("full"))
        trace = {"logp_ref": [], "margin": []}
        try:
            logits = runner.prefill(session, ids)
            for i, ref in enumerate(cont):
                logp = torch.log_softmax(logits.double(), dim=-1)
                best = logp.topk(2).values
                top = int(logp.argmax())
                trace["logp_ref"].append(float(logp[ref]))
                trace["margin"].append(float(best[0] - best[1]))
                tokens += 1
                if top != ref:
                    flips += 1
                    gaps.append(float(logp[top] - logp[ref]))
                    where.append({"prompt": p, "step": i, "top": top, "ref": ref, "gap": gaps[-1]})
                if i + 1 < len(cont):
                    logits = runner.decode([session], [ref])[0][0]
        finally:
            runner.close_session(session)
        steps.append(trace)
    worst = max(gaps, default=0.0)
    return {"tokens": tokens, "flips": flips, "max_gap": worst, "met": worst <= TOLERANCE, "flips_at": where,
            "steps": steps}


def format_key(row: dict) -> tuple[str, str, str, str, str]:
    """(prompts, weights, kv_dtype, activations, prefill) of a --json row. A prefill "auto" with a float32 KV cache is
    "float32", the runner's choice for it (a 16-bit cache's "auto" is the CPU's: left as "auto")."""
    prefill = "float32" if row["prefill"] == "auto" and row["kv_dtype"] == "float32" else row["prefill"]
    return row["prompts"], row["weights"], row["kv_dtype"], row["activations"], prefill


def summarize(rows: list[dict], smallest: int = 3) -> list[dict]:
    """Rows of --json files (with per-step traces) merged per ``format_key`` -> per format: its documents (or
    prompts), positions, flips, those over the bar (gap > TOLERANCE) and the near-ties (gap <= TOLERANCE), the
    largest gap, each flip as {"document", "step", "gap"} in document order, and the ``smallest`` smallest margins
    log p(top) - log p(runner-up) as {"document", "step", "margin"}. SystemExit where a format has a document twice
    (counted once only) or a row has no traces."""
    merged: dict[tuple, dict] = {}
    for r in rows:
        if "steps" not in r:
            raise SystemExit(f"--summarize: a row of {format_key(r)} has no per-step traces (an older --json)")
        docs = r["documents"] if r["documents"] is not None else list(range(len(r["steps"])))
        m = merged.setdefault(format_key(r), {"documents": [], "tokens": 0, "flips_at": [], "margins": []})
        if set(docs) & set(m["documents"]):
            raise SystemExit(f"--summarize: {format_key(r)} has document(s) {sorted(set(docs) & set(m['documents']))}"
                             f" twice")
        m["documents"] += docs
        m["tokens"] += r["tokens"]
        m["flips_at"] += [{"document": docs[f["prompt"]], "step": f["step"], "gap": f["gap"]} for f in r["flips_at"]]
        m["margins"] += [{"document": d, "step": i, "margin": v}
                         for d, trace in zip(docs, r["steps"], strict=True) for i, v in enumerate(trace["margin"])]
    out = []
    for key, m in merged.items():
        gaps = [f["gap"] for f in m["flips_at"]]
        out.append({**dict(zip(("prompts", "weights", "kv_dtype", "activations", "prefill"), key, strict=True)),
                    "documents": sorted(m["documents"]), "tokens": m["tokens"], "flips": len(gaps),
                    "over_bar": sum(g > TOLERANCE for g in gaps), "near_ties": sum(g <= TOLERANCE for g in gaps),
                    "max_gap": max(gaps, default=0.0),
                    "flips_at": sorted(m["flips_at"], key=lambda f: (f["document"], f["step"])),
                    "smallest_margins": sorted(m["margins"], key=lambda x: x["margin"])[:smallest]})
    return out


def print_summary(summary: list[dict]) -> None:
    print(f"{'prompts':>8} {'weights':>10} {'kv':>9} {'x':>7} {'prefill':>8} {'docs':>12} {'tokens':>6} {'flips':>5} "
          f"{'over':>4} {'near':>4} {'max gap':>9}  flips (doc:step gap); smallest margins (doc:step margin)")
    for s in summary:
        flips = " ".join(f"{f['document']}:{f['step']} {f['gap']:.4f}" for f in s["flips_at"]) or "-"
        margins = " ".join(f"{m['document']}:{m['step']} {m['margin']:.4f}" for m in s["smallest_margins"])
        print(f"{s['prompts']:>8} {s['weights']:>10} {s['kv_dtype']:>9} {s['activations']:>7} {s['prefill']:>8} "
              f"{','.join(map(str, s['documents'])):>12} {s['tokens']:>6} {s['flips']:>5} {s['over_bar']:>4} "
              f"{s['near_ties']:>4} {s['max_gap']:>9.2e}  {flips}; {margins}")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.summarize:
        rows = []
        for path in args.summarize:
            with open(path) as f:
                rows += json.load(f)
        summary = summarize(rows, args.smallest)
        print_summary(summary)
        return summary
    formats = [parse_format(spec) for spec in args.formats]  # refused before the reference's cost
    torch.set_num_threads(args.threads)
    from retopk_core.models import load_model

    model, _ = load_model(args.model)
    base = ModelRunner(RuntimeConfig(model=args.model, weights="float32", kv_dtype="float32"))
    sets = prompt_sets(args, base)
    with torch.inference_mode():
        continuations = {label: reference(model, prompts, args.new_tokens) for label, prompts in sets.items()}
    del base, model
    documents = document_indices(args)
    rows = []
    print(f"{'prompts':>8} {'weights':>10} {'kv':>9} {'x':>7} {'prefill':>8} {'tokens':>6} {'flips':>5} "
          f"{'max gap':>9}  criterion (gap <= {TOLERANCE})")
    for weights, kv, activations, prefill in formats:
        runner = ModelRunner(RuntimeConfig(model=args.model, weights=weights, kv_dtype=kv, activations=activations))
        if prefill is not None:
            runner.decoder.set_prefill_dtype(PREFILLS[prefill])
        for label, prompts in sets.items():
            with torch.inference_mode():
                r = {"prompts": label, "weights": weights, "kv_dtype": kv, "activations": activations,
                     "prefill": prefill or "auto", "weight_format": runner.info.weight_format, "documents": documents,
                     **agreement(runner, prompts, continuations[label])}
            rows.append(r)
            print(f"{label:>8} {weights:>10} {kv:>9} {activations:>7} {r['prefill']:>8} {r['tokens']:>6} "
                  f"{r['flips']:>5} {r['max_gap']:>9.2e}  {'met' if r['met'] else 'NOT met'}", flush=True)
        del runner
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
