"""The attention benchmarks run end to end at a tiny size (structure only; no timing assertions)."""

import json

from bench import attention_cpu, attention_stages

TINY = ["--heads", "6", "--kv-heads", "2", "--head-dim", "16", "--top-k", "8", "--steps", "4", "--warmup", "1"]


def test_attention_cpu_tiny(tmp_path, capsys):
    out = tmp_path / "attn"
    attention_cpu.main(["--lengths", "64", "256", *TINY, "--exact-share", "0.25", "--baselines", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| 256 | retopk_reuse |" in printed and "Exact/ReTopK-reuse" in printed
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert out.with_suffix(".png").stat().st_size > 0
    by = {(r["L"], r["method"]): r for r in rows}
    for L in (64, 256):
        assert by[(L, "exact_topk")]["speedup_vs_exact"] == 1.0
        assert by[(L, "exact_topk")]["mean_scored"] == L  # the exact path scores every key
        assert set(by[(L, "retopk_reuse")]["paths"]) == {"reuse"}  # tau = 0: every step reuses
        assert by[(L, "retopk_reuse")]["mean_scored"] <= 4 * 8 + 32  # M <= R*K + W
        assert by[(L, "retopk_mix")]["paths"].get("fallback", 0) > 0  # unrelated queries fall back


def test_attention_stages_tiny(tmp_path, capsys):
    out = tmp_path / "stages"
    attention_stages.main(["--lengths", "128", "--heads", "6", "--kv-heads", "2", "--head-dim", "16", "--top-k", "8",
                           "--steps", "2", "--out", str(out)])
    res = json.loads(out.with_suffix(".json").read_text())[0]
    assert set(res["reuse_ms"]) == {"similarity+path", "recall+candidates", "indexed QK", "top-K rerank",
                                    "sparse attend", "cache update"}
    assert 8 <= res["mean_candidates"] <= 4 * 8 + 32
    assert "Exact Top-K / ReTopK reuse" in capsys.readouterr().out
