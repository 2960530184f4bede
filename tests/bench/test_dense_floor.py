"""bench/dense_floor.py: the calibration runs at tiny size and its recommendation follows its rows."""

from __future__ import annotations

import json

from bench import dense_floor


def test_recommend_is_the_start_of_the_last_faster_run():
    rows = [{"length": L, "speedup": s} for L, s in ((256, 0.5), (512, 1.2), (1024, 0.9), (2048, 1.1), (4096, 1.8))]
    assert dense_floor.recommend(rows) == 2048  # 512 alone does not count: 1024 is slower again
    assert dense_floor.recommend(rows[:3]) == 1025  # never faster at the longest: above every measured length
    assert dense_floor.recommend([{"length": 64, "speedup": 2.0}]) == 64


def test_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "floor"
    assert dense_floor.main(["--lengths", "40", "80", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                             "--method", "top_k=8,cache_size=4,window=4,recall=2", "--steps", "2", "--rounds", "1",
                             "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["length"] for r in data["rows"]] == [40, 80]
    assert all(r["full_ms"] > 0 and r["retopk_ms"] > 0 for r in data["rows"])
    assert data["dense_below"] == dense_floor.recommend(data["rows"])
    assert "recommended dense_below" in capsys.readouterr().out


def test_backend_defaults_to_what_the_server_runs():
    from retopk_core.cpu import launch

    fused = "cpu" if launch.available() else "torch"
    assert dense_floor.backends("auto") == {"full": fused, "retopk": fused}
    assert dense_floor.backends("torch") == {"full": "torch", "retopk": "torch"}
