"""Needle in a haystack in the style of RULER (single needle, multi-key, multi-value).

Haystack: consecutive lines of the corpus (natural text), cut to fit the context length. Needles are
RULER's sentences "One of the special magic numbers for {key} is: {value}." with a random word key
and a 7-digit value (seeded). Tasks:

    single       one needle; asked for its value
    multikey     one queried needle plus distractor needles with other keys; asked for the queried key
    multivalue   several needles with the SAME key and different values; asked for all values

The queried needle (the first of the multi-value ones) sits at evenly spaced depths 0..1 of the
haystack; other needles at seeded random line positions. The context is prefilled densely; the
question (and the chat template's assistant prompt and an answer prefix) is decoded token by token
with the method, then the answer is generated greedily (the paper's protocol, the stress case). With
``--prefill-question`` (the serving protocol: a server prefills a whole prompt, and the method's prefill
hook seeds its state from the prompt's last queries) everything but the prompt's last token is
prefilled densely; that token and the answer are decoded with the method. The prompt fills the context length, less
the answer tokens where that length reaches the model's positions. Score (RULER's string match): the share of
the expected values that appear verbatim in the answer, averaged over examples, in percent. The
path mix and group-read rate are counted over the question and answer decode steps.

    python -m bench.eval.niah --lengths 2048 4096 --depths 5 --out results/niah
"""

from __future__ import annotations

import random
from pathlib import Path

from bench.eval import common

DEFAULT_METHODS = "full,exact_topk,retopk,retopk:tau=0.9,streaming_llm,quest,sparq,loki,tokenselect"
TASKS = ("single", "multikey", "multivalue")
KEYS = ("apple", "river", "candle", "falcon", "marble", "harbor", "meadow", "lantern", "copper", "violet",
        "thunder", "garden", "silver", "orchid", "canyon", "ember", "glacier", "willow", "compass", "saffron")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = {
    "single": "What is the special magic number for {key} mentioned in the provided text?",
    "multikey": "What is the special magic number for {key} mentioned in the provided text?",
    "multivalue": "What are all the special magic numbers for {key} mentioned in the provided text?",
}
INTRO = "Some special magic numbers are hidden within the following text. Make sure to memorize it. " \
    "I will quiz you about the numbers afterwards.\n"
ANSWER_PREFIX = {
    "single": "The special magic number for {key} mentioned in the provided text is",
    "multikey": "The special magic number for {key} mentioned in the provided text is",
    "multivalue": "The special magic numbers for {key} mentioned in the provided text are",
}


def parse_args(argv=None):
    p = common.eval_parser(__doc__, DEFAULT_METHODS, batch=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="context lengths in tokens")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--depths", type=int, default=5, help="evenly spaced depths per task and length")
    p.add_argument("--needles", type=int, default=4, help="needles in multikey / values in multivalue")
    p.add_argument("--max-new", type=int, default=0, help="answer tokens (default 12 per expected value + 4)")
    p.add_argument("--no-chat", action="store_true", help="plain prompt even if the tokenizer has a chat template")
    p.add_argument("--prefill-question", action="store_true",
                   help="serving protocol: prefill the question with the context, decode only its last token "
                        "and the answer with the method (default: decode the whole question, as the paper)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def haystack_lines(text: str, offset_frac: float) -> list[str]:
    """Non-empty corpus lines starting at a fraction of the text (wrapping), enough for any context."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    start = int(offset_frac * len(lines)) % len(lines)
    return lines[start:] + lines[:start]


def build_example(task: str, depth: float, length: int, lines: list[str], encode, rng: random.Random,
                  n_needles: int, overhead: int) -> dict:
    """-> {"context", "key", "values", "question", "prefix"}; with ``overhead`` tokens of prompt around the
    context (instructions, template, question), the whole prompt fits ``length`` tokens."""
    keys = rng.sample(KEYS, n_needles)
    key = keys[0]

    def value() -> str:
        return str(rng.randint(1_000_000, 9_999_999))

    if task == "single":
        needles = [(key, value())]
    elif task == "multikey":
        needles = [(k, value()) for k in keys]
    else:
        needles = [(key, value()) for _ in range(n_needles)]
    expected = [v for k, v in needles if k == key] if task == "multivalue" else [needles[0][1]]
    # take lines until the haystack fills what the prompt and the needles leave (margin: joins may re-tokenize)
    budget = length - overhead - sum(len(encode(NEEDLE.format(key=k, value=v))) + 1 for k, v in needles) - 8
    hay, used = [], 0
    for ln in lines:
        n = len(encode(ln)) + 1
        if used + n > budget:
            break
        hay.append(ln)
        used += n
    positions = [round(depth * len(hay))] + [rng.randint(0, len(hay)) for _ in needles[1:]]
    for pos, (k, v) in sorted(zip(positions, needles, strict=True), key=lambda t: -t[0]):
        hay.insert(pos, NEEDLE.format(key=k, value=v))
    return {"context": "\n".join(hay), "key": key, "values": expected,
            "question": QUESTION[task].format(key=key), "prefix": ANSWER_PREFIX[task].format(key=key)}


def prompt_ids(runner, ex: dict, chat: bool) -> tuple[list[int], list[int]]:
    """(context ids to prefill, question ids to decode with the method)."""
    intro = INTRO
    if chat:
        marker = "\u0000QUESTION\u0000"
        msgs = [{"role": "user", "content": intro + ex["context"] + "\n" + marker}]
        full = runner.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        head, tail = full.split(marker)
        ctx = runner.encode(head, add_special_tokens=False)
        q = runner.encode(ex["question"] + tail + ex["prefix"], add_special_tokens=False)
    else:
        ctx = runner.encode(intro + ex["context"] + "\n", add_special_tokens=True)
        q = runner.encode(ex["question"] + " " + ex["prefix"], add_special_tokens=False)
    return ctx, q


def score(text: str, values: list[str]) -> float:
    return sum(v in text for v in values) / len(values)


def evaluate(runner, runs, text: str, lengths: list[int], tasks: list[str], n_depths: int, needles: int,
             max_new: int = 0, chat: bool = True, seed: int = 0, desc: str = "niah", batch: int | None = None,
             prefill_question: bool = False) -> dict:
    """Every (length, task, depth) example answered by every method, in batches of at most ``batch``
    methods sharing the example's dense prefill.
    -> {"records": one per (example, method), "mix": {label: {L: PathMix}} over question + answer steps}."""
    bad = set(tasks) - set(TASKS)
    if bad:
        raise SystemExit(f"unknown tasks {sorted(bad)}; choose from {TASKS}")
    chat = chat and getattr(runner.tokenizer, "chat_template", None) is not None
    encode = lambda s: runner.encode(s, add_special_tokens=False)  # noqa: E731
    depths = [i / max(1, n_depths - 1) for i in range(n_depths)]
    groups, tail = common.batches(runs, batch), common.prefill_tail(runs)
    bar = common.progress_bar(len(lengths) * len(tasks) * len(depths) * len(groups), desc)
    records, mixes = [], {r.label: {} for r in runs}
    stop = tuple(runner.info.eos_token_ids)
    for L in lengths:
        for task in tasks:
            probe = {"context": "", "question": QUESTION[task].format(key=max(KEYS, key=len)),
                     "prefix": ANSWER_PREFIX[task].format(key=max(KEYS, key=len))}
            overhead = sum(map(len, prompt_ids(runner, probe, chat)))
            n_answer = max_new or 12 * (needles if task == "multivalue" else 1) + 4
            # the prompt fills L tokens, less the answer's where L reaches the model's positions
            budget = min(L, runner.max_context - n_answer)
            for di, depth in enumerate(depths):
                rng = random.Random(f"{seed}-{L}-{task}-{di}")
                lines = haystack_lines(text, rng.random())
                ex = build_example(task, depth, budget, lines, encode, rng, needles, overhead)
                ctx, q = prompt_ids(runner, ex, chat)
                if prefill_question:  # the serving protocol: only the prompt's last token is decoded
                    ctx, q = ctx + q[:-1], q[-1:]
                out = {}
                with common.held_prefix(runner, ctx, tail=tail) as held:
                    for group in groups:
                        out.update(common.answer(runner, group, ctx, q, n_answer, stop, progress=bar, held=held))
                for label, res in out.items():
                    text_out = runner.decode_tokens(res["ids"])
                    records.append({"length": L, "task": task, "depth": depth, "method": label,
                                    "context_tokens": len(ctx) + len(q), "values": ex["values"], "answer": text_out,
                                    "score": score(text_out, ex["values"]), "mix": res["mix"].summary()})
                    if L in mixes[label]:
                        mixes[label][L].merge(res["mix"])
                    else:
                        mixes[label][L] = res["mix"]
    bar.close()
    return {"records": records, "mix": mixes, "chat": chat, "depths": depths}


def main(argv=None, runner=None) -> dict:
    """Run the evaluation; ``runner`` (a ModelRunner) is reused instead of loading --model when given."""
    args = parse_args(argv)
    runner, started = common.start_run(args, runner)
    runs = common.parse_methods(args.methods, args.top_k, runner.info.head_dim)
    text = common.load_corpus(args.corpus)
    tasks = [t for t in args.tasks.split(",") if t]
    res = evaluate(runner, runs, text, args.lengths, tasks, args.depths, args.needles, args.max_new,
                   not args.no_chat, args.seed, batch=args.batch,
                   prefill_question=args.prefill_question)
    records = res["records"]
    rows = table_rows(records, runs, args.lengths, tasks, res["mix"])
    cols = [("method", "method", "")] + [(f"avg_{L}", f"NIAH {L}", ".1f") for L in args.lengths] + \
        [(f"{t}_{L}", f"{t} {L}", ".1f") for L in args.lengths for t in tasks]
    mix_cols = [("method", "method", "")] + [c for L in args.lengths for c in common.mix_columns(f"_{L}", str(L))]
    plot = plot_depth(records, runs, args.out / "niah.png")
    meta = common.run_meta(args, runner, started, lengths=args.lengths, tasks=tasks, depths=len(res["depths"]),
                           chat=res["chat"])
    common.write_results(args.out, "niah", f"Needle in a haystack (RULER style), {len(res['depths'])} depths per task, "
                         f"K={args.top_k}", [("Score (% of expected values found; NIAH L = mean of the tasks)",
                                              common.markdown_table(rows, cols)),
                                             ("Path mix over the question and answer steps (share of layer x head x "
                                              "step) and group reads (share of layer x KV group x step)",
                                              common.markdown_table(rows, mix_cols))],
                         meta, {"rows": rows, "records": records}, [plot])
    return {"rows": rows, "records": records}


def table_rows(records: list[dict], runs, lengths, tasks, mixes: dict | None = None) -> list[dict]:
    """One row per method: score per task and length, their mean per length (``avg_L``) and, from
    ``mixes`` (label -> {L: PathMix}), the path mix per length (``reuse_L``, ``group_read_L``, ...)."""
    rows = []
    for r in runs:
        row = {"method": r.label}
        for L, mix in (mixes or {}).get(r.label, {}).items():
            row.update({f"{k}_{L}": v for k, v in mix.summary().items()})
        for L in lengths:
            per_task = []
            for t in tasks:
                s = [x["score"] for x in records if x["method"] == r.label and x["length"] == L and x["task"] == t]
                row[f"{t}_{L}"] = 100 * sum(s) / len(s) if s else None
                per_task.append(row[f"{t}_{L}"])
            row[f"avg_{L}"] = sum(per_task) / len(per_task) if per_task else None
        rows.append(row)
    return rows


def plot_depth(records: list[dict], runs, path: Path) -> str:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in runs:
        depths = sorted({x["depth"] for x in records})
        ys = []
        for d in depths:
            s = [x["score"] for x in records if x["method"] == r.label and x["depth"] == d]
            ys.append(100 * sum(s) / len(s))
        ax.plot(depths, ys, marker="o", label=r.label)
    ax.set_xlabel("needle depth")
    ax.set_ylabel("score (%)")
    ax.set_title("NIAH by depth (all lengths and tasks)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    return common.save_figure(fig, path)


if __name__ == "__main__":
    main()
