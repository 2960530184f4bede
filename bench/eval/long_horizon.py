"""Long-horizon stability of ReTopK (the paper's figure 8).

(a) Teacher forcing: after a dense prefill of P tokens, T further corpus tokens are teacher-forced one
    decode step at a time with Exact Top-K and ReTopK at several refresh intervals T_r (same batch).
    Reported: ΔPPL(t) = PPL_ReTopK(1..t) / PPL_Exact(1..t) - 1 over the first t continuation tokens.
(b) Autoregressive: each ReTopK variant greedily generates T tokens after the same prompt, and an
    Exact Top-K shadow session is fed the SAME generated tokens. Per step: top-1 agreement (argmax of
    ReTopK == argmax of the shadow) and KL(p_shadow || p_ReTopK) of the next-token distributions,
    reported as running means and per window.

    python -m bench.eval.long_horizon --prefill 4096 --continuation 1024 --docs 1 --out results/long
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.eval import common


def parse_args(argv=None):
    p = common.eval_parser(__doc__)
    p.add_argument("--top-k", type=int, default=common.DEFAULT_TOP_K)
    p.add_argument("--refresh", type=lambda s: [int(v) for v in s.split(",")], default=[0, 32, 128, 512],
                   help="ReTopK refresh intervals T_r compared (0 = no refresh)")
    p.add_argument("--prefill", type=int, default=4096, help="prompt tokens P")
    p.add_argument("--continuation", type=int, default=1024, help="decode steps T after the prompt")
    p.add_argument("--docs", type=int, default=1)
    p.add_argument("--windows", type=int, default=8, help="checkpoints reported in the tables")
    p.add_argument("--skip-autoregressive", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def variants(args, head_dim: int):
    return [common.method_run("retopk", args.top_k, head_dim, label=f"retopk T_r={t}", refresh_every=t)
            for t in args.refresh]


def teacher_forced(runner, args, docs, head_dim: int) -> dict:
    """-> label -> concatenated per-step NLL (docs x T), step-aligned across documents."""
    runs = [common.method_run("exact_topk", args.top_k, head_dim, label="exact_topk")] + variants(args, head_dim)
    nll = {r.label: torch.zeros(args.continuation, dtype=torch.float64) for r in runs}
    mixes = {}
    bar = common.progress_bar(len(docs) * args.continuation, "long (teacher-forced)")
    for doc in docs:
        traces = common.teacher_force(runner, runs, doc, args.prefill, progress=bar)
        for label, tr in traces.items():
            nll[label] += torch.tensor(tr.nll, dtype=torch.float64) / len(docs)
            if label in mixes:
                mixes[label].merge(tr.mix)
            else:
                mixes[label] = tr.mix
    bar.close()
    return {"nll": nll, "mix": {k: m.summary() for k, m in mixes.items()}}


def delta_curve(nll: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """ΔPPL over the first t tokens, t = 1..T: exp(mean nll[:t] - mean ref[:t]) - 1."""
    t = torch.arange(1, len(nll) + 1, dtype=torch.float64)
    return torch.exp((nll.cumsum(0) - ref.cumsum(0)) / t) - 1.0


@torch.inference_mode()
def autoregressive(runner, args, prompts, head_dim: int) -> dict:
    """-> label -> {"agree": (T,) mean over prompts, "kl": (T,)}."""
    runs = variants(args, head_dim)
    shadow = common.method_run("exact_topk", args.top_k, head_dim, label="exact shadow")
    agree = {r.label: torch.zeros(args.continuation, dtype=torch.float64) for r in runs}
    kl = {r.label: torch.zeros(args.continuation, dtype=torch.float64) for r in runs}
    bar = common.progress_bar(len(prompts) * args.continuation, "long (autoregressive)")
    for prompt in prompts:
        sessions = [runner.open_session(r.spec) for r in runs] + [runner.open_session(shadow.spec) for _ in runs]
        n = len(runs)
        try:
            logits = common.prefill_all(runner, sessions, prompt)  # (2n, V), dense: all equal
            tokens = logits[:n].argmax(-1).tolist()
            for j in range(args.continuation):
                logits, _ = runner.decode(sessions, tokens + tokens)  # each shadow gets its twin's token
                mine, ref = logits[:n].float(), logits[n:].float()
                lp, lq = torch.log_softmax(mine, -1), torch.log_softmax(ref, -1)
                step_kl = (lq.exp() * (lq - lp)).sum(-1)  # (n,) KL(shadow || retopk)
                top_mine, top_ref = mine.argmax(-1), ref.argmax(-1)
                for b, r in enumerate(runs):
                    agree[r.label][j] += float(top_mine[b] == top_ref[b]) / len(prompts)
                    kl[r.label][j] += float(step_kl[b]) / len(prompts)
                tokens = top_mine.tolist()
                bar.update(1)
        finally:
            for s in sessions:
                runner.close_session(s)
    bar.close()
    return {"agree": agree, "kl": kl}


def checkpoints(T: int, n: int) -> list[int]:
    return sorted({max(1, round(T * (i + 1) / n)) for i in range(n)})


def main(argv=None, runner=None) -> dict:
    """Run the evaluation; ``runner`` (a ModelRunner) is reused instead of loading --model when given."""
    args = parse_args(argv)
    runner, started = common.start_run(args, runner)
    head_dim = runner.info.head_dim
    L = args.prefill + args.continuation
    docs = common.corpus_documents(args, runner, args.docs, [L])[L]
    tf = teacher_forced(runner, args, docs, head_dim)
    ref = tf["nll"]["exact_topk"]
    curves = {label: delta_curve(v, ref) for label, v in tf["nll"].items() if label != "exact_topk"}
    cps = checkpoints(args.continuation, args.windows)
    rows_a = [{"method": label, **{f"t{t}": float(c[t - 1]) for t in cps},
               **{k: tf["mix"][label][k] for k in ("reuse", "fallback", "refresh", "promoted", "group_read")}}
              for label, c in curves.items()]
    cols_a = [("method", "method", "")] + [(f"t{t}", f"ΔPPL@{t}", "%") for t in cps] + \
        [c for c in common.mix_columns() if c[0] in ("reuse", "fallback", "refresh", "promoted", "group_read")]
    tables = [("(a) teacher-forced: cumulative ΔPPL against Exact Top-K after t continuation tokens",
               common.markdown_table(rows_a, cols_a))]
    data = {"delta_ppl": {k: v.tolist() for k, v in curves.items()}, "mix": tf["mix"]}
    ar = None
    if not args.skip_autoregressive:
        prompts = [doc[:args.prefill] for doc in docs]
        ar = autoregressive(runner, args, prompts, head_dim)
        rows_b = []
        for label in ar["agree"]:
            a, k = ar["agree"][label], ar["kl"][label]
            t = torch.arange(1, len(a) + 1, dtype=torch.float64)
            run_a, run_k = a.cumsum(0) / t, k.cumsum(0) / t
            rows_b.append({"method": label, "agree": float(a.mean()), "kl": float(k.mean()),
                           **{f"a{c}": float(run_a[c - 1]) for c in cps},
                           **{f"k{c}": float(run_k[c - 1]) for c in cps}})
        cols_b = [("method", "method", ""), ("agree", "top-1 agreement", "%"), ("kl", "mean KL", ".4f")] + \
            [(f"k{c}", f"KL up to {c}", ".4f") for c in cps[1::2]]
        tables.append(("(b) autoregressive against an Exact Top-K shadow fed the same tokens",
                       common.markdown_table(rows_b, cols_b)))
        data["autoregressive"] = {k: {lab: v.tolist() for lab, v in d.items()} for k, d in ar.items()}
    plot = plot_long(curves, ar, args.out / "long_horizon.png")
    meta = common.run_meta(args, runner, started, prefill=args.prefill, continuation=args.continuation, docs=args.docs)
    common.write_results(args.out, "long_horizon", f"Long horizon: {args.prefill}-token prefill, {args.continuation} "
                         f"continuation tokens, {args.docs} document(s), K={args.top_k}", tables, meta, data, [plot])
    return {"curves": curves, "autoregressive": ar, "mix": tf["mix"]}


def plot_long(curves: dict, ar: dict | None, path: Path) -> str:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2 if ar else 1, figsize=(10 if ar else 5.5, 3.6), squeeze=False)
    ax = axes[0, 0]
    for label, c in curves.items():
        ax.plot(range(1, len(c) + 1), 100 * c.numpy(), label=label)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xlabel("continuation tokens t")
    ax.set_ylabel("cumulative ΔPPL vs Exact (%)")
    ax.set_title("(a) teacher-forced", fontsize=9)
    ax.legend(fontsize=7)
    if ar:
        ax = axes[0, 1]
        for label, k in ar["kl"].items():
            t = torch.arange(1, len(k) + 1, dtype=torch.float64)
            ax.plot(t.numpy(), (k.cumsum(0) / t).numpy(), label=f"{label} KL")
        ax.set_xlabel("generated tokens t")
        ax.set_ylabel("mean KL up to t")
        ax2 = ax.twinx()
        for a in ar["agree"].values():
            t = torch.arange(1, len(a) + 1, dtype=torch.float64)
            ax2.plot(t.numpy(), 100 * (a.cumsum(0) / t).numpy(), ls="--", lw=0.8)
        ax2.set_ylabel("top-1 agreement up to t (%, dashed)")
        ax.set_title("(b) autoregressive vs Exact shadow", fontsize=9)
        ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    return common.save_figure(fig, path)


if __name__ == "__main__":
    main()
