"""Which rounding of the activations a block product could use and still pass issue 28's criterion, measured
before any kernel is written: every Linear's input x of the float32 model (transformers' dequantized GGUF) is
replaced by its rounding r(x), and the greedy tokens and the KJV perplexity are compared with the float32
model's own.

The roundings (x a row of a Linear's input, blocks of 32 along it as GGUF's):
  int8        llama.cpp's Q8 activations as the runtime's int8 path rounds them (decoder_ops.cpp's header):
              dx = max_j |x_j| / 127 per block, r(x) = dx round(x (1 / dx))
  int8x2      two int8 limbs a block: y = x (1 / dx), hi = round(y), lo = clamp(round(256 (y - hi)), +-127),
              r(x) = dx (hi + lo / 256): what dpbusd or AMX int8 tiles could sum exactly in two passes
  bf16        r(x) = bf16(x)
  bf16x2      hi = bf16(x), lo = bf16(x - hi), r(x) = hi + lo (16 significant bits; |x - r(x)| <= 2^-17 |x|
              for normal values): what AMX's bf16 tiles sum exactly in one pass of 2 limb rows per row of x
  fp16x2      the same with float16 limbs
The products are then torch's float32 ones on r(x), so only the input's rounding differs from a kernel's
result (a kernel's own order of float32 sums is the float32 path's order noise).

Tokens: ``--new-tokens`` greedy tokens of the float32 model per chat prompt (token_agreement's prompts), then
the rounded model teacher-forced over them in one forward: at each position where its argmax a differs from
the reference token t, the gap log p(a) - log p(t) is recorded (the criterion: no flip, or gaps <= 1e-3).
Perplexity: ``--ppl-docs`` KJV documents of ``--ppl-length`` tokens, dense, the same split as bench.eval.

    python -m bench.eval.activation_rounding --new-tokens 64 --ways float32 int8 int8x2 bf16 bf16x2
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from bench.eval.common import load_corpus, split_documents
from bench.eval.token_agreement import PROMPTS, TOLERANCE, reference
from retopk_core.models import DEFAULT_MODEL, load_model
from retopk_server.runtime import ModelRunner, RuntimeConfig

BLOCK = 32


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (..., n / 32, 32)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _block_scale(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (..., 32) float32 -> (dx, x (1 / dx)) with dx = max |x| / 127 (both 0 where max |x| = 0)."""
    dx = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1 / torch.where(dx > 0, dx, torch.ones_like(dx)), torch.zeros_like(dx))
    return dx, b * inv


def int8(x: torch.Tensor) -> torch.Tensor:
    dx, y = _block_scale(_blocks(x))
    return (torch.round(y) * dx).reshape(x.shape)


def int8x2(x: torch.Tensor) -> torch.Tensor:
    dx, y = _block_scale(_blocks(x))
    hi = torch.round(y)
    lo = torch.clamp(torch.round((y - hi) * 256), -127, 127)
    return ((hi + lo / 256) * dx).reshape(x.shape)


def _two_limbs(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    hi = x.to(dtype).float()
    return hi + (x - hi).to(dtype).float()


WAYS = {
    "float32": lambda x: x,
    "int8": int8,
    "int8x2": int8x2,
    "bf16": lambda x: x.to(torch.bfloat16).float(),
    "bf16x2": lambda x: _two_limbs(x, torch.bfloat16),
    "fp16x2": lambda x: _two_limbs(x, torch.float16),
}


def rounded_inputs(model: torch.nn.Module, way):
    """Hooks that replace every nn.Linear's input by way(input); remove them with ``for h in hooks: h.remove()``."""
    return [m.register_forward_pre_hook(lambda _m, args: (way(args[0].float()),) + args[1:])
            for m in model.modules() if isinstance(m, torch.nn.Linear)]


def flips(model, prompts: list[list[int]], continuations: list[list[int]]) -> dict:
    """Teacher-forced flips against the reference tokens -> counts and the largest gap (nats)."""
    tokens, gaps = 0, []
    for ids, cont in zip(prompts, continuations, strict=True):
        logp = torch.log_softmax(model(torch.tensor([ids + cont])).logits[0].double(), dim=-1)  # (T, V)
        for i, ref in enumerate(cont):
            row = logp[len(ids) - 1 + i]
            top = int(row.argmax())
            tokens += 1
            if top != ref:
                gaps.append(float(row[top] - row[ref]))
    worst = max(gaps, default=0.0)
    return {"tokens": tokens, "flips": len(gaps), "max_gap": worst, "met": worst <= TOLERANCE}


def perplexity(model, docs: list[list[int]]) -> float:
    """exp(mean next-token NLL) over the documents, dense."""
    nll = n = 0.0
    for ids in docs:
        x = torch.tensor([ids])
        logits = model(x).logits[0, :-1].double()  # (T - 1, V)
        nll += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
        n += len(ids) - 1
    return math.exp(nll / n)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    p.add_argument("--prompts", type=int, default=20, help=f"chat prompts (at most {len(PROMPTS)})")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--ppl-docs", type=int, default=2, help="KJV documents for the perplexity (0: none)")
    p.add_argument("--ppl-length", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the results here too")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    model.eval()
    runner = ModelRunner(RuntimeConfig(model=args.model, weights="float32", kv_dtype="float32"))
    prompts = [runner.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:args.prompts]]
    docs = []
    if args.ppl_docs:
        docs = split_documents(load_corpus(None), lambda s: runner.encode(s, add_special_tokens=False),
                               args.ppl_docs, args.ppl_length)
    with torch.inference_mode():
        continuations = reference(model, prompts, args.new_tokens)
    rows, base_ppl = [], None
    print(f"{'x':>8} {'tokens':>6} {'flips':>5} {'max gap':>9} {'KJV ppl':>9} {'vs float32':>10}  "
          f"criterion (gap <= {TOLERANCE})")
    for name in args.ways:
        hooks = rounded_inputs(model, WAYS[name])
        try:
            with torch.inference_mode():
                r = {"way": name, **flips(model, prompts, continuations)}
                r["ppl"] = perplexity(model, docs) if docs else None
        finally:
            for h in hooks:
                h.remove()
        if name == "float32":
            base_ppl = r["ppl"]
        rel = f"{100 * (r['ppl'] / base_ppl - 1):+.3f}%" if r["ppl"] and base_ppl else "-"
        rows.append(r)
        ppl = f"{r['ppl']:.4f}" if r["ppl"] else "-"
        print(f"{name:>8} {r['tokens']:>6} {r['flips']:>5} {r['max_gap']:>9.2e} {ppl:>9} {rel:>10}  "
              f"{'met' if r['met'] else 'NOT met'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"new_tokens": args.new_tokens, "ppl_docs": args.ppl_docs, "ppl_length": args.ppl_length,
                       "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
