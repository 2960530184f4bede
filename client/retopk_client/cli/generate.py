"""`retopk generate`: stream one completion to the terminal (or JSON for scripts)."""

from __future__ import annotations

import argparse
import sys

from retopk_client.cli import common
from retopk_client.types import CompletionBuilder, Constraint


def register(sub, parents) -> None:
    p = sub.add_parser(
        "generate", parents=parents, help="generate a completion, streamed as it arrives",
        description="Generate a completion and print it as it arrives. By default the prompt is sent as a user "
                    "chat message (the model's chat template); --raw sends it as plain text.",
    )
    p.add_argument("prompt", help="the prompt; '-' reads it from stdin")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--system", default=None, help="a system message before the prompt (chat mode)")
    p.add_argument("--session", default=None, metavar="ID", help="continue this session (see 'retopk sessions')")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--step-stats", action="store_true",
                   help="ask for per-step attention path statistics (summarised in --json output; --usage "
                        "adds the group-read rate)")
    p.add_argument("--request-id", default=None, help="an id for this request, echoed by the server")
    p.add_argument("--logprobs", type=int, nargs="?", const=0, default=None, metavar="N",
                   help="ask for each generated token's log-probability and, with N, the N most likely tokens "
                        "of each step (in --json / --jsonl output; --usage adds the mean)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="constrain the output to one JSON value valid against the JSON schema in FILE ('-': stdin)")
    shape.add_argument("--json-object", action="store_true", help="constrain the output to one JSON object")
    shape.add_argument("--regex", metavar="PATTERN", help="constrain the output to match this regular expression")
    shape.add_argument("--grammar", metavar="FILE", help="constrain the output to the EBNF grammar in FILE (rule root)")
    p.add_argument("--strict", action="store_true", help="with --json-schema: strict mode (no properties the "
                                                         "schema does not allow)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true",
                     help="print one JSON object at the end: text, token_ids, finish_reason, usage, timings")
    out.add_argument("--jsonl", action="store_true", help="print every chunk as one JSON object per line")
    p.add_argument("--usage", action="store_true", help="print usage and timings to stderr at the end")
    common.add_sampling_args(p)
    common.add_method_args(p)
    p.set_defaults(run=run)


def request_kwargs(args: argparse.Namespace, prompt: str) -> dict:
    kwargs = common.generate_kwargs(args)
    if args.raw:
        kwargs["prompt"] = prompt
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        kwargs["messages"] = messages + [{"role": "user", "content": prompt}]
    if args.session:
        kwargs["session_id"] = args.session
    method = common.method_from(args)
    if method is not None:
        kwargs["method"] = method
    if args.ignore_eos:
        kwargs["ignore_eos"] = True
    if args.step_stats:
        kwargs["return_step_stats"] = True
    if args.request_id:
        kwargs["request_id"] = args.request_id
    if args.logprobs is not None:
        kwargs["logprobs"], kwargs["top_logprobs"] = True, args.logprobs
    constraint = constraint_from(args)
    if constraint is not None:
        kwargs["constraint"] = constraint
    return kwargs


def _read(path: str, flag: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise SystemExit(f"retopk generate: {flag} {path}: {e.strerror or e}") from None


def constraint_from(args: argparse.Namespace) -> Constraint | None:
    """The Constraint the --json-schema / --json-object / --regex / --grammar flags ask for (the server checks it)."""
    if args.strict and not args.json_schema:
        raise SystemExit("retopk generate: --strict applies to --json-schema only")
    if args.json_schema:
        return Constraint.json_schema(_read(args.json_schema, "--json-schema"), strict=args.strict)
    if args.json_object:
        return Constraint.json_object()
    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.grammar:
        return Constraint.grammar(_read(args.grammar, "--grammar"))
    return None


def summary(completion) -> dict:
    """The --json object: the completion without the bulky step stats, which are summarised as path_counts
    ((layer, head) decisions per path name), group_read_rate (share of (layer, KV group, step) triples whose
    keys were read in full) and steps; logprobs (one per token id) and mean_logprob only when asked for."""
    out = completion.to_dict()
    if out["logprobs"]:
        out["mean_logprob"] = completion.mean_logprob()
    else:
        del out["logprobs"]
    stats = out.pop("step_stats")
    if stats:
        counts: dict[str, int] = {}
        for step in completion.step_stats:
            for name, n in step.path_counts().items():
                counts[name] = counts.get(name, 0) + n
        out["path_counts"] = counts
        out["group_read_rate"] = completion.group_read_rate()
        out["steps"] = len(stats)
    return out


def _mean_logprob(completion) -> str:
    mean = completion.mean_logprob()
    return "" if mean is None else f"; mean logprob {mean:.3f}"


def _group_reads(completion) -> str:
    rate = completion.group_read_rate()
    return "" if rate is None else f"; group-read rate {100 * rate:.1f}% (KV groups read in full)"


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with common.make_client(args) as client:
        builder = CompletionBuilder()
        with client.generate(**request_kwargs(args, prompt)) as stream:
            for chunk in stream:
                builder.add(chunk)
                if args.jsonl:
                    common.print_json(chunk.to_dict())
                elif not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        completion = builder.build()
    if args.json:
        common.print_json(summary(completion))
    elif not args.jsonl:
        sys.stdout.write("\n")
    if args.usage and completion.usage and completion.timings:
        u, t = completion.usage, completion.timings
        common.stderr(
            f"[{completion.finish_reason.value if completion.finish_reason else '?'}] prompt {u.prompt_tokens} "
            f"+ generated {u.generated_tokens} tokens; ttft {t.time_to_first_token_seconds * 1000:.0f} ms, "
            f"total {t.total_seconds:.2f} s{_group_reads(completion)}{_mean_logprob(completion)}"
        )
    return 0
