"""Hyperparameter sensitivity and component ablation of ReTopK (the paper's figure 7 and table 3).

One-at-a-time sweeps of K, C, R, W, tau and T_r around the defaults (every other hyperparameter at
its default), and the ablations: recent-R retrieval instead of similarity, no window (W=0), no
fallback (tau=0), no refresh (T_r=0). Every configuration is teacher-forced on the same documents in
one batch with Exact Top-K at each swept K. Reported per configuration: PPL, its change against
Exact Top-K at the same K, the exact-path rate (fallback + refresh + promoted), the path mix, the
group-read rate (share of layer x KV group x step read in full), the mean candidate count M_t, and
the scored share (keys scored exactly / L; Exact Top-K = 100%, a
hardware-free proxy of selector work, not a measured speedup).

    python -m bench.eval.sweep --length 4096 --docs 2 --suffix 128 --out results/sweep
"""

from __future__ import annotations

from pathlib import Path

from bench.eval import common
from bench.eval.perplexity import evaluate

# hyperparameter -> (ReTopK keyword, values swept); the default is taken from --top-k and ReTopKConfig
SWEEPS = {"K": "top_k", "C": "cache_size", "R": "recall", "W": "window", "tau": "tau", "T_r": "refresh_every"}
ABLATIONS = {"recent-R retrieval": {"retrieval": "recent"}, "no window (W=0)": {"window": 0},
             "no fallback (tau=0)": {"tau": 0.0}, "no refresh (T_r=0)": {"refresh_every": 0}}


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None):
    p = common.eval_parser(__doc__)
    p.add_argument("--top-k", type=int, default=common.DEFAULT_TOP_K,
                   help="default K (the server's; paper 512; 64 for 2K-8K contexts)")
    p.add_argument("--K", type=_ints, default=None, help="K values (default: K/2, 2K)")
    p.add_argument("--C", type=_ints, default=[8, 16, 64])
    p.add_argument("--R", type=_ints, default=[1, 2, 8])
    p.add_argument("--W", type=_ints, default=[8, 64, 128])
    p.add_argument("--tau", type=_floats, default=[0.8, 0.9, 0.95])
    p.add_argument("--T_r", type=_ints, default=[32, 512])
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--docs", type=int, default=2)
    p.add_argument("--suffix", type=int, default=128)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def configurations(args, head_dim: int) -> tuple[list, list[dict]]:
    """-> (method runs, one dict per run: group, value, k, label). Default first, then sweeps, ablations."""
    from retopk_core.retopk_config import ReTopKConfig

    K0 = args.top_k
    defaults = {**ReTopKConfig().__dict__, "top_k": K0}
    Ks = args.K if args.K is not None else [max(1, K0 // 2), 2 * K0]
    runs, info = [], []

    def add(group: str, value, label: str, name: str = "retopk", **params):
        k = params.pop("top_k", K0)
        runs.append(common.method_run(name, k, head_dim, label=label, **params))
        info.append({"group": group, "value": value, "k": k, "label": label})

    add("reference", K0, f"exact_topk K={K0}", name="exact_topk", top_k=K0)
    add("default", None, "retopk default")
    for k in Ks:
        if k != K0:
            add("reference", k, f"exact_topk K={k}", name="exact_topk", top_k=k)
    for hp, key in SWEEPS.items():
        values = Ks if hp == "K" else getattr(args, hp)
        for v in values:
            if v == defaults[key]:
                continue
            params = {key: v}
            if key == "recall" and v > defaults["cache_size"]:
                continue
            if key == "cache_size" and v < defaults["recall"]:
                params["recall"] = v
            add(hp, v, f"retopk {hp}={v}", **params)
    if not args.no_ablations:
        for name, params in ABLATIONS.items():
            add("ablation", None, f"retopk {name}", **params)
    return runs, info


def main(argv=None, runner=None) -> dict:
    """Run the evaluation; ``runner`` (a ModelRunner) is reused instead of loading --model when given."""
    args = parse_args(argv)
    runner, started = common.start_run(args, runner)
    runs, info = configurations(args, runner.info.head_dim)
    docs = common.corpus_documents(args, runner, args.docs, [args.length])[args.length]
    result = evaluate(runner, runs, {args.length: docs}, args.suffix, desc="sweep")[args.length]
    exact = {i["k"]: result[i["label"]]["ppl"] for i in info if i["label"].startswith("exact_topk")}
    rows = []
    for i in info:
        r = result[i["label"]]
        ref = exact.get(i["k"])
        rows.append({**i, "method": i["label"], "ppl": r["ppl"], "dppl": r["ppl"] / ref - 1.0 if ref else None,
                     **r["mix"]})
    cols = [("method", "configuration", ""), ("ppl", "PPL", ".3f"), ("dppl", "ΔPPL vs Exact (same K)", "%"),
            ("exact_path", "exact-path rate", "%")] + common.mix_columns()
    sens = [r for r in rows if r["group"] not in ("ablation",)]
    abl = [r for r in rows if r["group"] in ("reference", "default", "ablation") and r["k"] == args.top_k]
    plot = plot_sweeps(rows, args.out / "sweep.png")
    meta = common.run_meta(args, runner, started, length=args.length, docs=args.docs, suffix=args.suffix)
    common.write_results(args.out, "sweep", f"ReTopK sensitivity and ablation, L={args.length}, {args.docs} documents "
                         f"x {args.suffix} steps, default K={args.top_k}",
                         [("One-at-a-time sensitivity", common.markdown_table(sens, cols)),
                          ("Component ablation", common.markdown_table(abl, cols))], meta, {"rows": rows}, [plot])
    return {"rows": rows}


def plot_sweeps(rows: list[dict], path: Path) -> str:
    """One panel per swept hyperparameter: ΔPPL (left axis) and exact-path rate (right axis)."""
    plt = common.pyplot()
    default = next(r for r in rows if r["group"] == "default")
    from retopk_core.retopk_config import ReTopKConfig

    base = {**ReTopKConfig().__dict__, "top_k": default["k"]}
    fig, axes = plt.subplots(2, 3, figsize=(10, 5.5))
    for ax, (hp, key) in zip(axes.flat, SWEEPS.items(), strict=True):
        pts = sorted([(r["value"], r) for r in rows if r["group"] == hp] + [(base[key], default)],
                     key=lambda t: t[0])
        xs = [str(v) for v, _ in pts]
        ax.plot(xs, [100 * (r["dppl"] or 0.0) for _, r in pts], marker="o", color="tab:blue")
        ax.plot([str(base[key])], [100 * (default["dppl"] or 0.0)], marker="o", color="tab:orange", ms=9)
        ax.set_title(hp, fontsize=9)
        ax.set_ylabel("ΔPPL vs Exact (%)", fontsize=8, color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot(xs, [100 * r["exact_path"] for _, r in pts], marker="s", ls="--", color="tab:green")
        ax2.set_ylabel("exact-path %", fontsize=8, color="tab:green")
    path.parent.mkdir(parents=True, exist_ok=True)
    return common.save_figure(fig, path)


if __name__ == "__main__":
    main()
