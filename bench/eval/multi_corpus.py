"""PPL, NIAH and fidelity of ReTopK settings on every named corpus, each corpus and the worst reported,
and the settings cross-validated across corpora (issue 35).

One ``bench.eval.policies`` run per corpus (``bench.eval.corpora``: scripture, technical documentation,
source code, modern prose), all on one model load, into <out>/<corpus>/; stage by stage over the
corpora (every corpus's PPL before any NIAH), so a stopped run has the most important numbers. With
--resume each corpus's stored results under the same settings are kept (``policies --resume``).

    python -m bench.eval.multi_corpus --lengths 4096 8192 --docs 4 --suffix 128 --parts ppl,niah \\
        --methods retopk:...,retopk:... --out results/multi

--corpus-docs NAME=N gives the named corpora N documents per length instead of --docs: more where the
standard error over documents is larger than the effect to resolve (issue 35).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.eval import common, corpora, cross_validation, policies


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpora", default=",".join(corpora.CORPORA),
                   help="comma-separated corpus names of bench.eval.corpora (or text file paths)")
    p.add_argument("--corpus-docs", default="", metavar="NAME=N,...",
                   help="documents per length for the named corpora (2 to 256), instead of --docs")
    p.add_argument("--out", type=Path, required=True, help="output folder; one sub-folder per corpus")
    args, rest = p.parse_known_args(argv)
    args.corpus_docs = parse_corpus_docs(p, args.corpus_docs, [c for c in args.corpora.split(",") if c])
    return args, rest


def parse_corpus_docs(p: argparse.ArgumentParser, value: str, names: list[str]) -> dict[str, int]:
    """"kjv=8,jargon=6" -> {"kjv": 8, "jargon": 6}; each name one of ``names``, each count in [2, 256] (two
    documents at least: the standard error needs them)."""
    out = {}
    for item in [x for x in value.split(",") if x]:
        name, _, n = item.partition("=")
        if name not in names or not n.isdigit() or not 2 <= int(n) <= 256:
            p.error(f"--corpus-docs: {item!r} is not NAME=N with NAME one of --corpora ({', '.join(names)}) and N "
                    "in [2, 256]")
        out[name] = int(n)
    return out


def corpus_argv(args, rest: list[str], corpus: str, part: str) -> list[str]:
    """The policies command line of one (corpus, stage); a --corpus-docs count comes last, so it wins."""
    docs = ["--docs", str(args.corpus_docs[corpus])] if corpus in args.corpus_docs else []
    return [*rest, *docs, "--corpus", corpus, "--parts", part, "--resume", "--out", str(args.out / corpus_dir(corpus))]


def corpus_dir(corpus: str) -> str:
    return Path(corpus).stem if corpus not in corpora.CORPORA else corpus


def main(argv=None) -> dict:
    args, rest = parse_args(argv)
    opts = policies.parse_args([*rest, "--out", str(args.out)])  # validates the policies options once
    names = [c for c in args.corpora.split(",") if c]
    runner, started = common.start_run(opts)
    results = {}
    for part in [p for p in opts.parts.split(",") if p]:
        for corpus in names:
            sub = corpus_argv(args, rest, corpus, part)
            print(f"== {corpus} {part}: python -m bench.eval.policies " + " ".join(sub), flush=True)
            argv0, sys.argv = sys.argv, ["bench/eval/policies.py", *sub]  # each corpus records its command
            try:
                results[corpus_dir(corpus)] = policies.main(sub, runner=runner)
            finally:
                sys.argv = argv0
    rows = {c: {r["method"]: r for r in res["rows"]} for c, res in results.items()}
    report(args, opts, runner, started, [corpus_dir(c) for c in names], rows)
    return {"rows": rows}


# ---- report -------------------------------------------------------------------------------------
def ordered_worst_first(rows: dict, label: str, names: list[str], lengths: list[int]) -> list[str]:
    """The corpora by ``label``'s ΔPPL at its worst length, largest first (unmeasured ones last)."""
    done = [c for c in names if cross_validation.measured(rows, label, [c], lengths)]
    return sorted(done, key=lambda c: -max(rows[c][label][f"dppl_{L}"] for L in lengths)) + \
        [c for c in names if c not in done]


def corpus_rows(rows: dict, labels: list[str], names: list[str], lengths: list[int], niah_lengths: list[int]) -> list:
    """Per setting, one row per corpus (worst first) with ΔPPL ± error and group reads per length, NIAH beside
    Exact Top-K's, fidelity, the targets met and whether it is on that corpus's Pareto front of ΔPPL and
    group reads (``policies.pareto_front``); then the setting's worst over the corpora."""
    fronts = {c: {r["method"] for r in policies.pareto_front(list(rows.get(c, {}).values()), lengths)} for c in names}
    out = []
    for label in labels:
        order = ordered_worst_first(rows, label, names, lengths)
        for c in order:
            r = rows[c].get(label, {})
            exact = rows[c].get(policies.EXACT, {})
            row = {"policy": r.get("policy", label), "corpus": c, "kind": corpora.KINDS.get(c, "file"),
                   "meets": r.get("meets"), "front": "yes" if label in fronts[c] else ""}
            for L in lengths:
                row.update({k: r.get(k) for k in (f"dppl_{L}", f"dppl_se_{L}", f"vs_{L}", f"vs_se_{L}",
                                                  f"group_read_{L}")})
            for L in niah_lengths:
                row[f"niah_{L}"], row[f"niah_exact_{L}"] = r.get(f"niah_{L}"), exact.get(f"niah_{L}")
            row.update({k: r.get(k) for k in ("fid_recall", "fid_mass", "fid_cosine")})
            out.append(row)
        done = [c for c in names if cross_validation.measured(rows, label, [c], lengths)]
        if len(done) > 1:
            worst = {"policy": "", "corpus": f"**worst of {len(done)}**"}
            for L in lengths:
                worst[f"dppl_{L}"] = cross_validation.worst(rows, label, done, [L])
                worst[f"group_read_{L}"] = cross_validation.worst(rows, label, done, [L], "group_read")
            out.append(worst)
    return out


def report(args, opts, runner, started: float, names: list[str], rows: dict) -> None:
    """<out>/multi_corpus.md and .json: every setting on every corpus, worst corpus first; the
    leave-one-corpus-out cross-validation of the ReTopK settings."""
    Ls, nLs = opts.lengths, opts.niah_lengths or opts.lengths
    labels = list(dict.fromkeys(label for c in names for label in rows.get(c, {})))
    settings = [label for label in labels if label not in (policies.EXACT, policies.FULL)]
    cols = [("policy", "setting", ""), ("corpus", "corpus (worst first)", ""), ("kind", "kind", "")]
    per_corpus = corpus_rows(rows, settings + [policies.FULL], names, Ls, nLs)
    cols += [c for L in Ls for c in ((f"dppl_{L}", f"ΔPPL {L}", "%"), (f"dppl_se_{L}", "±", "%"),
                                     *policies.versus_columns(per_corpus, L),
                                     (f"group_read_{L}", f"group reads {L}", "%"))]
    cols += [c for L in nLs for c in ((f"niah_{L}", f"NIAH {L}", ".1f"), (f"niah_exact_{L}", "Exact's", ".1f"))]
    cols += [("fid_recall", "recall", "%"), ("fid_mass", "mass", "%"), ("meets", "targets met", ""),
             ("front", "on the front", "")]
    per = {corpus_dir(c): n for c, n in args.corpus_docs.items()}
    docs = ", ".join(f"{c}: {per.get(c, opts.docs)}" for c in names)
    tables = [(f"ΔPPL against Exact Top-K (K = {opts.top_k}) ± one standard error over the documents ({docs}), "
               f"'vs default': the paired change against --versus {opts.versus} on the same documents, group-read "
               f"rate, NIAH beside Exact Top-K's on the same cases, fidelity at L = {max(Ls)}; targets: "
               f"ΔPPL <= {opts.target_dppl:.0%}, NIAH >= Exact Top-K, group reads <= {opts.target_group_read:.0%}",
               common.markdown_table(per_corpus, cols))]
    measured = [c for c in names if all(cross_validation.measured(rows, s, [c], Ls) for s in settings)]
    cv = []
    if len(measured) > 1 and settings:
        cv = cross_validation.leave_one_out(rows, settings, measured, Ls, opts.target_group_read)
        for rec in cv:
            rec["policy"] = rows[rec["held_out"]][rec["chosen"]]["policy"] + ("" if rec["feasible"] else
                                                                               " (none met the reads target)")
        cv_cols = [("held_out", "held-out corpus", ""), ("policy", "chosen on the other corpora", ""),
                   ("train_worst_dppl", "its worst ΔPPL there", "%")]
        cv_cols += [c for L in Ls for c in ((f"dppl_{L}", f"held-out ΔPPL {L}", "%"), (f"dppl_se_{L}", "±", "%"),
                                            (f"group_read_{L}", f"group reads {L}", "%"))]
        tables.append(("Leave one corpus out: the setting with the smallest worst ΔPPL among those reading <= "
                       f"{opts.target_group_read:.0%} of groups on the other corpora, and its numbers on the corpus "
                       "held out", common.markdown_table(cv, cv_cols)))
    meta = common.run_meta(opts, runner, started, corpora=names, lengths=Ls, docs=opts.docs, suffix=opts.suffix,
                           corpus_docs=args.corpus_docs)
    meta["corpus"] = ",".join(names)
    common.write_results(args.out, "multi_corpus", f"ReTopK settings on {len(names)} corpora, K={opts.top_k}, "
                         f"documents ({docs}) x {opts.suffix} teacher-forced steps at L = {', '.join(map(str, Ls))}",
                         tables, meta, {"rows": rows, "cross_validation": cv})


if __name__ == "__main__":
    main()
