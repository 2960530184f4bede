"""bench/vs_llamacpp.py without llama.cpp: the options, the yardstick / ratio / floor arithmetic on given
numbers, the table, and whole runs with a stand-in for llama_cpp (no timing asserted)."""

from __future__ import annotations

import ctypes
import json
import sys
import types

import pytest
import torch

from bench import vs_llamacpp as vs
from bench.e2e_cpu import parse_method
from retopk_core.cpu import decoder_ops
from retopk_server.runtime import ModelRunner, RuntimeConfig


# ---- options -------------------------------------------------------------------------------------
def test_defaults_and_runtime_options():
    args = vs.parse_args([])
    assert args.lengths == [1024, 4096, 8000, 16384, 32000] and args.threads == 2
    assert args.methods == ["full", "default"] and args.rope_factor == 4.0 and args.runtime_options == {}
    args = vs.parse_args(["--runtime", "weights=float32", "prefill_chunk=256", "--lengths", "64",
                          "--runtime", "kv_dtype=float32"])
    assert args.runtime_options == {"weights": "float32", "prefill_chunk": 256, "kv_dtype": "float32"}
    assert args.lengths == [64]


@pytest.mark.parametrize("argv", [["--runtime", "no_such_option=1"], ["--runtime", "model=x"],
                                  ["--runtime", "rope_scaling=4"], ["--runtime", "weights"], ["--rounds", "0"],
                                  ["--new-tokens", "0"], ["--threads", "0"], ["--lengths", "1"],
                                  ["--rope-factor", "0.5"]])
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        vs.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_without_llama_cpp_it_says_how_to_build_it_and_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(SystemExit) as e:
        vs.main(["--lengths", "64"])
    assert e.value.code == 2
    assert "make bench-llamacpp-deps" in capsys.readouterr().out


# ---- arithmetic on given numbers -------------------------------------------------------------------
def test_rope_factor_past_the_trained_positions_only():
    assert vs.positions_needed(8000, 16) == 8017
    assert vs.rope_factor(8017, 8192, 4.0) is None
    assert vs.rope_factor(8192, 8192, 4.0) is None
    assert vs.rope_factor(8193, 8192, 4.0) == 4.0
    assert vs.rope_factor(vs.positions_needed(32000, 16), 8192, 4.0) == 4.0
    with pytest.raises(ValueError, match="trained"):
        vs.rope_factor(32769, 8192, 4.0)


def test_floor():
    assert vs.floor_ms(98_000_000, 20e9) == pytest.approx(4.9)


def _rows() -> list[dict]:
    L = 1000
    return [vs.summarize(L, "llama.cpp flash_attn=off", "llama.cpp", [20.0, 18.0, 19.0], [0.5, 0.4, 0.5],
                         [5, 6, 7, 8], weight_bytes=100_000_000),
            vs.summarize(L, "llama.cpp flash_attn=on", "llama.cpp", [30.0, 40.0, 35.0], [0.25, 0.25, 0.2],
                         [5, 6, 7, 9], weight_bytes=100_000_000),
            vs.summarize(L, "retopk full", "retopk", [40.0, 38.0, 60.0], [1.0, 2.0, 1.0], [5, 6, 1, 8],
                         weight_bytes=500_000_000, method={"method": "full"}),
            vs.summarize(L, "retopk default", "retopk", [9.5, 9.5, 9.5], [0.5, 0.5, 0.5], [5, 6, 7, 8])]


def test_summary_and_yardstick_arithmetic():
    rows = vs.compare(_rows(), bandwidth=10e9, cached={100_000_000: 50e9})
    off, on, full, default = rows
    assert (off["ms_per_token"], off["ms_min"], off["ms_max"]) == (19.0, 18.0, 20.0)  # median over rounds
    assert off["prefill_tok_s"] == 2000.0 and on["prefill_tok_s"] == 4000.0 and full["prefill_tok_s"] == 1000.0
    assert full["ms_per_token"] == 40.0 and full["ms_rounds"] == [40.0, 38.0, 60.0]
    # the yardstick is the better llama.cpp setting for decode (off here), its best prefill for prefill (on)
    assert all(r["yardstick"] == "llama.cpp flash_attn=off" and r["yardstick_ms"] == 19.0 for r in rows)
    assert off["vs_llamacpp"] == 1.0 and on["vs_llamacpp"] == pytest.approx(19 / 35)
    assert full["vs_llamacpp"] == pytest.approx(19 / 40) and default["vs_llamacpp"] == pytest.approx(2.0)
    assert full["prefill_vs_llamacpp"] == pytest.approx(0.25) and on["prefill_vs_llamacpp"] == 1.0
    assert default["prefill_vs_llamacpp"] == pytest.approx(0.5)
    assert [r["same_tokens"] for r in rows] == [4, 3, 2, 4]
    # floors: bytes / bandwidth; the cached one only where a bandwidth over that size was measured
    assert off["floor_ms"] == pytest.approx(10.0) and off["x_floor"] == pytest.approx(1.9)
    assert off["floor_cached_ms"] == pytest.approx(2.0)
    assert full["floor_ms"] == pytest.approx(50.0) and "floor_cached_ms" not in full
    assert "floor_ms" not in default and default.get("x_floor") is None  # no weight bytes given


def test_without_llama_rows_there_is_no_yardstick():
    rows = vs.compare(_rows()[2:], bandwidth=10e9)
    assert all(r["yardstick"] is None and r["vs_llamacpp"] is None and r["prefill_vs_llamacpp"] is None
               for r in rows)


def test_table_lines():
    text = vs.table(vs.compare(_rows(), bandwidth=10e9, cached={100_000_000: 50e9}))
    lines = text.splitlines()
    assert len(lines) == 2 + 4 and lines[0].startswith("| L | engine | ms/token (median) |")
    assert lines[1].count("---") == lines[0].count("|") - 1
    assert lines[2] == ("| 1000 | llama.cpp flash_attn=off | 19.0 | 18.0-20.0 | 2000 | 1.00x | 0.50x | 100.0 "
                        "| 10.0 / 2.0 | 1.90x | 4/4 |")
    assert lines[4] == ("| 1000 | retopk full | 40.0 | 38.0-60.0 | 1000 | 0.47x | 0.25x | 500.0 | 50.0 / - "
                        "| 0.80x | 2/4 |")
    assert lines[5].endswith("| 9.5 | 9.5-9.5 | 2000 | 2.00x | 0.50x | - | - / - | - | 4/4 |")


# ---- runs with a stand-in for llama.cpp ------------------------------------------------------------
VOCAB = 128


class _Tokenizer:
    """Characters -> ids below VOCAB, for a tiny model without a tokenizer of its own."""

    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]


def _tiny_model(positions: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=positions, bos_token_id=None, eos_token_id=None,
                                        pad_token_id=None)).eval()


def _fake_llama_cpp(created: list) -> types.ModuleType:
    """What the script uses of llama_cpp: Llama(...) with reset/eval/n_vocab/ctx/close, llama_get_logits_ith
    (a float* row whose argmax is a function of the tokens seen), llama_print_system_info, __version__."""
    mod = types.ModuleType("llama_cpp")
    mod.__version__ = "0.0-test"

    class Llama:
        def __init__(self, **kwargs):
            self.kwargs, self.n_tokens, self.evals = kwargs, 0, []
            self.row = (ctypes.c_float * VOCAB)()
            self.ctx = self
            created.append(self)

        def n_vocab(self) -> int:
            return VOCAB

        def reset(self) -> None:
            self.n_tokens = 0

        def eval(self, tokens) -> None:
            tokens = list(tokens)
            assert self.n_tokens + len(tokens) <= self.kwargs["n_ctx"]
            self.evals.append(tokens)
            self.n_tokens += len(tokens)
            for i in range(VOCAB):
                self.row[i] = 0.0
            self.row[(7 * self.n_tokens + tokens[-1]) % VOCAB] = 1.0

        def close(self) -> None:
            self.closed = True

    mod.Llama = Llama
    mod.llama_get_logits_ith = lambda ctx, i: ctypes.cast(ctx.row, ctypes.POINTER(ctypes.c_float))
    mod.llama_print_system_info = lambda: b"AVX2 = 1 | test"
    return mod


def test_measure_turns_and_closes_sessions():
    runner = ModelRunner(RuntimeConfig(model="tiny", default_method=parse_method("full")), model=_tiny_model())
    created = []
    lib = _fake_llama_cpp(created)
    engines = [vs.LlamaCppEngine(lib, "x.gguf", 2, 40 + 3 + 16, fa, None) for fa in (False, True)]
    engines += [vs.RetopkEngine(runner, parse_method(m), f"retopk {m}")
                for m in ("full", "retopk:top_k=8,cache_size=4,dense_below=0")]
    ids = torch.randint(0, VOCAB, (40,)).tolist()
    ticks = []
    progress = types.SimpleNamespace(update=ticks.append)
    rows = vs.measure(40, engines, ids, 3, 2, progress, {e.label: 10 for e in engines})
    assert [r["label"] for r in rows] == ["llama.cpp flash_attn=off", "llama.cpp flash_attn=on", "retopk full",
                                          "retopk retopk:top_k=8,cache_size=4,dense_below=0"]
    assert len(ticks) == 2 * 4 and not runner.sessions
    for r in rows:
        assert len(r["ms_rounds"]) == 2 and r["ms_min"] <= r["ms_per_token"] <= r["ms_max"]
        assert r["prefill_tok_s"] > 0 and len(r["tokens"]) == 1 + 1 + 3 and r["weight_bytes"] == 10
    assert rows[2]["method"] == {"method": "full"} and "method" not in rows[0]
    # llama.cpp: every turn resets, evaluates the prompt at once, then one token a step (warm-up + 3)
    llm = created[0]
    assert llm.kwargs["n_ctx"] == 59 and llm.kwargs["flash_attn"] is False and "rope_freq_scale" not in llm.kwargs
    assert llm.kwargs["n_threads"] == llm.kwargs["n_threads_batch"] == 2 and llm.kwargs["logits_all"] is False
    assert [len(t) for t in llm.evals] == [40, 1, 1, 1, 1] * 2 and llm.evals[0] == ids
    assert llm.evals[1] == [rows[0]["tokens"][0]] and llm.evals[2] == [rows[0]["tokens"][1]]  # greedy, fed back
    assert rows[0]["tokens"][0] == (7 * 40 + ids[-1]) % VOCAB


def test_main_with_a_stand_in_llama_cpp(monkeypatch, tmp_path, capsys):
    """The whole run: RoPE scaled (both engines) only for the length past the trained positions, a runner
    per scaling, rows per length and engine with ratios and floors, <out>.json after every length."""
    created, runners = [], []
    monkeypatch.setattr(vs, "import_llama_cpp", lambda: _fake_llama_cpp(created))
    monkeypatch.setattr(vs, "gguf_path", lambda model: tmp_path / "model.gguf")
    monkeypatch.setattr(vs, "gguf_facts", lambda path: (1_000_000, 64))
    monkeypatch.setattr(vs, "dram_bandwidth", lambda: 10e9)
    monkeypatch.setattr(vs, "read_bandwidth", lambda nbytes: 40e9)

    def make_runner(args, spec, rope):
        assert args.runtime_options == {"prefill_chunk": 16}
        scaling = {"rope_type": "linear", "factor": rope} if rope else None
        runner = ModelRunner(RuntimeConfig(model="tiny", default_method=spec, rope_scaling=scaling,
                                           **args.runtime_options), model=_tiny_model(), tokenizer=_Tokenizer())
        runners.append((rope, runner))
        return runner

    monkeypatch.setattr(vs, "make_runner", make_runner)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning God created the heaven and the earth. " * 10)
    out = tmp_path / "res" / "vs"
    rows = vs.main(["--lengths", "40", "100", "--rounds", "2", "--new-tokens", "2", "--threads", "1",
                    "--methods", "full", "retopk:top_k=8,cache_size=4,dense_below=0", "--corpus", str(corpus),
                    "--runtime", "prefill_chunk=16", "--out", str(out)])
    assert [rope for rope, _ in runners] == [None, 4.0]  # 40 + 3 positions fit the 64 trained ones, 100 + 3 not
    assert [c.kwargs.get("rope_freq_scale") for c in created] == [None, None, 0.25, 0.25]
    assert [c.kwargs["n_ctx"] for c in created] == [58, 58, 118, 118] and all(c.closed for c in created)
    assert [(r["L"], r["engine"]) for r in rows] == [(L, e) for L in (40, 100)
                                                     for e in ("llama.cpp", "llama.cpp", "retopk", "retopk")]
    for r in rows:
        assert r["rope_factor"] == (4.0 if r["L"] == 100 else None)
        assert r["yardstick"].startswith("llama.cpp") and r["vs_llamacpp"] > 0 and r["prefill_vs_llamacpp"] > 0
        runner = runners[r["L"] == 100][1]
        expect = 1_000_000 if r["engine"] == "llama.cpp" else runner.info.weight_bytes
        assert r["weight_bytes"] == expect > 0
        assert r["floor_ms"] == pytest.approx(1e3 * expect / 10e9)
        assert r["floor_cached_ms"] == pytest.approx(1e3 * expect / 40e9)
    data = json.loads(out.with_suffix(".json").read_text())
    assert len(data["rows"]) == 8 and data["meta"]["llama_cpp"] == "0.0-test"
    assert data["meta"]["runtime"] == {"prefill_chunk": 16} and data["meta"]["trained_positions"] == 64
    assert out.with_suffix(".png").is_file()
    printed = capsys.readouterr()
    assert "## L = 40 (RoPE as trained" in printed.err + printed.out
    assert "## L = 100 (RoPE linear x4" in printed.err + printed.out


def test_weight_bytes_is_the_runners_own_figure():
    runner = ModelRunner(RuntimeConfig(model="tiny", default_method=parse_method("full")), model=_tiny_model())
    assert vs.weight_bytes(runner) == runner.info.weight_bytes > 0


@pytest.mark.skipif(not decoder_ops.available(), reason="int16 activations need the fused CPU library")
def test_runtime_line_names_the_activations_once():
    """The header's runtime line with int16 activations (which weight_format, the JSON's retopk_weights, ends with):
    the weights' formats, then the activations, once."""
    runner = ModelRunner(RuntimeConfig(model="tiny", default_method=parse_method("full"), weights="int4",
                                       kv_dtype="bfloat16", activations="int16"), model=_tiny_model())
    assert runner.info.weight_format.endswith(", activations int16")
    line = vs.runtime_line({"activations": "int16"}, runner)
    assert line == (f"#   retopk runtime {{'activations': 'int16'}}: weights int4, lm_head int4, KV cache bfloat16, "
                    f"activations int16, backend {runner.info.backend}")


@pytest.mark.slow
def test_retopk_side_on_the_embedded_model(embedded_model):
    """Full and the server's default method on the embedded model and a short prompt (dense below 1K
    tokens, so the same greedy tokens)."""
    model, tokenizer = embedded_model
    runner = ModelRunner(RuntimeConfig(default_method=parse_method("full")), model=model, tokenizer=tokenizer)
    assert vs.weight_bytes(runner) == runner.info.weight_bytes > 0
    ids = runner.encode("In the beginning God created the heaven and the earth. " * 6, add_special_tokens=False)
    engines = [vs.RetopkEngine(runner, parse_method(m), f"retopk {m}") for m in ("full", "default")]
    rows = vs.compare(vs.measure(len(ids), engines, ids, 2, 1))
    assert rows[0]["tokens"] == rows[1]["tokens"] and not runner.sessions
    assert all(r["ms_per_token"] > 0 and r["yardstick"] is None for r in rows)


def test_check_prefills_and_decodes_with_both_settings(monkeypatch, tmp_path, capsys):
    """--check (what make bench-llamacpp-deps runs after a build): both attention settings, a prompt and steps."""
    created = []
    monkeypatch.setattr(vs, "import_llama_cpp", lambda: _fake_llama_cpp(created))
    monkeypatch.setattr(vs, "gguf_path", lambda model: tmp_path / "model.gguf")
    assert vs.main(["--check", "--threads", "1"]) == []
    assert [c.kwargs["flash_attn"] for c in created] == [False, True] and all(c.closed for c in created)
    assert all([len(t) for t in c.evals] == [32, 1, 1, 1] for c in created)
    assert "prefills and decodes model.gguf here (AVX2 = 1 | test)" in capsys.readouterr().out
