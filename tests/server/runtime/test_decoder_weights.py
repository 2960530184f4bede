"""The decoder's weight formats and the GGUF reader, against independent references: gguf's own
dequantization, transformers' GGUF loader (the embedded model's float32 weights), and float matmuls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retopk_core.models import DEFAULT_MODEL, resolve_model
from retopk_server.runtime.decoder.linear import WIDE_ROWS, Int4Linear, Int8Linear, from_float
from retopk_server.runtime.decoder.load import GGUFTensors, _q4_blocks, _q8_blocks, from_gguf

BF16 = torch.finfo(torch.bfloat16).eps


def embedded_gguf() -> str:
    source = resolve_model(DEFAULT_MODEL)
    return f"{source.path}/{source.gguf_file}"


@pytest.fixture(scope="module")
def gguf_config():
    from transformers import AutoConfig

    source = resolve_model(DEFAULT_MODEL)
    return AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file, local_files_only=True)


def test_q4_1_and_q8_0_blocks_decode_as_gguf_dequantizes_them(gguf_config):
    """(q - 8) s + z of our Q4_1 reading, d q of our Q8_0 reading, equal gguf's own dequantize (float32)."""
    from gguf import dequantize

    g = GGUFTensors(embedded_gguf(), gguf_config)
    t = g.tensors["blk.0.ffn_down.weight"]  # Q4_1, rows as stored (no Q/K permutation)
    assert t.tensor_type.name == "Q4_1"
    data = np.asarray(t.data)
    q, s, z = _q4_blocks(data, "Q4_1")
    ours = ((q.float().view(q.shape[0], -1, 32) - 8) * s.unsqueeze(-1) + z.unsqueeze(-1)).view(q.shape)
    theirs = torch.from_numpy(np.array(dequantize(data, t.tensor_type))).view(q.shape)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=4 * torch.finfo(torch.float32).eps * theirs.abs().max())
    assert int(q.max()) == 15 and int(q.min()) == 0
    e = g.tensors["token_embd.weight"]  # Q8_0
    data = np.asarray(e.data)[:64]
    q8, d = _q8_blocks(data)
    ours = (q8.float().view(64, -1, 32) * d.unsqueeze(-1)).view(q8.shape)
    assert torch.equal(ours, torch.from_numpy(np.array(dequantize(data, e.tensor_type))).view(q8.shape))


@pytest.mark.slow
def test_gguf_weights_equal_transformers_loader_and_as_stored_within_bf16_scales(embedded_model, gguf_config):
    """float32 from the GGUF: every matmul weight equals transformers' (the Q/K row permutation undone);
    as stored: the int4 weights the packed op reads differ from those by the bf16 rounding of the block's
    scale and zero only."""
    model, _ = embedded_model
    exact = from_gguf(embedded_gguf(), gguf_config, "float32")
    stored = from_gguf(embedded_gguf(), gguf_config, "as-stored")
    assert stored.weight_format == "int4, lm_head int8" and exact.weight_format == "float32, lm_head float32"
    assert stored.weight_bytes < exact.weight_bytes / 5
    for i in (0, 17, 29):
        a, m = model.model.layers[i].self_attn, model.model.layers[i].mlp
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
        gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach()
        assert torch.equal(exact.layers[i].qkv.weight, qkv)
        assert torch.equal(exact.layers[i].gate_up.weight, gate_up)
        for lin, ref in ((stored.layers[i].qkv, qkv), (stored.layers[i].down, m.down_proj.weight.detach())):
            # |z| <= 8 |d| + |m| per block: a bf16 rounding of each moves a weight by at most 2^-8 of that
            bound = 2 * BF16 * ref.abs().amax() + 1e-6
            assert (lin.dequantized() - ref).abs().max() <= bound
    torch.testing.assert_close(exact.lm_head.weight, model.lm_head.weight.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("cls", ["int4", "int8"])
def test_quantized_linear_packed_and_wide_paths_equal_the_float_matmul(cls):
    """y = x W^T through the packed GEMV (a decode step's rows) and through the dequantized copy (prefill
    chunks) both equal a float64 matmul with the dequantized weights, within bf16 rounding of x and y."""
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    lin = from_float(w, b, cls)
    assert isinstance(lin, Int4Linear if cls == "int4" else Int8Linear)
    ref_w = lin.dequantized().double()
    step = (w.amax(1) - w.amin(1)).max() / 15 if cls == "int4" else w.abs().max() / 127
    # round to nearest on the stored (bf16) scale: half a step, plus the bf16 rounding of the step itself
    assert (ref_w - w.double()).abs().max() <= step * (0.5 + 2 * BF16) + 2 * BF16 * w.abs().max()
    for rows in (1, WIDE_ROWS + 3):
        x = torch.randn(rows, 64)
        y = lin(x)
        ref = x.double() @ ref_w.T + b.double()
        scale = x.abs().double() @ ref_w.abs().T + b.abs().double()  # what the rounding errors scale with
        assert y.dtype == torch.float32 and y.shape == (rows, 96)
        assert ((y.double() - ref).abs() <= 4 * BF16 * scale).all()


@pytest.mark.slow
def test_gguf_tokenizer_is_converted_once_and_read_back_the_same(tmp_path, monkeypatch):
    """The tokenizer built from the GGUF's vocabulary is saved under $XDG_CACHE_HOME and a second load reads
    it back: same ids for the same texts, same chat template rendering."""
    from pathlib import Path

    from retopk_server.runtime.loading import gguf_tokenizer, tokenizer_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    gguf = Path(embedded_gguf())
    converted = gguf_tokenizer(gguf)
    cache = tokenizer_cache(gguf)
    assert (cache / "tokenizer.json").is_file() and str(cache).startswith(str(tmp_path))
    assert not list(cache.parent.glob("*.tmp*"))
    cached = gguf_tokenizer(gguf)
    texts = ["The capital of France is Paris.", "  indented\tcode = {'a': 1}\n", "naïve café – 東京 🙂"]
    for text in texts:
        assert cached.encode(text) == converted.encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    assert cached.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        converted.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert cached.eos_token_id == converted.eos_token_id
