"""Tiny randomly initialised Llama / Qwen2 / Mistral models, references from transformers' generate,
and a greedy driver for the runner written from the definition (feed the argmax back, one token a step)."""

from __future__ import annotations

import torch

from retopk_server.runtime import MethodSpec, ModelRunner, RuntimeConfig

ARCHS = ("llama", "qwen2", "mistral")


def tiny_model(arch: str, seed: int = 0, layers: int = 2, max_positions: int = 512):
    """A 2-layer GQA model (4 query heads, 2 KV heads, head_dim 16, vocab 256), float32, eval mode.

    initializer_range 0.2 (not 0.02) spreads the logits so that greedy argmax has no near-ties that
    float rounding differences between attention implementations could flip.
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    torch.manual_seed(seed)
    return model_cls(config_cls(**common)).eval()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate (its default attention), n new tokens, no EOS stop."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def runner_for(model, method: MethodSpec | None = None, **kw) -> ModelRunner:
    """A runner over ``model``'s weights as they are (float32) with a float32 KV cache unless ``kw`` says
    otherwise: the setting in which greedy tokens equal transformers' generate."""
    kw.setdefault("kv_dtype", "float32")
    config = RuntimeConfig(model="tiny", default_method=method or MethodSpec("full"), **kw)
    return ModelRunner(config, model=model)


def greedy(runner: ModelRunner, session, prompt: list[int], n: int) -> list[int]:
    """Prefill, then feed back the argmax n - 1 times: the n greedy tokens (the last is not fed)."""
    tok = int(runner.prefill(session, prompt).argmax())
    out = [tok]
    while len(out) < n:
        logits, _ = runner.decode([session], [tok])
        tok = int(logits[0].argmax())
        out.append(tok)
    return out


def three_turns(runner: ModelRunner, session) -> int:
    """Three greedy turns (prompt, 6 tokens each; the last token of a turn is fed by the next) -> the pending token."""
    last = None
    for turn in range(3):
        prompt = ([last] if last is not None else []) + prompt_ids(13 + turn, seed=turn)
        last = greedy(runner, session, prompt, 6)[-1]
    return last


def moved_and_kept(made: ModelRunner, taken: ModelRunner) -> tuple[list[int], list[int]]:
    """Three greedy turns of ReTopK on ``made``, saved as a session artifact (its bytes and model fingerprint, as a
    server saves or hands off), checked and loaded by ``taken`` -> the fourth turn's greedy tokens on ``taken`` (the
    moved session) and on ``made`` (the same session continued where it was made)."""
    from retopk_server.engine import session_artifact
    from retopk_server.engine.session_artifact import SessionArtifact, check_model, model_fingerprint

    session = made.open_session()
    pending = three_turns(made, session)
    saved = session_artifact.encode(SessionArtifact(state=made.export_session(session),
                                                    model=model_fingerprint(made.info), owner="", session_id="s"))
    loaded = session_artifact.decode(saved)
    assert check_model(loaded, taken.info) is None
    moved = taken.import_session(loaded.state)
    fourth = [pending] + prompt_ids(11, seed=9)
    return greedy(taken, moved, fourth, 8), greedy(made, session, fourth, 8)


def first_step(runner: ModelRunner, prompt: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A fresh session of the runner's default method: its KV pools' K rows after the prefill (one per layer),
    the prefill's logits and the logits of one decode step fed their argmax."""
    session = runner.open_session(runner.config.default_method)
    first = runner.prefill(session, prompt)
    kv = [t[torch.tensor(session.blocks)] for t in runner.pool.k]
    return kv, first, runner.decode([session], [int(first.argmax())])[0][0]


def prompt_ids(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=g).tolist()


def check_units_mode(runners: dict[str, ModelRunner], weights: str, activations: str) -> None:
    """A units mode (decoder_ops.UNIT_ACTIVATIONS) against float32 activations, ``runners`` of each on one tiny model
    with int4 or int8 weights (``weights``): the weight format says so, every block linear, the LM head included,
    carries units (20 bytes a block of 32 for int4's 16, 34 for int8's 32), the KV rows of a prefill long enough for
    the wide copy with either activations (linear.wide_rows) are float32's, the first decode logits differ from
    float32's by a little, and back on float32 the same runner multiplies qs again (through the fused layers' new
    arguments) and gives float32's logits."""
    from retopk_server.runtime.decoder.linear import is_blocks, wide_rows

    unit = runners[activations]
    assert unit.info.weight_format == runners["float32"].info.weight_format + f", activations {activations}"
    blocks = [lin for lin in unit.decoder.linears() if is_blocks(lin)]
    unit_cols = {4: lambda lin: lin.qs.shape[1] * 20 // 16, 8: lambda lin: lin.qs.shape[1] * 34 // 32}
    assert {lin.format for lin in blocks} == {weights} and unit.decoder.lm_head in blocks
    assert all(lin.activations == activations and lin.blocks.qs.shape[1] == unit_cols[lin.bits](lin) for lin in blocks)
    wide = unit.decoder.layers[0].qkv.wide_dtype
    prompt = prompt_ids(max(wide_rows(wide, a) for a in runners), 1)
    out = {a: first_step(runner, prompt) for a, runner in runners.items()}
    assert all(torch.equal(a, b) for a, b in zip(out["float32"][0], out[activations][0], strict=True))
    diff = (out["float32"][2] - out[activations][2]).abs().max()
    assert 0 < diff < 1e-3 * out["float32"][2].abs().max()
    unit.decoder.set_activations("float32")
    assert all(lin.blocks.qs is lin.qs for lin in blocks)
    assert torch.equal(first_step(unit, prompt)[2], out["float32"][2])
