"""bench/decode_step.py's timing loop on a tiny random Llama: the steps it times are real greedy decode steps.
The two --compare runs load the embedded model twice each: `make test-full` runs them."""

import pytest
import torch

from bench import decode_step
from retopk_server.runtime import ModelRunner, RuntimeConfig


def _tiny_runner(spec) -> ModelRunner:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    return ModelRunner(RuntimeConfig(model="tiny", default_method=spec), model=model)


def test_time_steps_times_each_step_after_the_warmup_and_closes_its_session():
    spec = decode_step.parse_method("retopk:top_k=8,cache_size=4")
    runner = _tiny_runner(spec)
    with torch.inference_mode():
        times = decode_step.time_steps(runner, spec, list(range(3, 40)), warmup=2, steps=5)
    assert len(times) == 5 and all(t > 0 for t in times)
    assert runner.memory().kv_used == 0  # the session closed: none of its blocks held


def test_step_turns_prints_each_method_against_the_first_and_closes_the_sessions(capsys):
    """--step-turns: a line per method, the first's ratios to itself 1, a dense method (Full) scoring every key
    (no reuse heads) and reading all groups, ReTopK scoring fewer."""
    texts = ["retopk:top_k=8,cache_size=4,tau_guard=0.5", "full"]
    runner = _tiny_runner(decode_step.parse_method(texts[0]))
    with torch.inference_mode():
        decode_step.step_turns(runner, texts, list(range(3, 40)), warmup=1, steps=3)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": median")[0] for line in lines] == texts
    assert "first / this per step 1.000 (attention 1.000, CPU 1.000)" in lines[0]
    assert lines[1].endswith("scored 100.0% of keys, reuse M_t -; group reads 100.0%")
    scored = float(lines[0].split("scored ")[1].split("%")[0])
    assert 0 < scored < 100 and "reuse M_t -" not in lines[0]
    assert runner.memory().kv_used == 0


@pytest.mark.parametrize(("argv", "dtype"), [([], torch.float16), (["--kv-dtype", "bfloat16"], torch.bfloat16),
                                             (["--kv-dtype", "float32"], torch.float32)])
def test_kv_dtype_reaches_the_runners_config(argv, dtype):
    """--kv-dtype: the KV cache's dtype of the runner timed (auto: the server's default on a CPU, float16)."""
    config = decode_step.runtime_config(decode_step.parse_args(argv))
    assert config.kv_torch_dtype == dtype and config.activations == "auto"


@pytest.mark.full
def test_compare_layer_loop_prints_both_ways(capsys):
    """--compare-layer-loop times each way in turns and prints the ratio (on the embedded model, a short prompt)."""
    decode_step.main(["--length", "40", "--methods", "full", "--steps", "2", "--warmup", "1", "--rounds", "1",
                      "--threads", "1", "--compare-layer-loop"])
    out = capsys.readouterr().out
    assert "one call median" in out and "layer by layer / one call" in out


@pytest.mark.full
def test_compare_activations_prints_both_ways(capsys):
    """--compare-activations times float32 and int8 activations in turns and prints the ratio."""
    decode_step.main(["--length", "40", "--methods", "full", "--steps", "2", "--warmup", "1", "--rounds", "1",
                      "--threads", "1", "--compare-activations"])
    out = capsys.readouterr().out
    assert "int8" in out and "float32 / int8" in out


@pytest.mark.full
def test_compare_activations_resolves_auto_as_the_server_does(capsys):
    """--compare-activations auto times what the server's default resolves to (bf16x2 with AMX, int16 with AVX-512
    VNNI, else float32), named so, once however often it is asked for."""
    from retopk_server.runtime.decoder.llama import cpu_activations

    decode_step.main(["--length", "40", "--methods", "full", "--steps", "2", "--warmup", "1", "--rounds", "1",
                      "--threads", "1", "--compare-activations", "auto", "int8", "auto"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    resolved = cpu_activations()[0]
    assert "auto" not in line and line.count(f"{resolved} activations median") == 1
    assert f"{resolved} / int8" in line


def test_block_products_times_both_activations_per_shape(capsys):
    from bench import block_products

    rows = block_products.main(["--shapes", "o", "down", "--threads", "1", "--rows", "1", "3", "--reps", "2",
                                "--rounds", "1"])
    assert [(r["shape"], r["M"]) for r in rows] == [("o", 1), ("o", 3), ("down", 1), ("down", 3)]
    assert all(r["float32_s"] > 0 and r["int8_s"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "f32/int8" in out
    # the step line: the two products 30 times each (a layer's), 3 rows against one
    many = 30 * sum(r["float32_s"] for r in rows if r["M"] == 3)
    assert f"a step's products, 3 rows / 1 row, 1 thread(s): float32 {1e3 * many:.1f} / " in out
    # a row of SmolLM2-135M: 30 layers of QKV, o, gate-up and down, then the LM head
    assert block_products.step_macs(block_products.SHAPES) == 30 * 576 * (960 + 576 + 3072 + 1536) + 49152 * 576


def test_block_products_times_the_int8_way_at_each_named_level(capsys):
    """--int8-isa: one int8 way per level, the first's figures also as "int8", and the step's totals per way."""
    from bench import block_products
    from retopk_core.cpu import decoder_ops

    levels = ["scalar", decoder_ops.ISA_NAMES[decoder_ops.best_isa()]]
    rows = block_products.main(["--shapes", "o", "--threads", "1", "--rows", "1", "--reps", "2", "--rounds", "1",
                                "--int8-isa", *levels])
    keys = [f"int8_{name}_s" for name in levels]
    assert all(r[k] > 0 for r in rows for k in keys) and all(r["int8_s"] == r[keys[0]] for r in rows)
    out = capsys.readouterr().out
    assert f"int8 {levels[0]}/int8 {levels[1]}" in out and "a step's products at 1 row(s), 1 thread(s): " in out


def test_block_products_times_bf16x2_as_a_way(capsys):
    """--bf16x2: a third way on pack_units's units (the int4 products and the LM head's int8), with its batch
    column and its part of the step lines."""
    from bench import block_products
    from retopk_core.cpu import decoder_ops

    if not decoder_ops.amx_available():
        pytest.skip("bf16x2 needs AMX-BF16")
    rows = block_products.main(["--shapes", "o", "lm_head", "--threads", "1", "--rows", "1", "2", "--reps", "2",
                                "--rounds", "1", "--bf16x2"])
    assert all(r["bf16x2_s"] > 0 and r["batch_vs_rows_bf16x2"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "bf16x2 M/(M x 1)" in out and "; bf16x2 " in out


def test_block_products_times_int16_as_a_way(capsys):
    """--int16: a way on pack_units's units on any CPU (the int4 products and the LM head's int8), with its batch
    column and its part of the step lines."""
    from bench import block_products

    rows = block_products.main(["--shapes", "o", "lm_head", "--threads", "1", "--rows", "1", "2", "--reps", "2",
                                "--rounds", "1", "--int16"])
    assert all(r["int16_s"] > 0 and r["batch_vs_rows_int16"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "int16 M/(M x 1)" in out and "; int16 " in out
