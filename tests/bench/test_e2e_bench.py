"""bench/e2e_cpu.py end to end on a tiny random Llama (structure and path accounting, no timings)."""

import pytest
import torch

from bench import e2e_cpu
from retopk_server.runtime import ModelRunner, RuntimeConfig


class Ticks:
    """Stands in for the tqdm bar: counts updates."""

    n = 0

    def update(self, k: int) -> None:
        self.n += k


def test_e2e_rows_for_every_method_and_length():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    specs = [e2e_cpu.parse_method(m) for m in ("full", "exact_topk:top_k=8", "retopk:top_k=8,cache_size=4,tau=0.5",
                                                "retopk:top_k=8,cache_size=4,tau=0.5,gqa_policy=promote")]
    assert specs[2].build().config.tau == 0.5 and specs[1].build().top_k == 8
    assert specs[3].build().config.gqa_policy == "promote"
    runner = ModelRunner(RuntimeConfig(model="tiny", default_method=specs[0]), model=model)
    ids = torch.randint(0, 128, (100,)).tolist()
    rows = e2e_cpu.run(runner, specs, ids, [40, 90], n=3, generate_model=model, rounds=2, progress=(bar := Ticks()))
    assert [(r["L"], r["label"]) for r in rows] == [
        (L, label) for L in (40, 90)
        for label in ("full", "exact_topk(top_k=8)", "retopk(cache_size=4,tau=0.5,top_k=8)",
                      "retopk(cache_size=4,gqa_policy=promote,tau=0.5,top_k=8)", "transformers generate")]
    for r in rows:
        assert r["tokens"] == 3 * 2
        assert r["ms_per_token"] > 0  # generate's too: it is timed from a prefilled cache, no difference
        if r["label"] != "transformers generate":
            assert 0 < r["attention_share"] < 1
            assert sum(r["paths"].values()) == 3 * 2 * 2 * 4  # tokens x rounds x layers x heads
    assert set(rows[0]["paths"]) == {"dense"} and set(rows[1]["paths"]) == {"exact"}
    assert set(rows[2]["paths"]) <= {"reuse", "fallback", "refresh"}
    assert set(rows[3]["paths"]) <= {"reuse", "fallback", "refresh", "promoted"}
    # 6 tokens x 2 layers = 12 layer-steps, x 2 KV groups (of 2 heads) = 24 (layer, group, step) triples
    for r in rows:
        if r["label"] == "transformers generate":
            assert r["group_read_rate"] is None
            continue
        full_heads = sum(n for p, n in r["paths"].items() if p in ("fallback", "refresh", "promoted", "exact", "dense"))
        reads = r["group_read_rate"] * 24
        assert reads == pytest.approx(round(reads))
        assert -(-full_heads // 2) <= round(reads) <= min(full_heads, 24)  # a read group holds 1..2 such heads
        if r["label"].startswith("retopk"):  # a layer-step with an exact pass holds 1..2 read groups
            layer_steps = r["layer_steps_with_exact"] * 12
            assert layer_steps == pytest.approx(round(layer_steps))
            assert -(-round(reads) // 2) <= round(layer_steps) <= min(round(reads), 12)
        else:
            assert r.get("layer_steps_with_exact") is None
    assert rows[0]["group_read_rate"] == rows[1]["group_read_rate"] == 1.0  # full and exact read every group
    assert not runner.sessions  # every session closed
    assert bar.n == 2 * 2 * 5  # lengths x rounds x (4 methods + generate)
    text = e2e_cpu.table(rows)
    assert "| 90 | retopk" in text and "exact pass" in text and "KV groups read" in text
    r = rows[2]
    line = next(x for x in text.splitlines() if x.startswith(f"| {r['L']} | {r['label']} |"))
    assert line.endswith(f"| {100 * r['layer_steps_with_exact']:.0f}% | {100 * r['group_read_rate']:.0f}% |")


def test_default_method_and_rope_scaling_flags():
    from retopk_server.config import ServerConfig

    assert e2e_cpu.parse_method("default") == ServerConfig().method_spec()
    args = e2e_cpu.parse_args(["--rope-scaling", "linear:4", "--threads", "1"])
    assert args.rope_scaling == {"rope_type": "linear", "factor": 4.0} and args.threads == 1
