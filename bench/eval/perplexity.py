"""Perplexity of a teacher-forced suffix, per method, as in the paper's PG19 column.

For each of N fixed documents of L tokens (deterministic slices of the corpus) the first L - S tokens
are prefilled densely and the last S tokens are teacher-forced one decode step at a time with the
method, every method in the same batch. PPL = exp(mean NLL over all N * S predictions); the change
is reported against Exact Top-K (same K) as (PPL - PPL_exact) / PPL_exact, with the path mix:
reuse / fallback / refresh / promoted shares over (step, layer, head), the group-read rate (share of
(step, layer, sequence, KV group) whose keys were read in full: what a step costs under GQA), the
mean candidate count M_t on reuse steps, and the scored share (keys scored with the exact query /
context length, a hardware-free proxy of selector work: 1.0 for Exact Top-K).

    python -m bench.eval.perplexity --lengths 2048 4096 --docs 4 --suffix 256 --out results/ppl
"""

from __future__ import annotations

from pathlib import Path

from bench.eval import common

DEFAULT_METHODS = "full,exact_topk,retopk,retopk:tau=0.9,streaming_llm,quest,sparq,loki,tokenselect"


def parse_args(argv=None):
    p = common.eval_parser(__doc__, DEFAULT_METHODS, batch=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="document lengths L in tokens")
    p.add_argument("--docs", type=int, default=4, help="documents N per length (paper: 64)")
    p.add_argument("--suffix", type=int, default=256, help="teacher-forced suffix S (paper: 512)")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    return p.parse_args(argv)


def evaluate(runner, runs, docs_by_length: dict[int, list[list[int]]], suffix: int, desc: str = "ppl",
             batch: int | None = None) -> dict:
    """-> {L: {label: {"ppl", "nll": [...], "mix": summary, "top1"}}}. Methods decode in batches of at most
    ``batch`` (None: all in one), every batch of a document sharing one dense prefill."""
    groups, tail = common.batches(runs, batch), common.prefill_tail(runs)
    total = sum(len(d) for d in docs_by_length.values()) * suffix * len(groups)
    bar = common.progress_bar(total, desc)
    result = {}
    for L, docs in docs_by_length.items():
        nll = {r.label: [] for r in runs}
        top1 = {r.label: [] for r in runs}
        mixes = {}
        for doc in docs:
            with common.held_prefix(runner, doc[:L - suffix - 1], tail=tail) as held:
                traces = {}
                for group in groups:
                    traces.update(common.teacher_force(runner, group, doc, L - suffix, progress=bar, held=held))
            for label, tr in traces.items():
                nll[label] += tr.nll
                top1[label] += tr.top1
                if label in mixes:
                    mixes[label].merge(tr.mix)
                else:
                    mixes[label] = tr.mix
        result[L] = {label: {"ppl": common.ppl(nll[label]), "nll": nll[label],
                             "top1": sum(top1[label]) / max(1, len(top1[label])),
                             "mix": mixes[label].summary()} for label in nll}
    bar.close()
    return result


def rows_for(result: dict, runs, reference: str = "exact_topk") -> list[dict]:
    rows = []
    for r in runs:
        row = {"method": r.label}
        for L, per in result.items():
            row[f"ppl_{L}"] = per[r.label]["ppl"]
            ref = per.get(reference)
            row[f"dppl_{L}"] = (per[r.label]["ppl"] / ref["ppl"] - 1.0) if ref else None
            for k, v in per[r.label]["mix"].items():
                row[f"{k}_{L}"] = v
        rows.append(row)
    return rows


def main(argv=None, runner=None) -> dict:
    """Run the evaluation; ``runner`` (a ModelRunner) is reused instead of loading --model when given."""
    args = parse_args(argv)
    runner, started = common.start_run(args, runner)
    runs = common.parse_methods(args.methods, args.top_k, runner.info.head_dim)
    docs = common.corpus_documents(args, runner, args.docs, args.lengths)
    result = evaluate(runner, runs, docs, args.suffix, batch=args.batch)
    rows = rows_for(result, runs)
    Ls = list(result)
    main_cols = [("method", "method", "")] + [(f"ppl_{L}", f"PPL {L}", ".3f") for L in Ls] \
        + [(f"dppl_{L}", f"ΔPPL {L} vs Exact", "%") for L in Ls] \
        + [(f"group_read_{L}", f"group reads {L}", "%") for L in Ls]
    mix_cols = [("method", "method", "")]
    for L in Ls:
        mix_cols += common.mix_columns(f"_{L}", str(L))
    plot = plot_ppl(result, runs, args.out / "perplexity.png")
    meta = common.run_meta(args, runner, started, docs=args.docs, suffix=args.suffix, lengths=Ls)
    common.write_results(args.out, "perplexity", f"Perplexity, last {args.suffix} of L tokens teacher-forced, "
                         f"{args.docs} documents, K={args.top_k}",
                         [("PPL and change against Exact Top-K", common.markdown_table(rows, main_cols)),
                          ("Path mix (share of layer x head x step decisions) and group reads (share of layer x "
                           "KV group x step)", common.markdown_table(rows, mix_cols))],
                         meta, {"rows": rows, "result": {str(k): v for k, v in result.items()}}, [plot])
    return {"rows": rows, "result": result}


def plot_ppl(result: dict, runs, path: Path) -> str:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    Ls = list(result)
    width = 0.8 / max(1, len(Ls))
    for i, L in enumerate(Ls):
        vals = [result[L][r.label]["ppl"] for r in runs]
        ax.bar([x + i * width for x in range(len(runs))], vals, width, label=f"L={L}")
    ax.set_xticks([x + width * (len(Ls) - 1) / 2 for x in range(len(runs))], [r.label for r in runs], rotation=35,
                  ha="right", fontsize=7)
    ax.set_ylabel("PPL")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("teacher-forced suffix perplexity")
    path.parent.mkdir(parents=True, exist_ok=True)
    return common.save_figure(fig, path)


if __name__ == "__main__":
    main()
