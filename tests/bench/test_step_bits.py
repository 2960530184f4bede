"""bench/step_bits.py: two records by one build compare equal, a moved bit anywhere in a step or in the state the
session leaves is named with its step, and records of other settings are refused."""

from __future__ import annotations

import pytest
import torch

from bench import step_bits
from bench.eval.common import load_corpus
from retopk_core.cpu import launch
from retopk_core.methods.base import Path

pytestmark = [pytest.mark.skipif(not launch.available(),
                                 reason="fused CPU kernel not built: run `python -m retopk_core.cpu.build`"),
              pytest.mark.slow]  # the records: two runners on the embedded model

# ReTopK small enough that a 160-token prompt takes every path within 10 steps (dense_below 0: no dense floor)
SPARSE = "retopk:top_k=16,cache_size=8,window=16,dense_below=0,refresh_every=4"
LENGTH, STEPS = 160, 10
ARGS = ["--length", str(LENGTH), "--steps", str(STEPS), "--methods", SPARSE, "full", "--threads", "1", "2",
        "--weights", "int4"]  # int4: the fused layers' block products, as the GGUF's weights are served


@pytest.fixture(scope="module")
def runners() -> list:
    """The runners ``records`` made, in order."""
    return []


@pytest.fixture(scope="module")
def records(tmp_path_factory, embedded_model, runners):
    """The folder of two records of ARGS, each by its own runner (on the session's already loaded model)."""
    model, tokenizer = embedded_model
    make_runner = step_bits.make_runner

    def kept(args):
        runners.append(make_runner(args, model, tokenizer))
        return runners[-1]

    root = tmp_path_factory.mktemp("step_bits")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step_bits, "make_runner", kept)
        for name in ("a.pt", "b.pt"):
            assert step_bits.main(["record", str(root / name), *ARGS]) == 0
    return root


def changed(root, edit) -> str:
    """A copy of record b with ``edit(record)`` applied, saved beside it -> its path."""
    rec = torch.load(root / "b.pt")
    edit(rec)
    path = root / "changed.pt"
    torch.save(rec, path)
    return str(path)


def flip_last_bit(t: torch.Tensor, *indices: tuple) -> None:
    """The lowest bit of each ``t[index]`` flipped, in place (a float's last mantissa bit, an integer's parity)."""
    bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()]) if t.is_floating_point() else t
    for index in indices:
        bits[index] ^= 1


def test_a_record_holds_each_runs_greedy_steps_and_the_sessions_state(records, runners):
    rec = torch.load(records / "a.pt")
    assert list(rec["runs"]) == [f"{SPARSE} 1t", f"{SPARSE} 2t", "full 1t", "full 2t"]
    settings = rec["meta"]["settings"]
    assert settings["length"] == LENGTH and settings["weights"].startswith("int4")
    assert settings["activations"] == runners[0].decoder.auto_activations()[0]  # "auto" as the runner resolved it
    for label, run in rec["runs"].items():
        assert run["logits"].shape == (STEPS, run["prefill_logits"].numel())
        # each step's input is the argmax of the logits before it, after the prompt's first LENGTH tokens
        greedy = [int(run["prefill_logits"].argmax()), *run["logits"][:-1].argmax(-1).tolist()]
        assert run["tokens"].tolist()[LENGTH:] == greedy, label
        assert run["path"].shape == run["max_sim"].shape == run["n_scored"].shape == (STEPS, 30, 9)
    sparse = rec["runs"][f"{SPARSE} 1t"]
    taken = set(sparse["path"].unique().tolist())
    assert {int(Path.REUSE), int(Path.FALLBACK), int(Path.REFRESH)} <= taken  # the sparse step's every path
    assert {"state.queries", "state.support", "state.tau", "state.step"} <= set(sparse)
    assert not any(n.startswith("state.") for n in rec["runs"]["full 1t"])  # Full keeps no method state


def test_the_prompt_is_the_corpus_first_tokens(records, embedded_model):
    _, tokenizer = embedded_model
    rec = torch.load(records / "a.pt")
    want = tokenizer.encode(load_corpus("kjv")[:8 * LENGTH])[:LENGTH]
    assert rec["runs"]["full 2t"]["tokens"].tolist()[:LENGTH] == want


def test_the_same_build_records_the_same_bits(records, capsys):
    assert step_bits.main(["compare", str(records / "a.pt"), str(records / "b.pt")]) == 0
    out = capsys.readouterr().out
    assert "4 runs, 0 differ" in out and out.count("same bits") == 4


@pytest.mark.parametrize(("field", "indices", "named"), [
    ("logits", [(3, 1234)], "logits (first at step 3, 1 of 10 steps, max |a - b|"),
    ("max_sim", [(7, 0, 0), (2, 5, 5), (2, 6, 6), (9, 1, 1)], "max_sim (first at step 2, 3 of 10 steps, max |a - b|"),
    ("path", [(6, 29, 8)], "path (first at step 6, 1 of 10 steps)"),
    ("n_scored", [(0, 0, 0)], "n_scored (first at step 0, 1 of 10 steps)"),
    ("state.tau", [(17, 4)], "state.tau"),
    ("state.support", [(2, 3, 1, 5)], "state.support"),
    ("k", [(29, 0, 2, 100, 63)], "k"),
    ("prefill_logits", [(7,)], "prefill_logits"),
])
def test_a_moved_bit_is_named_with_its_run_and_step(records, capsys, field, indices, named):
    run = f"{SPARSE} 2t"
    path = changed(records, lambda rec: flip_last_bit(rec["runs"][run][field], *indices))
    assert step_bits.main(["compare", str(records / "a.pt"), path]) == 1
    lines = capsys.readouterr().out.splitlines()
    line = next(line for line in lines if line.startswith(f"  {run}:"))
    assert line.startswith(f"  {run}: differ: {named}") and "; " not in line  # that field alone
    assert sum("same bits" in line for line in lines) == 3 and lines[-1] == "step_bits: 4 runs, 1 differ"


def test_a_nan_is_the_same_bits_as_itself_and_a_signed_zero_is_not():
    a = torch.tensor([[float("nan"), 0.0]])
    assert step_bits.field_difference("max_sim", a, a.clone()) is None  # torch.equal would call these unequal
    assert step_bits.field_difference("max_sim", a, torch.tensor([[float("nan"), -0.0]])).startswith(
        "max_sim (first at step 0, 1 of 1 steps")


@pytest.mark.parametrize(("key", "value"), [("length", LENGTH + 1), ("activations", "int8"), ("isa", "avx2")])
def test_records_of_other_settings_are_refused_naming_the_setting(records, capsys, key, value):
    path = changed(records, lambda rec: rec["meta"]["settings"].__setitem__(key, value))
    assert step_bits.main(["compare", str(records / "a.pt"), path]) == 2
    out = capsys.readouterr().out
    assert f"not compared: {key}: " in out and repr(value) in out
    assert " runs, " not in out  # no run compared


def test_a_run_one_record_lacks_is_named(records, capsys):
    path = changed(records, lambda rec: rec["runs"].pop("full 1t"))
    assert step_bits.main(["compare", path, str(records / "a.pt")]) == 1
    assert "  full 1t: differ: the run (in one record only)" in capsys.readouterr().out


def test_packages_imported_from_another_checkout_are_named(monkeypatch):
    assert not any(f.startswith("retopk_core ") for f in step_bits.foreign_packages())  # this checkout's (the cwd)
    monkeypatch.setattr(step_bits, "__file__", "/elsewhere/bench/step_bits.py")
    assert [f.split(" from ")[0] for f in step_bits.foreign_packages()] == ["retopk_core", "retopk_server"]
