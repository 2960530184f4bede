"""`retopk sessions`: list, show, create and close server sessions."""

from __future__ import annotations

import argparse
import time

from retopk_client.cli import common
from retopk_client.types import SessionInfo


def register(sub, parents) -> None:
    p = sub.add_parser("sessions", help="list, show, create or close sessions",
                       description="Manage the server's sessions (conversations whose caches stay on the server).")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = actions.add_parser("list", parents=parents, help="list open sessions", description="List open sessions.")
    ls.add_argument("--json", action="store_true", help="print a JSON array")
    show = actions.add_parser("show", parents=parents, help="describe one session", description="Describe a session.")
    show.add_argument("session_id")
    show.add_argument("--json", action="store_true", help="print a JSON object")
    create = actions.add_parser("create", parents=parents, help="open a session and print its id",
                                description="Open a session (for 'retopk generate --session ID').")
    create.add_argument("--session-id", default=None, help="the id to use (default: the server makes one up)")
    create.add_argument("--json", action="store_true", help="print a JSON object")
    common.add_method_args(create)
    close = actions.add_parser("close", parents=parents, help="close a session", description="Close a session.")
    close.add_argument("session_id")
    close.add_argument("--json", action="store_true", help="print the closed session as a JSON object")
    for action in (ls, show, create, close):
        action.set_defaults(run=run)


def format_row(s: SessionInfo) -> str:
    age = time.time() - s.created_unix
    return (f"{s.session_id:<36} {s.method.name:<12} {s.num_tokens:>8} {s.turns:>6} "
            f"{s.kv_bytes / 2**20:>9.2f} {'yes' if s.busy else 'no':>5} {age:>8.0f}")


HEADER = f"{'session':<36} {'method':<12} {'tokens':>8} {'turns':>6} {'kv MiB':>9} {'busy':>5} {'age s':>8}"


def describe(s: SessionInfo) -> str:
    return "\n".join([
        f"session       {s.session_id}",
        f"method        {s.method.describe()}",
        f"tokens        {s.num_tokens}",
        f"turns         {s.turns}",
        f"kv bytes      {s.kv_bytes}",
        f"method bytes  {s.method_state_bytes}",
        f"busy          {s.busy}",
        f"created       {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s.created_unix))}",
        f"last used     {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s.last_used_unix))}",
    ])


def run(args: argparse.Namespace) -> int:
    with common.make_client(args) as client:
        if args.action == "list":
            sessions = client.list_sessions()
            if args.json:
                common.print_json([s.to_dict() for s in sessions])
            else:
                print("\n".join([HEADER, *(format_row(s) for s in sessions)]))
            return 0
        if args.action == "create":
            info = client.create_session(common.method_from(args), session_id=args.session_id)
        elif args.action == "show":
            info = client.get_session(args.session_id)
        else:
            info = client.close_session(args.session_id)
        if args.json:
            common.print_json(info.to_dict())
        elif args.action == "create":
            print(info.session_id)
        elif args.action == "close":
            print(f"closed {info.session_id}")
        else:
            print(describe(info))
    return 0
