"""Choosing ReTopK settings on some corpora and checking them on the others (issue 35).

Input: ``rows[corpus][label]``, one ``bench.eval.policies`` table row per (corpus, setting), holding
``dppl_<L>`` (ΔPPL against Exact Top-K at the same K), ``dppl_se_<L>`` (its standard error over
documents) and ``group_read_<L>`` (the group-read rate) per context length L.

Selection rule on a set T of training corpora, over candidate settings s:

    worst_T(s) = max over c in T and L of ΔPPL_c,L(s)
    feasible   = { s : group_read_c,L(s) <= max_reads for every c in T and L }
    chosen     = argmin over feasible of worst_T(s)    (ties: the lower worst group-read rate)

(when no setting is feasible, the argmin over all of them, marked). Leave-one-corpus-out: for each
corpus h the rule runs on T = every other corpus, and the chosen setting's numbers on h, which took no
part in choosing it, are its held-out numbers.
"""

from __future__ import annotations


def worst(rows: dict, label: str, corpora: list[str], lengths: list[int], key: str = "dppl") -> float:
    """max over the corpora and lengths of ``<key>_<L>`` of the setting ``label``."""
    return max(rows[c][label][f"{key}_{L}"] for c in corpora for L in lengths)


def worst_corpus(rows: dict, label: str, corpora: list[str], lengths: list[int]) -> str:
    """The corpus where ``label``'s ΔPPL, at its worst length, is largest."""
    return max(corpora, key=lambda c: max(rows[c][label][f"dppl_{L}"] for L in lengths))


def measured(rows: dict, label: str, corpora: list[str], lengths: list[int]) -> bool:
    return all(rows.get(c, {}).get(label, {}).get(f"{k}_{L}") is not None
               for c in corpora for L in lengths for k in ("dppl", "group_read"))


def select(rows: dict, candidates: list[str], train: list[str], lengths: list[int],
           max_reads: float) -> tuple[str, bool]:
    """-> (the chosen setting, whether it met ``max_reads`` on every training corpus), by the rule above."""
    cands = [s for s in candidates if measured(rows, s, train, lengths)]
    if not cands:
        raise ValueError(f"no candidate is measured on every corpus of {train}")
    feasible = [s for s in cands if worst(rows, s, train, lengths, "group_read") <= max_reads]
    pool = feasible or cands
    best = min(pool, key=lambda s: (worst(rows, s, train, lengths), worst(rows, s, train, lengths, "group_read")))
    return best, bool(feasible)


def leave_one_out(rows: dict, candidates: list[str], corpora: list[str], lengths: list[int],
                  max_reads: float) -> list[dict]:
    """One record per held-out corpus h: the setting chosen on the others, its training worst ΔPPL, and its
    ΔPPL (± standard error) and group-read rate per length on h."""
    out = []
    for h in corpora:
        train = [c for c in corpora if c != h]
        chosen, feasible = select(rows, candidates, train, lengths, max_reads)
        rec = {"held_out": h, "chosen": chosen, "feasible": feasible,
               "train_worst_dppl": worst(rows, chosen, train, lengths)}
        for L in lengths:
            row = rows[h][chosen]
            rec.update({f"dppl_{L}": row[f"dppl_{L}"], f"dppl_se_{L}": row.get(f"dppl_se_{L}"),
                        f"group_read_{L}": row[f"group_read_{L}"]})
        out.append(rec)
    return out
