"""The ``retopk`` command line: talk to a retopk server from a terminal or a script.

    retopk generate "What is the capital of France?"     stream an answer
    retopk chat                                           interactive chat keeping a session
    retopk sessions list|show|create|close               manage sessions
    retopk info | status | health                         model, load, health check
    retopk bench -n 8 --duration 30                       load generator (loopback only)

Exit status: 0 success; 1 the server answered with an error (or health is not SERVING, or every
bench request failed); 2 bad command-line usage; 3 the server could not be reached (UNAVAILABLE)
or the deadline passed; 130 interrupted. Errors print one line to stderr:
``retopk: error: <CODE>: <message>``.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from retopk_client.cli import bench, chat, common, generate, info, sessions
from retopk_client.errors import RetopkError
from retopk_client.types import FieldValueError

EXIT_OK, EXIT_SERVER_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def build_parser(environ=None) -> argparse.ArgumentParser:
    environ = common.environ() if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="retopk",
        description="Client of the retopk decoding server (ReTopK sparse attention over gRPC).",
        epilog="Exit status: 0 ok, 1 server error, 2 usage error, 3 server unreachable or deadline exceeded, "
               "130 interrupted. Environment: RETOPK_ADDRESS, RETOPK_API_KEY, RETOPK_TLS, RETOPK_TLS_CA, "
               "RETOPK_TLS_CLIENT_CERT, RETOPK_TLS_CLIENT_KEY.",
    )
    common.add_connection_args(parser, environ)  # before the subcommand, or after it (each one takes them too)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parents = [common.connection_parent(environ)]
    for module in (generate, chat, sessions, info, bench):
        module.register(sub, parents)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except FieldValueError as err:  # a flag's value the wire cannot carry: a usage error, caught before sending
        flag = {"method": "--method-params"}.get(err.field.split(".")[0], "--" + err.field.split(".")[-1].replace(
            "_", "-"))
        parser.print_usage(sys.stderr)
        common.stderr(f"retopk: error: {flag}: {err}")
        return EXIT_USAGE
    except RetopkError as err:
        common.stderr(f"retopk: error: {err}")
        unreachable = err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        return EXIT_UNREACHABLE if unreachable else EXIT_SERVER_ERROR
    except KeyboardInterrupt:
        common.stderr("retopk: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. piped into `head`: not an error of ours
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
