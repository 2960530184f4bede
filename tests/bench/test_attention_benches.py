"""The attention benchmarks and the path recorder at a tiny size (structure and path statistics; no timings)."""

import json

import torch

from bench import attention_cpu, attention_stages, cpu_kernel, record_paths
from retopk_core.methods import Path, make_method
from retopk_server.runtime import MethodSpec, ModelRunner, RuntimeConfig

# head_dim 48 > C = 32: the replayed queries then hit the recorded similarity exactly
TINY = ["--heads", "6", "--kv-heads", "2", "--head-dim", "48", "--top-k", "8", "--steps", "4", "--warmup", "1"]


def rows_by(rows):
    return {(r["L"], r["method"], r.get("pattern"), r.get("policy")): r for r in rows}


def test_attention_cpu_tiny(tmp_path, capsys):
    out = tmp_path / "attn"
    attention_cpu.main(["--lengths", "64", "256", *TINY, "--exact-share", "0.25", "--baselines", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| 256 | retopk reuse only (floor) |" in printed and "whole-step (kindest)" in printed
    assert "Exact/ReTopK: per-head" in printed
    res = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert list(res["patterns"]) == ["per-head", "replay", "replay-paths", "whole-step"]
    assert res["replay"]["file"] == attention_cpu.DEFAULT_REPLAY.name
    by = rows_by(res["rows"])
    for L in (64, 256):
        assert by[(L, "exact_topk", None, None)]["speedup_vs_exact"] == 1.0
        assert by[(L, "exact_topk", None, None)]["mean_scored"] == L  # the exact path scores every key
        for name in ("full", "exact_topk"):
            assert by[(L, name, None, None)]["group_read_rate"] == by[(L, name, None, None)]["head_exact_share"] == 1
        floor = by[(L, "retopk_reuse", None, None)]
        assert set(floor["paths"]) == {"reuse"} and floor["group_read_rate"] == 0  # tau = 0: every step reuses
        assert floor["mean_scored"] <= 4 * 8 + 32  # M <= R*K + W
        for pattern in ("per-head", "replay", "replay-paths", "whole-step"):
            head, promote, group = (by[(L, "retopk", pattern, p)] for p in ("head", "promote", "group"))
            for r in (head, promote, group):
                assert {"ms", "label", "head_exact_share", "group_read_rate", "speedup_vs_exact"} <= set(r)
            # the same queries give the same per-head decisions; promote then reads the same groups, all heads exact
            assert head["group_read_rate"] == promote["group_read_rate"]
            assert promote["head_exact_share"] == promote["group_read_rate"]
            assert head["head_exact_share"] <= head["group_read_rate"]
        for p in ("head", "promote", "group"):  # 1 step of each round of 4 is unrelated for every head
            r = by[(L, "retopk", "whole-step", p)]
            assert r["head_exact_share"] == r["group_read_rate"] == 0.25


def test_per_head_pattern_rates(capsys):
    p, G = 0.25, 3
    rows = attention_cpu.main(["--lengths", "64", "--heads", "6", "--kv-heads", "2", "--head-dim", "48", "--top-k",
                               "8", "--steps", "60", "--warmup", "1", "--layers", "2", "--pattern", "per-head",
                               "--policies", "head", "promote", "--head-p", str(p)])
    by = rows_by(rows)
    head, promote = by[(64, "retopk", "per-head", "head")], by[(64, "retopk", "per-head", "promote")]
    # 720 head-steps (sd of the share 0.016) and 240 group-steps (sd 0.032): bounds of about 4 sd
    assert abs(head["head_exact_share"] - p) < 0.07
    assert abs(head["group_read_rate"] - (1 - (1 - p) ** G)) < 0.13
    assert head["paths"].keys() == {"reuse", "fallback"}
    assert promote["group_read_rate"] == head["group_read_rate"] == promote["head_exact_share"]


def test_replay_mapping_as_documented():
    replay = attention_cpu.Replay(attention_cpu.DEFAULT_REPLAY)
    T, L_r, H_r = replay.max_sim.shape
    assert (L_r, H_r) == (replay.meta["layers"], replay.meta["heads"]) and T == replay.meta["steps"]
    layer, head = replay.streams(1, 1, 28, 4)  # one bench layer of Qwen2.5-7B shape
    by_group = layer.view(4, 7)
    assert by_group[:, 0].tolist() == [0, 7, 15, 22] and bool((by_group == by_group[:, :1]).all())
    for g in range(4):
        assert len(set(head[0, 0, 7 * g:7 * g + 7].tolist())) == 7  # distinct recorded heads in a group
    layer, _ = replay.streams(1, 28, 28, 4)  # 112 groups: every recorded layer replayed
    assert set(layer.flatten().tolist()) == set(range(L_r))


def replay_decode(replay, args, L=128, pattern="replay", **method_params):
    """Decode a replay pattern step by step with ReTopK -> (rho, recorded path, max_sim, path), each (n, B, H)."""
    work = attention_cpu.Workload(args, L)
    trace = attention_cpu.make_trace(pattern, [work], args, {pattern: replay})
    n = len(trace.steps)
    B, H, _ = work.shape
    method = make_method("retopk", top_k=args.top_k, **method_params)
    timer = attention_cpu.Timed(method, [work], trace.prefill)
    sims, paths = [], []
    with torch.inference_mode():
        for step in trace.steps:
            out = method.decode(step[0], work.kv, timer.states[0], timer.slots[0])
            sims.append(out.max_sim)
            paths.append(out.path)
    rho = replay.take(replay.max_sim, n, B, 1, H, args.kv_heads)[:, 0]
    recorded = replay.take(replay.path, n, B, 1, H, args.kv_heads)[:, 0]
    return rho, recorded, torch.stack(sims), torch.stack(paths)


def test_replay_hits_recorded_similarities_and_paths():
    args = attention_cpu.parse_args([*TINY, "--steps", "40"])
    replay = attention_cpu.Replay(attention_cpu.DEFAULT_REPLAY)
    rho, recorded, max_sim, path = replay_decode(replay, args)
    assert rho.shape == max_sim.shape == (41, 1, 6)
    ok = rho >= 0  # below 0 the max over the FIFO may exceed rho (still below tau)
    assert bool(ok.any()) and torch.allclose(max_sim[ok], rho[ok], atol=1e-4)
    assert bool((max_sim[~ok] < 0.85).all())
    far = (rho - 0.85).abs() > 1e-3  # the recording's 4 decimals decide the same side of tau
    assert bool((path[far] == recorded[far]).all())
    assert bool(((recorded == Path.FALLBACK) & far).any()) and bool(((recorded == Path.REUSE) & far).any())


def test_replay_paths_takes_the_recorded_decisions():
    """replay-paths: the per-head rule takes each recorded head's path, whatever its tau."""
    args = attention_cpu.parse_args([*TINY, "--steps", "40"])
    replay = attention_cpu.Replay(attention_cpu.DEFAULT_REPLAY)  # any recording: the paths are what is replayed
    for tau in (0.5, 0.95):
        _, recorded, _, path = replay_decode(replay, args, pattern="replay-paths", tau=tau)
        want = torch.where(recorded == Path.FALLBACK, Path.FALLBACK, Path.REUSE).to(torch.int8)
        assert torch.equal(path, want), tau
        assert bool((path == Path.FALLBACK).any()) and bool((path == Path.REUSE).any())


def test_default_paths_recording_is_the_server_default():
    """The committed replay-paths recording was made with the server's default method (per-head policy). A field
    the method gained after the recording (refresh_guard) ran at the core's default then, which must still be
    the server's."""
    replay = attention_cpu.Replay(attention_cpu.DEFAULT_REPLAY_PATHS)
    want = record_paths.method_spec().build().describe()
    defaults = make_method(want["method"]).describe()
    assert {k: replay.meta["method"].get(k, defaults[k]) for k in want} == want


def test_record_paths_round_trip(tmp_path):
    """record_paths on a tiny random Llama: its file replays into the same paths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    spec = MethodSpec.of("retopk", top_k=8, cache_size=4, recall=2, window=4, gqa_policy="head")
    runner = ModelRunner(RuntimeConfig(model="tiny", default_method=spec), model=model)
    ids = torch.randint(0, 128, (80,)).tolist()
    sims, paths = record_paths.record(runner, spec, ids, 64, 16, greedy=False)
    assert len(sims) == 16 and sims[0].shape == paths[0].shape == (2, 4)
    meta = {"model": "tiny", "layers": 2, "heads": 4, "kv_heads": 2, "method": spec.build().describe(),
            "context": 64, "steps": 16, "corpus": "random"}
    file = tmp_path / "paths_tiny.json"
    file.write_text(json.dumps(record_paths.encode_recording(sims, paths, meta)))
    replay = attention_cpu.Replay(file)
    assert torch.equal(replay.path, torch.stack(paths))
    assert torch.allclose(replay.max_sim, torch.stack(sims), atol=5e-5)
    assert "group-read rate" in record_paths.summary(torch.stack(paths), 2)
    assert record_paths.method_spec().build().config.gqa_policy == "head"
    assert record_paths.method_spec({"tau_calibration": 0.85}).build().config.tau_calibration == 0.85


def test_attention_stages_tiny(tmp_path, capsys):
    out = tmp_path / "stages"
    attention_stages.main(["--lengths", "128", "--heads", "6", "--kv-heads", "2", "--head-dim", "16", "--top-k", "8",
                           "--steps", "2", "--out", str(out)])
    res = json.loads(out.with_suffix(".json").read_text())[0]
    assert set(res["reuse_ms"]) == {"similarity+path", "recall+candidates", "indexed QK", "top-K rerank",
                                    "sparse attend", "cache update"}
    assert 8 <= res["mean_candidates"] <= 4 * 8 + 32
    assert "Exact Top-K / ReTopK reuse" in capsys.readouterr().out


def test_attention_cpu_fused_kernel_rows(tmp_path):
    """--backend cpu: ReTopK rows run the fused kernel, and the kernel's own exact-every-step row is there
    as the same-implementation baseline (every group read on every step)."""
    from retopk_core.cpu import launch

    if not launch.available():
        import pytest
        pytest.skip("the fused CPU kernel is not built (make install builds it)")
    out = tmp_path / "attn"
    attention_cpu.main(["--lengths", "128", *TINY, "--pattern", "per-head", "--policies", "head", "--backend", "cpu",
                        "--out", str(out)])
    by = rows_by(json.loads(out.with_suffix(".json").read_text())["rows"])
    same = by[(128, "exact_topk_cpu", None, None)]
    assert same["group_read_rate"] == 1 and same["backend"] == "cpu" and same["speedup_vs_exact_same_kernel"] == 1
    assert by[(128, "retopk", "per-head", "head")]["backend"] == "cpu"
    assert by[(128, "exact_topk", None, None)]["backend"] == "torch"


def test_cpu_kernel_saves_every_row_it_prints(tmp_path, capsys):
    """bench/cpu_kernel.py --out: the JSON holds each (length, trace) row of the printed table, same figures."""
    from retopk_core.cpu import launch

    if not launch.available():
        import pytest
        pytest.skip("the fused CPU kernel is not built (make install builds it)")
    out = tmp_path / "cpu_kernel"
    assert cpu_kernel.main(["--lengths", "128", "300", "--heads", "6", "--kv-heads", "2", "--head-dim", "16",
                            "--top-k", "8", "--cache-size", "8", "--window", "8", "--block", "64", "--steps", "2",
                            "--out", str(out)]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1") or
               line.startswith("| 3")]
    res = json.loads(out.with_suffix(".json").read_text())
    assert [(r["L"], r["trace"]) for r in res["rows"]] == [(128, "reuse"), (128, "exact"), (300, "reuse"),
                                                           (300, "exact")]
    assert [line.split(" | ")[3] for line in printed] == [f"{r['torch_ms']:.3f}" for r in res["rows"]]
    assert res["meta"]["command"].startswith("python bench/cpu_kernel.py --lengths 128 300")
