"""`retopk sessions`: list, show, create and close server sessions; export one to a file and import it again.

    retopk sessions export ID -o chat.session [--close]     the session's artifact (KV cache, method state,
                                                            conversation), e.g. to move it to another server
    retopk sessions import chat.session [--session-id NEW]  open it on the server --address names

The artifact belongs to the key that exported it: only that key imports it, into a server of the same model
setup (the server names what differs otherwise). Progress goes to stderr when it is a terminal (--progress
forces it, --quiet silences it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

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
    export = actions.add_parser("export", parents=parents, help="write a session's artifact to a file",
                                description="Write the session's artifact (its KV cache, method state and "
                                            "conversation) to a file, readable by you only, for 'sessions import'.")
    export.add_argument("session_id")
    export.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write (replaced)")
    export.add_argument("--close", action="store_true", help="close the session on the server once exported "
                                                             "(it moves)")
    imp = actions.add_parser("import", parents=parents, help="open a session from an exported file",
                             description="Open a session from a file 'sessions export' wrote (same key, same "
                                         "model setup); it continues where the exported one stood.")
    imp.add_argument("file", metavar="FILE")
    imp.add_argument("--session-id", default=None, help="its id here (default: the id it was exported under)")
    imp.add_argument("--json", action="store_true", help="print the imported session as a JSON object")
    for action in (export, imp):
        shown = action.add_mutually_exclusive_group()
        shown.add_argument("--progress", action="store_true", default=None, help="report progress on stderr")
        shown.add_argument("--quiet", dest="progress", action="store_false", help="no progress report")
    for action in (ls, show, create, close, export, imp):
        action.set_defaults(run=run)


def progress_printer(enabled: bool | None, verb: str):
    """A progress callback printing "<verb> 12.0 MiB [of 30.0 MiB]" on stderr (one line, rewritten), or None."""
    if not (common.is_tty(sys.stderr) if enabled is None else enabled):
        return None
    shown = [-1]

    def show(done: int, total: int | None = None) -> None:
        step = done >> 22  # every 4 MiB, and at the end
        if step == shown[0] and done != total:
            return
        shown[0] = step
        of = f" of {total / 2**20:.1f} MiB" if total else ""
        end = "\n" if total and done == total else ""
        print(f"\r{verb} {done / 2**20:.1f} MiB{of}", end=end, file=sys.stderr, flush=True)

    return show


def write_private(path: Path, data: bytes) -> None:
    """``data`` into ``path`` (mode 0600: an artifact holds the conversation), via a temporary name."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)


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
    if args.action == "import":
        try:
            data = Path(args.file).read_bytes()
        except OSError as e:
            common.stderr(f"retopk: error: FILE: cannot read {args.file}: {e.strerror}")
            return 2
    if args.action == "export":
        out = Path(args.output)
        if not out.parent.is_dir():
            common.stderr(f"retopk: error: --output: no directory {str(out.parent)!r}")
            return 2
    with common.make_client(args) as client:
        if args.action == "export":
            shown = progress_printer(args.progress, "exported")
            data = client.export_session(args.session_id, close=args.close, progress=shown)
            write_private(out, data)
            if shown is not None:
                print(file=sys.stderr)
            print(f"exported {args.session_id} ({len(data)} bytes) to {out}")
            return 0
        if args.action == "import":
            info = client.import_session(data, session_id=args.session_id,
                                         progress=progress_printer(args.progress, "imported"))
            if args.json:
                common.print_json(info.to_dict())
            else:
                print(f"imported {info.session_id} ({info.num_tokens} tokens, {info.turns} turns)")
            return 0
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
