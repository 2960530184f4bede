"""Attention-support fidelity over all layers and heads (the paper's figure 6).

Each method runs wrapped in the ``fidelity_probe`` method: it decodes as the method itself and, at
every (decode step, layer, query head), also computes Exact Top-K and full attention on the same
query and KV cache, recording

    support recall   share of the Exact Top-K support the method attended
    retained mass    full-softmax probability mass on the method's support
    output cosine    cosine of the head output with the full-attention output

overall and on ReTopK's reuse-path steps, per (layer, head) as heatmaps, and binned by the max
cached-query similarity, beside each method's path mix and group-read rate. Documents are prefilled
with L - S tokens, then S tokens are teacher-forced.

    python -m bench.eval.fidelity --length 4096 --docs 2 --suffix 128 --out results/fidelity
"""

from __future__ import annotations

from pathlib import Path

from bench.eval import common
from retopk_core.methods.base import Path as StepPath
from retopk_core.methods.probe import METRICS, FidelityRecorder

DEFAULT_METHODS = "retopk,exact_topk,streaming_llm"


def parse_args(argv=None):
    p = common.eval_parser(__doc__, DEFAULT_METHODS, batch=True)
    p.add_argument("--length", type=int, default=4096, help="document length L")
    p.add_argument("--docs", type=int, default=2)
    p.add_argument("--suffix", type=int, default=128, help="teacher-forced decode steps per document")
    p.add_argument("--heatmap-method", default="retopk", help="label of the method whose layer x head maps are drawn")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def probed(runs, top_k: int, head_dim: int):
    """Each MethodRun wrapped in the probe with its own recorder -> (probe runs, {label: recorder})."""
    from bench.eval.common import MethodRun
    from retopk_server.runtime import MethodSpec

    out, recorders = [], {}
    for r in runs:
        rec = FidelityRecorder()
        params = {**common.method_defaults(r.name, top_k, head_dim), **dict(r.spec.params)}
        out.append(MethodRun(r.label, MethodSpec.of("fidelity_probe", inner=r.name, recorder=rec, **params)))
        recorders[r.label] = rec
    return out, recorders


REUSE = (int(StepPath.REUSE),)


def summarize(recorders: dict, mixes: dict | None = None) -> list[dict]:
    """One row per method: the fidelity means (overall and on reuse steps) and, from ``mixes`` (label ->
    PathMix summary), its path mix and group-read rate."""
    rows = []
    for label, rec in recorders.items():
        row = {"method": label}
        for m in METRICS:
            row[m] = rec.mean(m)
            row[f"{m}_reuse"] = rec.mean(m, REUSE)
        row["reuse_share"] = rec.share(REUSE)
        row.update((mixes or {}).get(label, {}))
        rows.append(row)
    return rows


def evaluate(runner, runs, docs: list[list[int]], suffix: int, top_k: int, desc: str = "fidelity",
             batch: int | None = None) -> dict:
    """Teacher-force the last ``suffix`` tokens of each document with every method wrapped in the probe,
    in batches of at most ``batch`` methods sharing each document's dense prefill.
    -> {"rows": summarize(...), "recorders": {label: FidelityRecorder}, "mix": {label: PathMix summary}}."""
    probe_runs, recorders = probed(runs, top_k, runner.info.head_dim)
    groups, tail = common.batches(probe_runs, batch), common.prefill_tail(probe_runs)
    bar = common.progress_bar(len(docs) * suffix * len(groups), desc)
    mixes = {}
    for doc in docs:
        with common.held_prefix(runner, doc[:len(doc) - suffix - 1], tail=tail) as held:
            traces = {}
            for group in groups:
                traces.update(common.teacher_force(runner, group, doc, len(doc) - suffix, progress=bar, held=held))
        for label, tr in traces.items():
            if label in mixes:
                mixes[label].merge(tr.mix)
            else:
                mixes[label] = tr.mix
    bar.close()
    summaries = {label: m.summary() for label, m in mixes.items()}
    return {"rows": summarize(recorders, summaries), "recorders": recorders, "mix": summaries}


COLUMNS = [("method", "method", ""), ("recall", "recall", "%"), ("mass", "mass", "%"), ("cosine", "cosine", "%"),
           ("recall_reuse", "recall (reuse)", "%"), ("mass_reuse", "mass (reuse)", "%"),
           ("cosine_reuse", "cosine (reuse)", "%"), ("reuse", "reuse", "%"), ("fallback", "fallback", "%"),
           ("refresh", "refresh", "%"), ("promoted", "promoted", "%"), ("group_read", "group reads", "%")]


def main(argv=None, runner=None) -> dict:
    """Run the evaluation; ``runner`` (a ModelRunner) is reused instead of loading --model when given."""
    args = parse_args(argv)
    runner, started = common.start_run(args, runner)
    runs = common.parse_methods(args.methods, args.top_k, runner.info.head_dim)
    docs = common.corpus_documents(args, runner, args.docs, [args.length])[args.length]
    res = evaluate(runner, runs, docs, args.suffix, args.top_k, batch=args.batch)
    rows, recorders = res["rows"], res["recorders"]
    tables = [("Mean over every (step, layer, head); '(reuse)' = ReTopK's reuse-path steps only; path mix "
               "over (step, layer, head), group reads over (step, layer, KV group)",
               common.markdown_table(rows, COLUMNS))]
    plots = []
    heat_label = args.heatmap_method if args.heatmap_method in recorders else next(iter(recorders))
    plots.append(plot_heatmaps(recorders[heat_label], heat_label, args.out / "fidelity_heatmap.png"))
    sim_rows = recorders[heat_label].similarity_table()
    if any(r["n"] for r in sim_rows):
        tables.append((f"{heat_label}: fidelity by max cached-query similarity (all paths)",
                       common.markdown_table(sim_rows, [("sim_lo", "sim from", ".2f"), ("sim_hi", "to", ".2f"),
                                                        ("n", "head-steps", "d"), ("recall", "recall", "%"),
                                                        ("mass", "mass", "%"), ("cosine", "cosine", "%")])))
        plots.append(plot_similarity(sim_rows, heat_label, args.out / "fidelity_similarity.png"))
    heat = {label: {m: rec.heatmap(m).tolist() for m in METRICS} for label, rec in recorders.items()}
    meta = common.run_meta(args, runner, started, length=args.length, docs=args.docs, suffix=args.suffix)
    common.write_results(args.out, "fidelity", f"Attention fidelity, L={args.length}, {args.docs} documents x "
                         f"{args.suffix} steps, K={args.top_k}", tables, meta,
                         {"rows": rows, "heatmaps": heat, "by_similarity": sim_rows}, plots)
    return {"rows": rows, "recorders": recorders}


def plot_heatmaps(rec: FidelityRecorder, label: str, path: Path) -> str:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(9, 4.2))
    for ax, m in zip(axes, METRICS, strict=True):
        data = rec.heatmap(m).numpy()
        im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=max(0.0, float(data[data == data].min())), vmax=1.0)
        ax.set_title(f"{m} ({label})", fontsize=9)
        ax.set_xticks(range(data.shape[1]))
        ax.tick_params(labelsize=7)
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, fraction=0.046)
    path.parent.mkdir(parents=True, exist_ok=True)
    return common.save_figure(fig, path)


def plot_similarity(rows: list[dict], label: str, path: Path) -> str:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = [f"{r['sim_lo']:.2f}-{r['sim_hi']:.2f}" for r in rows if r["n"]]
    for m in METRICS:
        ax.plot(xs, [r[m] for r in rows if r["n"]], marker="o", label=m)
    ax.set_xlabel("max cached-query similarity")
    ax.set_title(f"{label}: fidelity vs similarity", fontsize=9)
    ax.tick_params(axis="x", labelsize=7, rotation=30)
    ax.legend(fontsize=7)
    return common.save_figure(fig, path)


if __name__ == "__main__":
    main()
