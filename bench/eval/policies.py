"""ReTopK's GQA policies side by side: PPL, NIAH and fidelity with the group-read rate, and a Pareto plot.

A ReTopK head on an exact path (fallback, refresh, promoted) reads every key of its KV group, so under
GQA a step costs what its *group reads* cost: the (layer, sequence, KV group, decode step) whose keys
were read in full (``retopk_core.methods.base.group_reads``). The group-read rate is their share; the
per-head fallback share understates it. Each grid entry is a method spec in the --methods syntax of
the other scripts, e.g. ``retopk:gqa_policy=group+tau=0.8+group_tau_min=0.5+cache_size=64+window=128``;
Full and Exact Top-K (same K) are always added as references.

Stages (--parts):
  ppl       every grid method: PPL of the last S tokens of N documents per length, teacher-forced as in
            bench.eval.perplexity, its change against Exact Top-K, the path mix, the group-read rate
  niah      the --detail methods and both references: RULER-style needles as in bench.eval.niah, with the
            group-read rate of the question and answer steps
  fidelity  the --detail methods and Exact Top-K: support recall, retained mass, output cosine as in
            bench.eval.fidelity, on the first --fidelity-docs documents of the longest length

--detail front (default) takes the ReTopK rows of the ppl stage that no other row beats on both ΔPPL and
group-read rate at every length. With --resume every (stage, method) already in <out>/policies.json under
the same settings is kept, so the grid can grow, or the detail stages follow the ppl stage, without
recomputing. The targets (--target-dppl, --target-group-read, NIAH >= Exact Top-K at every length) are
checked per row. --versus names the setting every row is also compared with on the same documents ("vs
default": the paired per-document change ``paired_change``; by default the server's default method, when the
grid holds it). Writes policies.md, policies.json and policies_pareto.png into --out.

    python -m bench.eval.policies --lengths 4096 8192 --docs 4 --suffix 128 --parts ppl --out results/policies
    python -m bench.eval.policies --lengths 4096 8192 --docs 4 --suffix 128 --parts ppl,niah,fidelity \\
        --resume --out results/policies
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from bench.eval import common, fidelity, niah, perplexity

REFERENCES = "full,exact_topk"
EXACT, FULL = "exact_topk", "full"
GRID = ",".join(
    ["retopk:gqa_policy=head+tau=0.85", "retopk:gqa_policy=head+tau=0.9",
     "retopk:gqa_policy=promote+tau=0.85", "retopk:gqa_policy=promote+tau=0.9"]
    + [f"retopk:gqa_policy=group+tau={t}+group_tau_min={m}" for t in (0.75, 0.8, 0.85) for m in (0, 0.5)])
NAME = "policies"
VERSUS_DEFAULT = "default"


def parse_args(argv=None):
    p = common.eval_parser(__doc__)
    g = p.add_argument_group("grid")
    g.add_argument("--methods", default=GRID, help="comma-separated method specs ('+' between parameters); Full "
                                                   "and Exact Top-K are added as references")
    g.add_argument("--top-k", type=int, default=common.DEFAULT_TOP_K, help="shared active-token budget K")
    g.add_argument("--batch", type=int, default=12, help="methods decoded per forward (memory bound; 0 = all)")
    g.add_argument("--parts", default="ppl,niah,fidelity", help="comma-separated subset of ppl,niah,fidelity")
    g.add_argument("--detail", default="front",
                   help="methods of the niah and fidelity stages: 'front' (the ppl stage's Pareto front), 'all', "
                        "or a comma-separated list of grid specs")
    g.add_argument("--resume", action="store_true", help="keep results in <out>/policies.json with the same settings")
    g.add_argument("--versus", default=VERSUS_DEFAULT,
                   help="the grid setting every row is also compared with, paired on the same documents: a --methods "
                        f"spec, '{VERSUS_DEFAULT}' (the server's default method, when --methods holds it) or 'none'")
    g = p.add_argument_group("perplexity")
    g.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192], help="document lengths L")
    g.add_argument("--docs", type=int, default=4, help="documents per length")
    g.add_argument("--suffix", type=int, default=128, help="teacher-forced steps per document")
    g = p.add_argument_group("needle in a haystack")
    g.add_argument("--niah-lengths", type=int, nargs="+", default=None, help="context lengths (default --lengths)")
    g.add_argument("--tasks", default=",".join(niah.TASKS))
    g.add_argument("--depths", type=int, default=3, help="evenly spaced needle depths per task and length")
    g.add_argument("--needles", type=int, default=3, help="needles in multikey / values in multivalue")
    g.add_argument("--max-new", type=int, default=0, help="answer tokens (default 12 per expected value + 4)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prefill-question", action="store_true",
                   help="the serving protocol of bench.eval.niah: the question is prefilled with the context, only "
                        "the prompt's last token and the answer are decoded by the method")
    g = p.add_argument_group("fidelity")
    g.add_argument("--fidelity-docs", type=int, default=2, help="first documents of the longest length")
    g.add_argument("--fidelity-suffix", type=int, default=0, help="steps per document (default --suffix)")
    g = p.add_argument_group("targets")
    g.add_argument("--target-dppl", type=float, default=0.01, help="largest PPL change against Exact Top-K")
    g.add_argument("--target-group-read", type=float, default=0.25, help="largest group-read rate")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


# ---- labels -------------------------------------------------------------------------------------
def describe(run) -> dict:
    """The ReTopK hyperparameters of a run with the core's defaults filled in (empty for other methods)."""
    if run.name != "retopk":
        return {}
    from retopk_core.retopk_config import ReTopKConfig

    params = dict(run.spec.params)
    fields = ReTopKConfig.__dataclass_fields__
    cfg = ReTopKConfig(**{k: v for k, v in params.items() if k in fields})
    return {k: getattr(cfg, k) for k in fields}


def short_label(run) -> str:
    """'group tau=0.8 min=0.5 C=64 W=128': the policy, tau, and the hyperparameters off the core's defaults."""
    d = describe(run)
    if not d:
        return run.label
    from retopk_core.retopk_config import ReTopKConfig

    base = ReTopKConfig(top_k=d["top_k"])
    parts = [d["gqa_policy"], f"tau={d['tau']:g}"]
    if d["gqa_policy"] == "group":
        parts.append(f"min={d['group_tau_min']:g}")
    names = {"cache_size": "C", "window": "W", "recall": "R", "refresh_every": "T_r", "retrieval": "retrieval",
             "tau_calibration": "r*", "refresh_stagger": "stagger", "refresh_guard": "r_g",
             "mass_recall": "mass", "tau_guard": "r_t", "tau_guard_margin": "m_t", "recall_successors": "succ",
             "refresh_first": "onset"}
    parts += [f"{n}={d[k]}" for k, n in names.items() if d[k] != getattr(base, k)]
    return " ".join(parts)


def spec_key(run) -> str:
    return json.dumps([run.name, [[k, v] for k, v in run.spec.params]])


# ---- stored results -----------------------------------------------------------------------------
def stage_settings(args, runner, stage: str) -> dict:
    info = runner.info
    base = {"model": info.name, "weights": info.weight_format, "kv_dtype": info.kv_dtype, "backend": info.backend,
            "corpus": args.corpus, "rope_scaling": args.rope_scaling, "top_k": args.top_k}
    if stage == "ppl":
        return {**base, "lengths": args.lengths, "docs": args.docs, "suffix": args.suffix}
    if stage == "niah":
        # prefill_question only when set, so that stores of the paper's protocol made before the option resume
        return {**base, "tasks": args.tasks, "depths": args.depths, "needles": args.needles, "max_new": args.max_new,
                "seed": args.seed, **({"prefill_question": True} if args.prefill_question else {})}  # per length
    return {**base, "length": max(args.lengths), "docs": args.fidelity_docs, "of_docs": args.docs,
            "suffix": args.fidelity_suffix or args.suffix}


def load_store(args, runner) -> dict:
    """{stage: {"settings", "seconds", "methods": {label: {"spec", ...}}}} from a previous run, or empty."""
    path = args.out / f"{NAME}.json"
    store = {s: {"settings": stage_settings(args, runner, s), "seconds": 0.0, "methods": {}}
             for s in ("ppl", "niah", "fidelity")}
    if not (args.resume and path.is_file()):
        return store
    old = json.loads(path.read_text()).get("stages", {})
    for stage, cur in store.items():
        prev = old.get(stage)
        if prev and prev.get("settings") == cur["settings"]:
            cur["methods"], cur["seconds"] = prev["methods"], prev.get("seconds", 0.0)
        elif prev and prev.get("methods"):
            print(f"   {stage}: stored results were made with other settings; recomputing", flush=True)
    return store


def missing(store: dict, stage: str, runs) -> list:
    have = store[stage]["methods"]
    return [r for r in runs if r.label not in have or have[r.label]["spec"] != spec_key(r)]


# ---- stages -------------------------------------------------------------------------------------
def run_ppl(args, runner, text: str, runs, store: dict) -> None:
    todo = missing(store, "ppl", runs)
    print(f"== ppl: {len(todo)} of {len(runs)} methods to run at L = {args.lengths}, {args.docs} documents x "
          f"{args.suffix} steps", flush=True)
    if not todo:
        return
    t = time.time()
    encode = lambda s: runner.encode(s, add_special_tokens=False)  # noqa: E731
    docs = {L: common.split_documents(text, encode, args.docs, L) for L in args.lengths}
    result = perplexity.evaluate(runner, todo, docs, args.suffix, desc="policies ppl", batch=args.batch)
    for r in todo:
        store["ppl"]["methods"][r.label] = {"spec": spec_key(r), **{str(L): result[L][r.label] for L in result}}
    store["ppl"]["seconds"] += time.time() - t


def run_niah(args, runner, text: str, runs, store: dict, checkpoint=None) -> None:
    """One length at a time, stored (and ``checkpoint()`` called) after each, so a stopped run loses one length."""
    lengths, tasks = args.niah_lengths or args.lengths, [x for x in args.tasks.split(",") if x]
    have = store["niah"]["methods"]
    for L in lengths:
        todo = [r for r in runs if str(L) not in niah_entry(have, r).get("lengths", {})]
        print(f"== niah L={L}: {len(todo)} of {len(runs)} methods to run, {len(tasks)} tasks x {args.depths} depths",
              flush=True)
        if not todo:
            continue
        t = time.time()
        res = niah.evaluate(runner, todo, text, [L], tasks, args.depths, args.needles, args.max_new, True, args.seed,
                            desc=f"policies niah {L}", batch=args.batch, prefill_question=args.prefill_question)
        for r in todo:
            if not niah_entry(have, r):
                have[r.label] = {"spec": spec_key(r), "lengths": {}}
            have[r.label]["lengths"][str(L)] = {"records": [x for x in res["records"] if x["method"] == r.label],
                                                "mix": res["mix"][r.label][L].summary()}
        store["niah"]["seconds"] += time.time() - t
        if checkpoint is not None:
            checkpoint()


def niah_entry(have: dict, run) -> dict:
    entry = have.get(run.label)
    return entry if entry and entry["spec"] == spec_key(run) else {}


def run_fidelity(args, runner, text: str, runs, store: dict) -> None:
    todo = missing(store, "fidelity", runs)
    L, suffix = max(args.lengths), args.fidelity_suffix or args.suffix
    print(f"== fidelity: {len(todo)} of {len(runs)} methods to run, {args.fidelity_docs} documents of L = {L} x "
          f"{suffix} steps", flush=True)
    if not todo:
        return
    t = time.time()
    docs = common.split_documents(text, lambda s: runner.encode(s, add_special_tokens=False), args.docs, L)
    res = fidelity.evaluate(runner, todo, docs[:args.fidelity_docs], suffix, args.top_k, desc="policies fidelity",
                            batch=args.batch)
    rows = {r["method"]: r for r in res["rows"]}
    for r in todo:
        store["fidelity"]["methods"][r.label] = {"spec": spec_key(r), "row": rows[r.label]}
    store["fidelity"]["seconds"] += time.time() - t


# ---- rows, front, targets -----------------------------------------------------------------------
def table(args, runs, store: dict, versus: str | None = None) -> list[dict]:
    """One row per method: hyperparameters, PPL and its change per length (against Exact Top-K, and paired
    against the ``versus`` label's run: ``vs_<L>`` ± ``vs_se_<L>``), the path mix and group-read rate per
    length, NIAH per length, fidelity, and which targets it meets."""
    ppl, nia, fid = (store[s]["methods"] for s in ("ppl", "niah", "fidelity"))
    niah_lengths, tasks = args.niah_lengths or args.lengths, [x for x in args.tasks.split(",") if x]
    rows = []
    for r in runs:
        d = describe(r)
        row = {"method": r.label, "policy": short_label(r), "gqa_policy": d.get("gqa_policy"), "tau": d.get("tau"),
               "group_tau_min": d.get("group_tau_min"), "C": d.get("cache_size"), "W": d.get("window"),
               "R": d.get("recall")}
        for L in args.lengths:
            per, ref = ppl.get(r.label, {}).get(str(L)), ppl.get(EXACT, {}).get(str(L))
            if per is None:
                continue
            row[f"ppl_{L}"] = per["ppl"]
            row[f"dppl_{L}"] = per["ppl"] / ref["ppl"] - 1.0 if ref else None
            row[f"dppl_se_{L}"] = document_se(per["nll"], ref["nll"], args.suffix) if ref else None
            base = ppl.get(versus, {}).get(str(L)) if versus else None
            if base is not None:
                row[f"vs_{L}"], row[f"vs_se_{L}"] = paired_change(per["nll"], base["nll"], args.suffix)
            row.update({f"{k}_{L}": per["mix"][k] for k in common.MIX_KEYS})
        got = {L: niah_entry(nia, r).get("lengths", {}).get(str(L)) for L in niah_lengths}
        for L, entry in got.items():
            if entry is not None:
                row[f"niah_{L}"] = niah.table_rows(entry["records"], [r], [L], tasks)[0][f"avg_{L}"]
                row[f"niah_group_read_{L}"] = entry["mix"]["group_read"]
        if any(got.values()):
            row["niah"] = _mean([row.get(f"niah_{L}") for L in niah_lengths])
        if r.label in fid:
            src = fid[r.label]["row"]
            row.update({f"fid_{k}": src.get(k) for k in ("recall", "mass", "cosine", "group_read")})
        rows.append(row)
    exact = next((x for x in rows if x["method"] == EXACT), {})
    for row in rows:
        row["meets"] = meets(args, row, exact)
    return rows


def document_se(nll: list[float], ref: list[float], suffix: int) -> float | None:
    """Standard error over documents of the mean per-token NLL difference against the reference (both
    lists hold ``suffix`` predictions per document, in the same order). ΔPPL = exp(mean difference) - 1,
    so this is about its standard error; tokens of one document are correlated, documents are not."""
    n = len(nll) // suffix
    if n < 2 or len(ref) != len(nll):
        return None
    d = [sum(a - b for a, b in zip(nll[i * suffix:(i + 1) * suffix], ref[i * suffix:(i + 1) * suffix], strict=True))
         / suffix for i in range(n)]
    mean = sum(d) / n
    return (sum((x - mean) ** 2 for x in d) / (n - 1) / n) ** 0.5


def paired_change(nll: list[float], base: list[float], suffix: int) -> tuple[float, float | None]:
    """A setting's PPL change against another on the same documents, paired: with d_i the mean per-token NLL
    difference on document i (``suffix`` predictions each, both lists in the same order) and d̄ their mean,

        change = exp(d̄) - 1 = PPL / PPL_base - 1,   ± ``document_se`` (the standard error of d̄ over documents).

    Pairing removes the documents' own spread, which dominates each setting's error against Exact Top-K."""
    if len(nll) != len(base) or not nll:
        raise ValueError(f"paired runs must score the same predictions, got {len(nll)} and {len(base)}")
    return math.exp(sum(a - b for a, b in zip(nll, base, strict=True)) / len(nll)) - 1.0, \
        document_se(nll, base, suffix)


def versus_label(args, grid, head_dim: int) -> str | None:
    """The label of --versus in ``grid``: the server's default method for 'default' (None when the grid does
    not hold it), None for 'none'; a spec the grid lacks is refused."""
    if args.versus == "none":
        return None
    if args.versus == VERSUS_DEFAULT:
        from retopk_server.runtime.runtime_config import DEFAULT_METHOD_PARAMS

        want = common.method_run("retopk", args.top_k, head_dim, **DEFAULT_METHOD_PARAMS)
    else:
        want = common.parse_methods(args.versus, args.top_k, head_dim)[0]
    found = [r.label for r in grid if r.name == want.name and describe(r) == describe(want)
             and (describe(r) or r.spec == want.spec)]
    if not found and args.versus != VERSUS_DEFAULT:
        raise SystemExit(f"--versus {args.versus!r} is not one of --methods")
    return found[0] if found else None


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def meets(args, row: dict, exact: dict) -> str:
    """'ppl,niah,reads' for the targets the row meets; '?' for a target not measured."""
    got = []
    dppl = [row.get(f"dppl_{L}") for L in args.lengths]
    got.append("ppl" if all(v is not None and v <= args.target_dppl for v in dppl) else
               ("?" if any(v is None for v in dppl) else ""))
    Ls = args.niah_lengths or args.lengths
    niah_ok = [row.get(f"niah_{L}") is not None and exact.get(f"niah_{L}") is not None
               and row[f"niah_{L}"] >= exact[f"niah_{L}"] for L in Ls]
    got.append("niah" if all(niah_ok) else ("?" if row.get("niah") is None or exact.get("niah") is None else ""))
    reads = [row.get(f"group_read_{L}") for L in args.lengths]
    got.append("reads" if all(v is not None and v <= args.target_group_read for v in reads) else
               ("?" if any(v is None for v in reads) else ""))
    return ",".join(g for g in got if g)


def pareto_front(rows: list[dict], lengths: list[int]) -> list[dict]:
    """ReTopK rows that no other ReTopK row matches or beats on both ΔPPL and group-read rate at every
    length while beating it on one of them."""
    cand = [r for r in rows if r.get("gqa_policy") and all(r.get(f"dppl_{L}") is not None for L in lengths)]

    def vec(r):
        return [r[f"{k}_{L}"] for L in lengths for k in ("dppl", "group_read")]

    def dominates(a, b):
        va, vb = vec(a), vec(b)
        return all(x <= y for x, y in zip(va, vb, strict=True)) and va != vb

    return [r for r in cand if not any(dominates(o, r) for o in cand if o is not r)]


def detail_runs(args, grid, rows: list[dict]) -> list:
    if args.detail == "all":
        return list(grid)
    if args.detail == "front":
        front = {r["method"] for r in pareto_front(rows, args.lengths)}
        return [r for r in grid if r.label in front]
    wanted = [r.label for r in common.parse_methods(args.detail, args.top_k, 64)]
    labels = {r.label: r for r in grid}
    unknown = [w for w in wanted if w not in labels]
    if unknown:
        raise SystemExit(f"--detail names methods not in --methods: {unknown}")
    return [labels[w] for w in wanted]


# ---- output -------------------------------------------------------------------------------------
def write(args, runner, started: float, runs, rows: list[dict], store: dict, details: list) -> None:
    Ls, nLs = args.lengths, args.niah_lengths or args.lengths
    per_length = [c for L in Ls for c in ((f"ppl_{L}", f"PPL {L}", ".3f"), (f"dppl_{L}", f"ΔPPL {L}", "%"),
                                          (f"dppl_se_{L}", "± (docs)", "%"), *versus_columns(rows, L),
                                          (f"group_read_{L}", f"group reads {L}", "%"))]
    main_cols = [("policy", "policy", "")] + per_length + [(f"niah_{L}", f"NIAH {L}", ".1f") for L in nLs] \
        + [("fid_recall", "recall", "%"), ("fid_mass", "mass", "%"), ("fid_cosine", "cosine", "%"),
           ("meets", "targets met", "")]
    mix_cols = [("policy", "policy", "")] + [c for L in Ls for c in common.mix_columns(f"_{L}", str(L))]
    front = pareto_front(rows, Ls)
    tables = [(f"PPL and its change against Exact Top-K (± one standard error over the documents of the paired "
               f"per-token NLL difference; 'vs default': against --versus {args.versus}, paired the same way), "
               f"group-read rate (teacher-forced decode), NIAH (mean of "
               f"{args.tasks.replace(',', ' / ')}), fidelity at L={max(Ls)}; targets: ΔPPL <= {args.target_dppl:.0%} "
               f"('ppl'), NIAH >= Exact Top-K ('niah'), group reads <= {args.target_group_read:.0%} ('reads')",
               common.markdown_table(rows, main_cols)),
              ("Path mix (share of layer x head x step) and group reads (share of layer x KV group x step) of the "
               "perplexity run", common.markdown_table(rows, mix_cols)),
              ("Pareto front (ΔPPL and group reads at every length)",
               common.markdown_table(front, [("policy", "policy", "")] + [c for L in Ls for c in (
                   (f"dppl_{L}", f"ΔPPL {L}", "%"), (f"group_read_{L}", f"group reads {L}", "%"))]))]
    if any(f"niah_group_read_{nLs[-1]}" in r for r in rows):
        tables.append(("Group reads of the NIAH question and answer steps",
                       common.markdown_table([r for r in rows if "niah" in r], [("policy", "policy", "")] +
                                             [(f"niah_group_read_{L}", f"group reads {L}", "%") for L in nLs])))
    plot = plot_pareto(rows, Ls, args, args.out / f"{NAME}_pareto.png", {r.label for r in details}) \
        if any(f"dppl_{Ls[0]}" in r for r in rows) else None
    seconds = {s: round(store[s]["seconds"], 1) for s in store}
    meta = common.run_meta(args, runner, started, lengths=Ls, docs=args.docs, suffix=args.suffix, stage_seconds=seconds,
                           detail=[r.label for r in details])
    common.write_results(args.out, NAME, f"ReTopK GQA policies, K={args.top_k}, {args.docs} documents x {args.suffix} "
                         f"teacher-forced steps at L = {', '.join(map(str, Ls))}", tables, meta,
                         {"rows": rows, "front": [r["method"] for r in front], "stages": store},
                         [plot] if plot else [])


def versus_columns(rows: list[dict], L: int) -> list[tuple[str, str, str]]:
    """The paired 'vs default' columns at length L, when some row has them."""
    if not any(r.get(f"vs_{L}") is not None for r in rows):
        return []
    return [(f"vs_{L}", f"vs default {L}", "%"), (f"vs_se_{L}", "±", "%")]


MARKERS = {"head": "o", "promote": "s", "group": "^"}


def plot_pareto(rows: list[dict], lengths: list[int], args, path: Path, named: set | None = None) -> str:
    """One panel per length: ΔPPL against Exact Top-K over the group-read rate, one marker per method,
    the Pareto front as a line, the targets as dashed lines. Front points, the references and ``named``
    labels carry their label; a reference below the ReTopK points' range is drawn at the lower edge."""
    from retopk_core.retopk_config import ReTopKConfig

    plt = common.pyplot()
    base = ReTopKConfig()
    fig, axes = plt.subplots(1, len(lengths), figsize=(7 * len(lengths), 5.2), squeeze=False)
    cmap = plt.get_cmap("viridis")
    taus = sorted({r["tau"] for r in rows if r.get("tau") is not None}) or [0.0]
    named = named or set()
    for ax, L in zip(axes[0], lengths, strict=True):
        pts = [r for r in rows if r.get(f"dppl_{L}") is not None]
        front = sorted(pareto_front(pts, [L]), key=lambda r: r[f"group_read_{L}"])
        ys = [100 * r[f"dppl_{L}"] for r in pts if r.get("gqa_policy") or r["method"] == EXACT]
        lo, hi = min(ys + [-1.0]) - 1.0, max(ys + [1.0]) + 1.0
        for r in pts:
            x, y = 100 * r[f"group_read_{L}"], 100 * r[f"dppl_{L}"]
            label = r["policy"]
            if r.get("gqa_policy"):
                tuned = (r["C"], r["W"], r["R"]) != (base.cache_size, base.window, base.recall)
                color = cmap(taus.index(r["tau"]) / max(1, len(taus) - 1))
                ax.scatter(x, y, marker=MARKERS[r["gqa_policy"]], s=46, color="none" if tuned else color,
                           edgecolors=color, linewidths=1.5, zorder=3)
            else:
                if y < lo:
                    label, y = f"{label} ({y:+.1f}%, off scale)", lo + 0.3
                ax.scatter(x, y, marker="X" if r["method"] == EXACT else "*", s=90, color="black", zorder=3)
            if r in front or not r.get("gqa_policy") or r["method"] in named:
                ax.annotate(label, (x, y), fontsize=6, xytext=(4, 3), textcoords="offset points")
        ax.plot([100 * r[f"group_read_{L}"] for r in front], [100 * r[f"dppl_{L}"] for r in front], color="tab:red",
                lw=0.8, zorder=2)
        ax.axhline(100 * args.target_dppl, color="gray", ls="--", lw=0.7)
        ax.axvline(100 * args.target_group_read, color="gray", ls="--", lw=0.7)
        ax.axhline(0, color="gray", lw=0.4)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("group-read rate (% of layer x KV group x step read in full)")
        ax.set_ylabel("ΔPPL vs Exact Top-K (%)")
        ax.set_title(f"L = {L}, K = {args.top_k}; red: Pareto front, dashed: targets", fontsize=9)
    handles = [plt.Line2D([], [], marker=m, ls="", color="gray", label=p) for p, m in MARKERS.items()]
    handles += [plt.Line2D([], [], marker="o", ls="", mfc="none", color="gray", label="C, W or R retuned (hollow)"),
                plt.Line2D([], [], marker="X", ls="", color="black", label="Exact Top-K"),
                plt.Line2D([], [], marker="*", ls="", color="black", label="Full")]
    handles += [plt.Line2D([], [], marker="o", ls="", color=cmap(i / max(1, len(taus) - 1)), label=f"tau {t:g}")
                for i, t in enumerate(taus)]
    fig.legend(handles=handles, fontsize=7, loc="lower center", ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    common.pyplot().close(fig)
    return str(path)


def main(argv=None, runner=None) -> dict:
    """Run the stages; ``runner`` (a ModelRunner) is reused instead of loading --model when given."""
    args = parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    bad = set(parts) - {"ppl", "niah", "fidelity"}
    if bad:
        raise SystemExit(f"unknown parts {sorted(bad)}; choose from ppl, niah, fidelity")
    runner, started = common.start_run(args, runner)
    head_dim = runner.info.head_dim
    refs = common.parse_methods(REFERENCES, args.top_k, head_dim)
    grid = [r for r in common.parse_methods(args.methods, args.top_k, head_dim) if r.label not in (EXACT, FULL)]
    runs = refs + grid
    if len({r.label for r in runs}) != len(runs):
        raise SystemExit("--methods lists a method twice")
    versus = versus_label(args, grid, head_dim)
    text = common.load_corpus(args.corpus)
    store = load_store(args, runner)
    details = []

    def checkpoint():
        write(args, runner, started, runs, table(args, runs, store, versus), store, details)

    if "ppl" in parts:
        run_ppl(args, runner, text, runs, store)
        checkpoint()
    if {"niah", "fidelity"} & set(parts):
        details = detail_runs(args, grid, table(args, runs, store, versus))
        print(f"   detail methods: {[short_label(r) for r in details]}", flush=True)
    if "niah" in parts:
        run_niah(args, runner, text, refs + details, store, checkpoint)
    if "fidelity" in parts:
        run_fidelity(args, runner, text, [r for r in refs if r.label == EXACT] + details, store)
    rows = table(args, runs, store, versus)
    write(args, runner, started, runs, rows, store, details)
    return {"rows": rows, "front": [r["method"] for r in pareto_front(rows, args.lengths)], "store": store}


if __name__ == "__main__":
    main()
