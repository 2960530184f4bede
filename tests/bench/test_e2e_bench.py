"""bench/e2e_cpu.py end to end on a tiny random Llama (structure and path accounting, no timings)."""

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
    specs = [e2e_cpu.parse_method(m) for m in ("full", "exact_topk:top_k=8", "retopk:top_k=8,cache_size=4,tau=0.5")]
    assert specs[2].build().config.tau == 0.5 and specs[1].build().top_k == 8
    runner = ModelRunner(RuntimeConfig(model="tiny", default_method=specs[0]), model=model)
    ids = torch.randint(0, 128, (100,)).tolist()
    rows = e2e_cpu.run(runner, specs, ids, [40, 90], n=3, rounds=2, progress=(bar := Ticks()))
    assert [(r["L"], r["label"]) for r in rows] == [
        (L, label) for L in (40, 90)
        for label in ("full", "exact_topk(top_k=8)", "retopk(cache_size=4,tau=0.5,top_k=8)", "transformers generate")]
    for r in rows:
        assert r["ms_per_token"] > 0 and r["tokens"] == 3 * 2
        if r["label"] != "transformers generate":
            assert 0 < r["attention_share"] < 1
            assert sum(r["paths"].values()) == 3 * 2 * 2 * 4  # tokens x rounds x layers x heads
    assert set(rows[0]["paths"]) == {"dense"} and set(rows[1]["paths"]) == {"exact"}
    assert set(rows[2]["paths"]) <= {"reuse", "fallback", "refresh"}
    for r in rows:  # layer-steps with an exact pass: each holds 1..4 of the exact heads
        if r["label"].startswith("retopk"):
            exact_heads = r["paths"].get("fallback", 0) + r["paths"].get("refresh", 0)
            layer_steps = round(r["layer_steps_with_exact"] * 6 * 2)
            assert -(-exact_heads // 4) <= layer_steps <= min(exact_heads, 6 * 2)
        else:
            assert r.get("layer_steps_with_exact") is None
    assert not runner.sessions  # every session closed
    assert bar.n == 2 * 2 * 4  # lengths x rounds x (3 methods + generate)
    assert "| 90 | retopk" in e2e_cpu.table(rows)
