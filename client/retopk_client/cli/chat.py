"""`retopk chat`: an interactive conversation that keeps one server session.

Reads one user message per line from stdin (so it can be scripted: ``printf 'Hi\\n/exit\\n' | retopk chat``),
streams each reply, and closes the session at the end. Commands: /exit (or /quit, or end of input),
/reset (start over in a new session), /info (the session's state), /help. Any other line that starts with
"/" and a word is an unknown command, said so on stderr and not sent; "//" sends a line that starts with "/".
"""

from __future__ import annotations

import argparse
import re
import sys

from retopk_client.cli import common
from retopk_client.cli.generate import summary
from retopk_client.types import CompletionBuilder

HELP = ("commands: /exit (or /quit, end of input) leave, /reset new session, /info session state, /help this; "
        "start a message with // to send a leading /")
COMMAND = re.compile(r"/\w+")


def register(sub, parents) -> None:
    p = sub.add_parser(
        "chat", parents=parents, help="interactive chat that keeps a session (reads stdin; scriptable)",
        description="Chat with the model in one server session. " + HELP,
    )
    p.add_argument("--system", default=None, help="system message of the conversation")
    p.add_argument("--session", default=None, metavar="ID",
                   help="continue an existing session (it is left open at the end)")
    p.add_argument("--json", action="store_true", help="print each reply as one JSON object instead of text")
    common.add_sampling_args(p)
    common.add_method_args(p)
    p.set_defaults(run=run)


def _prompt(interactive: bool) -> str | None:
    if interactive:
        sys.stdout.write("> ")
        sys.stdout.flush()
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def run(args: argparse.Namespace) -> int:
    interactive = common.is_tty(sys.stdin) and common.is_tty(sys.stdout)
    kwargs = common.generate_kwargs(args)
    with common.make_client(args) as client:
        method = common.method_from(args)
        own = args.session is None
        session_id = client.create_session(method).session_id if own else args.session
        first = True
        if interactive:
            common.stderr(f"session {session_id}. {HELP}")
        try:
            while (line := _prompt(interactive)) is not None:
                text = line.strip()
                if not text:
                    continue
                if text in ("/exit", "/quit"):
                    break
                if text == "/help":
                    common.stderr(HELP)
                    continue
                if text == "/info":
                    common.print_json(client.get_session(session_id).to_dict())
                    continue
                if text == "/reset":
                    if own:
                        client.close_session(session_id)
                    session_id, own, first = client.create_session(method).session_id, True, True
                    common.stderr(f"new session {session_id}")
                    continue
                if COMMAND.match(text):
                    common.stderr(f"unknown command {text.split()[0]!r} (not sent); {HELP}")
                    continue
                if text.startswith("//"):
                    text = text[1:]
                messages = [{"role": "system", "content": args.system}] if (first and args.system) else []
                messages.append({"role": "user", "content": text})
                builder = CompletionBuilder()
                for chunk in client.generate(messages=messages, session_id=session_id, **kwargs):
                    builder.add(chunk)
                    if not args.json:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                first = False
                if args.json:
                    common.print_json(summary(builder.build()))
                else:
                    sys.stdout.write("\n")
                    sys.stdout.flush()
        finally:
            if own:
                client.close_session(session_id)
    return 0
