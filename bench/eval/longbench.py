"""LongBench QA (2WikiMQA, HotpotQA, MultiFieldQA-en) with LongBench's prompts and F1 metric.

LongBench cannot be downloaded here: point ``--data`` at a folder holding LongBench's JSONL files
(``2wikimqa.jsonl``, ``hotpotqa.jsonl``, ``multifieldqa_en.jsonl``, as in the THUDM/LongBench data
release; one JSON object a line with at least "input", "context", "answers"). Prompts and answer
lengths are LongBench's (dataset2prompt / dataset2maxlen). A prompt longer than ``--max-length``
tokens is truncated in the middle (LongBench's rule). The context part is prefilled densely, the
question part (everything after the context) is decoded with the method, and the answer is generated
greedily. Score: LongBench's qa_f1_score (token-level F1 after SQuAD normalisation, max over the
reference answers), averaged per dataset, in percent.

    python -m bench.eval.longbench --data /data/LongBench --limit 50 --out results/longbench
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from pathlib import Path

from bench.eval import common

DEFAULT_METHODS = "full,exact_topk,retopk,retopk:tau=0.9,streaming_llm,quest,sparq,loki,tokenselect"
_HOTPOT = ("Answer the question based on the given passages. Only give me the answer and do not output any other "
           "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
           "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:")
# LongBench's dataset2prompt and dataset2maxlen for the three QA subsets of the paper
DATASETS = {
    "2wikimqa": (_HOTPOT, 32),
    "hotpotqa": (_HOTPOT, 32),
    "multifieldqa_en": ("Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
                        "question based on the above text, only give me the answer and do not output any other "
                        "words.\n\nQuestion: {input}\nAnswer:", 64),
}
LABELS = {"2wikimqa": "2Wiki", "hotpotqa": "Hotpot", "multifieldqa_en": "MFQA"}


def parse_args(argv=None):
    p = common.eval_parser(__doc__, DEFAULT_METHODS)
    p.add_argument("--data", type=Path, required=True, help="folder with LongBench's <dataset>.jsonl files")
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--limit", type=int, default=0, help="first N examples per dataset (0 = all)")
    p.add_argument("--max-length", type=int, default=0,
                   help="prompt tokens kept (middle truncation); default the model's context minus the answer")
    p.add_argument("--no-chat", action="store_true", help="plain prompt even if the tokenizer has a chat template")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


# ---- LongBench's metric (metrics.py: normalize_answer, f1_score, qa_f1_score) ----------------------
def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: list[str], ground_truth: list[str]) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def best_f1(prediction: str, answers: list[str]) -> float:
    """LongBench's scorer: the first line of the prediction (pred.lstrip('\\n').split('\\n')[0] for these
    datasets in its eval.py) against each reference, the max."""
    prediction = prediction.lstrip("\n").split("\n")[0]
    return max((qa_f1_score(prediction, a) for a in answers), default=0.0)


# ---- data and prompts ------------------------------------------------------------------------------
def load_jsonl(path: Path, limit: int = 0) -> list[dict]:
    if not path.is_file():
        raise SystemExit(f"LongBench file {path} is missing; see --help for the expected layout")
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                ex = json.loads(line)
                for key in ("input", "context", "answers"):
                    if key not in ex:
                        raise SystemExit(f"{path}: an example lacks the field {key!r}")
                out.append(ex)
                if limit and len(out) >= limit:
                    break
    return out


def build_prompt(runner, dataset: str, ex: dict, max_length: int, chat: bool) -> tuple[list[int], list[int]]:
    """(context ids to prefill, question ids to decode with the method); the prompt is truncated in the
    middle of the context to max_length tokens (LongBench truncates the middle of the whole prompt)."""
    template = DATASETS[dataset][0]
    head_text, tail_text = template.split("{context}")
    tail_text = tail_text.format(input=ex["input"])
    if chat:
        marker = "\u0000CONTEXT\u0000"
        full = runner.tokenizer.apply_chat_template([{"role": "user", "content": head_text + marker + tail_text}],
                                                    add_generation_prompt=True, tokenize=False)
        head_text, tail_text = full.split(marker)
        head = runner.encode(head_text, add_special_tokens=False)
    else:
        head = runner.encode(head_text, add_special_tokens=True)
    tail = runner.encode(tail_text, add_special_tokens=False)
    context = runner.encode(ex["context"], add_special_tokens=False)
    room = max_length - len(head) - len(tail)
    if room <= 0:
        raise SystemExit(f"--max-length {max_length} leaves no room for the context")
    if len(context) > room:
        half = room // 2
        context = context[:half] + context[len(context) - (room - half):]
    return head + context, tail


def main(argv=None, runner=None) -> dict:
    """Run the evaluation; ``runner`` (a ModelRunner) is reused instead of loading --model when given."""
    args = parse_args(argv)
    runner, started = common.start_run(args, runner)
    runs = common.parse_methods(args.methods, args.top_k, runner.info.head_dim)
    datasets = [d for d in args.datasets.split(",") if d]
    bad = set(datasets) - set(DATASETS)
    if bad:
        raise SystemExit(f"unknown datasets {sorted(bad)}; choose from {list(DATASETS)}")
    chat = not args.no_chat and getattr(runner.tokenizer, "chat_template", None) is not None
    data = {d: load_jsonl(args.data / f"{d}.jsonl", args.limit) for d in datasets}
    stop = tuple(runner.info.eos_token_ids)
    bar = common.progress_bar(sum(len(v) for v in data.values()), "longbench")
    records, mixes = [], {}
    for d, examples in data.items():
        max_new = DATASETS[d][1]
        max_length = args.max_length or runner.max_context - max_new - 1
        for i, ex in enumerate(examples):
            ctx, q = build_prompt(runner, d, ex, max_length, chat)
            out = common.answer(runner, runs, ctx, q, max_new, stop, progress=bar)
            for label, res in out.items():
                pred = runner.decode_tokens(res["ids"])
                records.append({"dataset": d, "index": i, "method": label, "prompt_tokens": len(ctx) + len(q),
                                "prediction": pred, "answers": ex["answers"], "f1": best_f1(pred, ex["answers"]),
                                "mix": res["mix"].summary()})
                if label in mixes:
                    mixes[label].merge(res["mix"])
                else:
                    mixes[label] = res["mix"]
    bar.close()
    rows = []
    for r in runs:
        row = {"method": r.label, **(mixes[r.label].summary() if r.label in mixes else {})}
        for d in datasets:
            s = [x["f1"] for x in records if x["method"] == r.label and x["dataset"] == d]
            row[d] = 100 * sum(s) / len(s) if s else None
        vals = [row[d] for d in datasets if row[d] is not None]
        row["avg"] = sum(vals) / len(vals) if vals else None
        rows.append(row)
    cols = [("method", "method", "")] + [(d, LABELS[d], ".1f") for d in datasets] + [("avg", "Avg.", ".1f")] + \
        [c for c in common.mix_columns() if c[0] in ("reuse", "fallback", "promoted", "group_read")]
    meta = common.run_meta(args, runner, started, corpus=None, data=str(args.data), datasets=datasets, limit=args.limit,
                           chat=chat, examples={d: len(v) for d, v in data.items()})
    plot = plot_f1(rows, datasets, args.out / "longbench.png")
    common.write_results(args.out, "longbench", f"LongBench QA F1, K={args.top_k}",
                         [("F1 (%); path mix over the question and answer steps, group reads over layer x KV group "
                           "x step", common.markdown_table(rows, cols))], meta, {"rows": rows, "records": records},
                         [plot])
    return {"rows": rows, "records": records}


def plot_f1(rows: list[dict], datasets: list[str], path: Path) -> str:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    width = 0.8 / max(1, len(datasets) + 1)
    for i, key in enumerate(datasets + ["avg"]):
        ax.bar([x + i * width for x in range(len(rows))], [r[key] or 0.0 for r in rows], width,
               label=LABELS.get(key, "Avg."))
    ax.set_xticks([x + width * len(datasets) / 2 for x in range(len(rows))], [r["method"] for r in rows],
                  rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("F1 (%)")
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    return common.save_figure(fig, path)


if __name__ == "__main__":
    main()
