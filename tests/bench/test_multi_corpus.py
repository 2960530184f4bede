"""The multi-corpus evaluation (issue 35): the named corpora, the leave-one-corpus-out selection rule
against hand-worked cases, and bench.eval.multi_corpus end to end on the tiny model of
test_eval_scripts over two generated corpora."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

from tests.bench.test_eval_scripts import make_corpus, tiny  # noqa: F401 - tiny is a fixture


# ---- corpora -------------------------------------------------------------------------------------
def test_python_stdlib_takes_the_newest_version_numerically_and_orders_files(tmp_path):
    from bench.eval import corpora

    for version, files in (("python3.9", ("os.py", "zz.py")), ("python3.11", ("os.py", "b.py", "a.py"))):
        for name in files:
            (tmp_path / version).mkdir(exist_ok=True)
            (tmp_path / version / name).write_text(f"x = '{version}/{name}'\n")
    (tmp_path / "python3.12").mkdir()  # no os.py: not a standard library
    assert corpora.python_stdlib_dir(tmp_path).name == "python3.11"  # 11 > 9, though "3.9" > "3.11" as text
    assert corpora.python_stdlib_text(tmp_path) == (
        "# file: a.py\nx = 'python3.11/a.py'\n\n# file: b.py\nx = 'python3.11/b.py'\n\n"
        "# file: os.py\nx = 'python3.11/os.py'\n\n")


def test_jargon_starts_at_the_first_lexicon_entry(tmp_path, monkeypatch):
    from bench.eval import corpora

    raw = "The Jargon File\n\nGlossary\n\n   crufty\n\n   cruft\n\n   :(TM): //\n\n   Text.\n\n   :0:\n\n   Zero.\n"
    path = tmp_path / "jargon.txt.gz"
    path.write_bytes(gzip.compress(raw.encode()))
    monkeypatch.setattr(corpora, "JARGON", path)
    assert corpora.load("jargon") == "   :(TM): //\n\n   Text.\n\n   :0:\n\n   Zero.\n"


def test_a_missing_package_names_itself(tmp_path, monkeypatch):
    from bench.eval import corpora

    monkeypatch.setattr(corpora, "DEBIAN_REFERENCE", tmp_path / "absent.txt.gz")
    with pytest.raises(SystemExit, match="debian-reference-en"):
        corpora.load("debian-reference")


@pytest.mark.parametrize("name, marker", [("debian-reference", "apt"), ("jargon", ":hacker: n."),
                                          ("python-stdlib", "# file: os.py")])
def test_installed_corpora_are_long_running_text(name, marker):
    from bench.eval import corpora

    try:
        text = corpora.load(name)
    except SystemExit as e:
        pytest.skip(str(e))
    assert marker in text and len(text) > 800_000  # >= 6 documents of 8K tokens at ~4 characters a token


# ---- the selection rule --------------------------------------------------------------------------
def _rows(table: dict) -> dict:
    """{corpus: {setting: (ΔPPL, group reads)}} at one length L = 1 -> policies-style rows."""
    return {c: {s: {"policy": s, "dppl_1": d, "dppl_se_1": 0.001, "group_read_1": g} for s, (d, g) in per.items()}
            for c, per in table.items()}


ROWS = _rows({
    # "cheap" reads few groups and is fine on a, b but poor on c; "safe" reads more and holds everywhere;
    # "greedy" is the best on PPL but reads too many groups
    "a": {"cheap": (0.002, 0.10), "safe": (0.004, 0.20), "greedy": (-0.01, 0.60)},
    "b": {"cheap": (0.001, 0.12), "safe": (0.006, 0.22), "greedy": (-0.02, 0.55)},
    "c": {"cheap": (0.030, 0.11), "safe": (0.008, 0.24), "greedy": (0.000, 0.50)},
})


def test_leave_one_out_picks_on_the_others_and_reports_the_held_out_numbers():
    from bench.eval.cross_validation import leave_one_out, select, worst, worst_corpus

    # worked by hand: holding out c, "cheap" (worst 0.2%) beats "safe" (0.6%), "greedy" reads > 25%;
    # holding out a or b, c's 3.0% rules "cheap" out in favour of "safe"
    cv = {r["held_out"]: r for r in leave_one_out(ROWS, ["cheap", "safe", "greedy"], ["a", "b", "c"], [1], 0.25)}
    assert {h: r["chosen"] for h, r in cv.items()} == {"a": "safe", "b": "safe", "c": "cheap"}
    assert cv["c"]["dppl_1"] == 0.030 and cv["c"]["group_read_1"] == 0.11  # the held-out corpus's own numbers
    assert cv["c"]["train_worst_dppl"] == 0.002 and cv["a"]["train_worst_dppl"] == 0.008
    assert all(r["feasible"] for r in cv.values())
    assert worst(ROWS, "safe", ["a", "b", "c"], [1], "group_read") == 0.24
    assert worst_corpus(ROWS, "cheap", ["a", "b", "c"], [1]) == "c"
    # nobody meets a 5% reads target: the smallest worst ΔPPL over all, marked infeasible
    assert select(ROWS, ["cheap", "safe", "greedy"], ["a", "b"], [1], 0.05) == ("greedy", False)
    with pytest.raises(ValueError):
        select(ROWS, ["unmeasured"], ["a"], [1], 0.25)


# ---- end to end -----------------------------------------------------------------------------------
def test_corpus_docs_give_the_named_corpora_their_own_document_count(tmp_path):
    from bench.eval import multi_corpus, policies

    argv = ["--docs", "4", "--corpora", "kjv,jargon", "--corpus-docs", "jargon=12", "--out", str(tmp_path)]
    args, rest = multi_corpus.parse_args(argv)
    docs = {c: policies.parse_args(multi_corpus.corpus_argv(args, rest, c, "ppl")).docs for c in ("kjv", "jargon")}
    assert docs == {"kjv": 4, "jargon": 12}
    for bad in ("jargon=1", "jargon=257", "debian-reference=8", "jargon", "jargon=x"):
        with pytest.raises(SystemExit):
            multi_corpus.parse_args([*argv[:4], "--corpus-docs", bad, "--out", str(tmp_path)])


def test_multi_corpus_runs_every_corpus_and_cross_validates(tiny, tmp_path):  # noqa: F811
    from bench.eval import multi_corpus, policies

    model, corpus = tiny
    second = tmp_path / "other.txt"
    second.write_text(make_corpus(seed=1))
    grid = "retopk:tau=1.0,retopk:tau=0.8"
    argv = ["--model", model, "--top-k", "16", "--lengths", "240", "--docs", "2", "--suffix", "8", "--methods", grid,
            "--parts", "ppl,niah", "--niah-lengths", "400", "--depths", "2", "--needles", "2", "--max-new", "4",
            "--prefill-question", "--versus", "retopk:tau=0.8", "--corpora", f"{corpus},{second}",
            "--out", str(tmp_path / "out")]
    res = multi_corpus.main(argv)
    data = json.loads((tmp_path / "out" / "multi_corpus.json").read_text())
    assert (tmp_path / "out" / "multi_corpus.md").is_file()
    assert set(res["rows"]) == {"corpus", "other"}
    for name, path in (("corpus", corpus), ("other", second)):
        own = json.loads((tmp_path / "out" / name / "policies.json").read_text())
        assert own["meta"]["corpus"] == str(path) and own["stages"]["niah"]["settings"]["prefill_question"]
        assert {r["method"]: r["ppl_240"] for r in own["rows"]} == \
            {m: r["ppl_240"] for m, r in res["rows"][name].items()}
        # tau = 1 falls back on every head-step: Exact Top-K's PPL on each corpus
        assert res["rows"][name]["retopk tau=1.0"]["ppl_240"] == pytest.approx(
            res["rows"][name][policies.EXACT]["ppl_240"], rel=1e-6)
    assert res["rows"]["corpus"]["exact_topk"]["ppl_240"] != res["rows"]["other"]["exact_topk"]["ppl_240"]
    # --versus: every row's paired change against tau = 0.8 on the same documents, the report's column beside ΔPPL
    for per in res["rows"].values():
        assert per["retopk tau=0.8"]["vs_240"] == 0.0
        assert per["retopk tau=1.0"]["vs_240"] == pytest.approx(
            per["retopk tau=1.0"]["ppl_240"] / per["retopk tau=0.8"]["ppl_240"] - 1.0, rel=1e-6)
    assert "vs default 240" in (tmp_path / "out" / "multi_corpus.md").read_text()
    cv = data["cross_validation"]
    assert [r["held_out"] for r in cv] == ["corpus", "other"]
    for rec in cv:
        assert rec["dppl_240"] == res["rows"][rec["held_out"]][rec["chosen"]]["dppl_240"]
    # resumed: nothing recomputed (the stages' seconds stay), the same numbers
    seconds = lambda: {s: v["seconds"] for s, v in json.loads(  # noqa: E731
        (tmp_path / "out" / "corpus" / "policies.json").read_text())["stages"].items()}
    before = seconds()
    again = multi_corpus.main(argv)
    ppl = lambda r: {c: {m: x["ppl_240"] for m, x in per.items()} for c, per in r["rows"].items()}  # noqa: E731
    assert ppl(again) == ppl(res) and seconds() == before
    shutil.rmtree(tmp_path / "out")
