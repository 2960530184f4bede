"""Fuzzing every rpc of retopk.v1.ReTopKService with requests generated from the proto descriptors.

``requests()`` is a hypothesis strategy of (rpc, message, metadata) built by walking
``retopk_pb2.DESCRIPTOR``: every rpc of the service, every field of its request type (oneofs, optional
presence, repeated fields and maps, nested messages), each scalar drawn by its wire type with the
extremes mixed in (the integer type's min and max, NaN, +-inf, subnormal and huge floats, empty, huge and
arbitrary Unicode strings, long lists). Fields whose name the server gives a meaning (method names, their
hyperparameter names, chat roles, a few session ids, small max_new_tokens) draw from those values part
of the time, so that many requests are valid and reach the engine, the model and every method.

``fuzz(address, n)`` sends n of them and counts the status codes; a server passes when no answer is
INTERNAL, UNKNOWN, DATA_LOSS or UNIMPLEMENTED and its health is SERVING afterwards.

    python -m tests.reliability.rpc_fuzz --requests 10000     # starts its own server (embedded model)
    python -m tests.reliability.rpc_fuzz --address HOST:PORT  # an already running one

The server it starts keeps valid requests cheap (SERVER_ARGS: prompts <= 512 tokens, <= 8 new tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from retopk_core.methods.registry import method_class, serving_method_names
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["ReTopKService"]
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
             grpc.StatusCode.UNIMPLEMENTED}
SERVER_ARGS = ("--max-prompt-tokens", "512", "--max-new-tokens", "8", "--default-max-new-tokens", "4",
               "--max-sessions", "8", "--max-queue", "8")
SESSION_IDS = ("s0", "s1", "s2")
ROLES = ("user", "system", "assistant", "tool")
# Constraint texts: valid ones (reach xgrammar and the masked sampler), and ones the compiler must refuse
# as the client's error (not JSON, a type it does not know, a grammar that does not parse, no root rule).
SCHEMAS = ('{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
           '{"type": "string", "maxLength": 3}', '{"enum": ["x", "y"]}', '{"type": "nonsense"}', "{", "[]", "true",
           '{"type": "object", "properties": {"a": ' * 40 + "{}" + "}}" * 40, '{"$ref": "#/nowhere"}')
REGEXES = ("[a-z]{1,4}", "(ab|cd)+", "(", "a{99999999}", "", "\\")
GRAMMARS = ('root ::= "yes" | "no"', 'root ::= [0-9]+', "root ::= (", 'start ::= "x"', 'root ::= root "a"', "")
TOOL_CHOICES = ("none", "auto", "required", "sometimes", "")
CALL_TIMEOUT_S = 120.0

_INT_RANGES = {
    FD.TYPE_INT32: (-2**31, 2**31 - 1), FD.TYPE_SINT32: (-2**31, 2**31 - 1), FD.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    FD.TYPE_INT64: (-2**63, 2**63 - 1), FD.TYPE_SINT64: (-2**63, 2**63 - 1), FD.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_FIXED64: (0, 2**64 - 1),
}


def _hyperparameter_names() -> list[str]:
    names: set[str] = set()
    for method in serving_method_names():
        config = method_class(method).config_class
        if config is not None:
            names.update(config.names())
    return sorted(names)


HYPERPARAMETERS = _hyperparameter_names()
STRING_CHOICES = ("similarity", "recent", "head", "promote", "group", "")


# ---------------------------------------------------------------------------------------------- scalars
def integers(kind: int) -> st.SearchStrategy[int]:
    lo, hi = _INT_RANGES[kind]
    small = st.integers(max(lo, -4), min(hi, 600))
    edges = st.sampled_from([v for v in (lo, hi, 0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**53, 8192, 8193)
                             if lo <= v <= hi])
    return st.one_of(small, edges, st.integers(lo, hi))


def floats(width: int) -> st.SearchStrategy[float]:
    edges = st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-38, 1e-45, 1e-5, 2.0, 3.4e38, -3.4e38, math.inf, -math.inf,
                             math.nan, 1e300 if width == 64 else 3.0e38])
    return st.one_of(edges, st.floats(width=width, allow_nan=True, allow_infinity=True))


def texts(max_size: int = 40, huge: bool = True) -> st.SearchStrategy[str]:
    """Arbitrary Unicode, empty, and (``huge``) 1 KB to 2 MB strings."""
    if not huge:
        return st.one_of(st.text(max_size=max_size), st.just(""))
    big = st.sampled_from([1_000, 20_000, 300_000, 2_000_000]).map(lambda n: "word " * (n // 5))
    return st.one_of(st.text(max_size=max_size), st.just(""), big)


def scalar(f: FD, huge: bool = True) -> st.SearchStrategy:
    if f.type in _INT_RANGES:
        return integers(f.type)
    if f.type == FD.TYPE_FLOAT:
        return floats(32)
    if f.type == FD.TYPE_DOUBLE:
        return floats(64)
    if f.type == FD.TYPE_BOOL:
        return st.booleans()
    if f.type == FD.TYPE_STRING:
        return texts(huge=huge)
    if f.type == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if f.type == FD.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), st.integers(-5, 100))
    raise TypeError(f"no strategy for field {f.full_name} of type {f.type}")


# Fields the server gives a meaning: drawn from meaningful values half of the time.
def _meaningful(f: FD) -> st.SearchStrategy | None:
    owner, name = f.containing_type.name, f.name
    if name == "session_id":
        return st.sampled_from(SESSION_IDS)
    if name == "role":
        return st.sampled_from(ROLES)
    if owner == "AttentionMethod" and name == "name":
        return st.sampled_from(serving_method_names())
    if owner == "AttentionMethod" and f.type == FD.TYPE_INT32:
        return st.integers(0, 80)
    if owner == "AttentionMethod" and f.type == FD.TYPE_FLOAT:
        return st.floats(0, 1, width=32)
    if owner == "SamplingParameters" and f.type == FD.TYPE_FLOAT:
        return st.floats(0, 1, width=32)
    if name == "max_new_tokens":
        return st.integers(1, 8)
    if owner == "Constraint" and name == "json_schema" or owner == "Tool" and name == "parameters_json":
        return st.sampled_from(SCHEMAS)
    if owner == "Constraint" and name == "regex":
        return st.sampled_from(REGEXES)
    if owner == "Constraint" and name == "grammar":
        return st.sampled_from(GRAMMARS)
    if owner == "ToolChoice" and name == "mode":
        return st.sampled_from(TOOL_CHOICES)
    if owner in ("Tool", "ToolCall") and name == "name" or owner == "ToolChoice" and name == "function":
        return st.sampled_from(("get_weather", "f", "bad name!"))
    if owner == "GenerateRequest" and name == "n":
        return st.integers(0, 5)
    if name in ("text", "content"):
        return st.text(min_size=1, max_size=60)
    if name in ("ids", "token_ids", "stop_token_ids") or (owner == "TokenIds"):
        return st.integers(0, 49151)
    if name == "string_value":
        return st.sampled_from(STRING_CHOICES)
    if name == "int_value":
        return st.integers(0, 600)
    return None


DENSE = ("ChatMessages", "ChatMessage", "TokenIds")  # PLAUSIBLE sets all their fields


# Modes of a strategy: WILD (anything, strings up to megabytes), TAME (no huge strings: inside long lists),
# PLAUSIBLE (what a client would send: few fields set, each from its meaningful values or small ones).
WILD, TAME, PLAUSIBLE = "wild", "tame", "plausible"


def _plausible_scalar(f: FD) -> st.SearchStrategy:
    if f.type in _INT_RANGES:
        return st.integers(1 if f.name == "max_new_tokens" else 0, 8)
    if f.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return st.floats(0.05, 1, width=32 if f.type == FD.TYPE_FLOAT else 64)
    if f.type == FD.TYPE_STRING:
        return st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=40)
    return scalar(f, huge=False)


def field_value(f: FD, depth: int, mode: str = WILD) -> st.SearchStrategy:
    """One value of a singular field (a message recursively)."""
    if f.type == FD.TYPE_MESSAGE:
        return message(f.message_type, depth + 1, mode)
    meaningful = _meaningful(f)
    if mode == PLAUSIBLE:
        return meaningful if meaningful is not None else _plausible_scalar(f)
    base = scalar(f, huge=mode == WILD)
    return st.one_of(meaningful, meaningful, base) if meaningful is not None else base


def field_values(f: FD, depth: int, mode: str = WILD) -> st.SearchStrategy:
    """What to assign to a field: a value, a list (repeated) or a dict (map). A long list (600 to 70,000
    copies of one item) holds no huge string, so that a request stays within a few megabytes."""
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key_f, value_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        if mode == PLAUSIBLE:
            return st.dictionaries(st.sampled_from(HYPERPARAMETERS), field_value(value_f, depth, mode), max_size=1)
        keys = st.one_of(st.sampled_from(HYPERPARAMETERS), st.sampled_from(HYPERPARAMETERS),
                         scalar(key_f, huge=mode == WILD))
        return st.dictionaries(keys, field_value(value_f, depth, mode), max_size=4)
    if f.is_repeated:
        item = field_value(f, depth, mode)
        if mode == PLAUSIBLE:
            return st.lists(item, min_size=1, max_size=3)
        long = st.tuples(st.sampled_from([600, 5_000, 70_000]), field_value(f, depth, TAME)).map(
            lambda t: [t[1]] * t[0])  # one draw, copied
        return st.one_of(st.lists(item, max_size=5), st.lists(item, max_size=5), long)
    return field_value(f, depth, mode)


def _assign(msg, f: FD, value) -> None:
    target = getattr(msg, f.name)
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        value_f = f.message_type.fields_by_name["value"]
        for k, v in value.items():
            if value_f.type == FD.TYPE_MESSAGE:
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif f.is_repeated:
        target.extend(value)
    elif f.type == FD.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(msg, f.name, value)


def message(descriptor, depth: int = 0, mode: str = WILD) -> st.SearchStrategy:
    """A strategy of messages of ``descriptor``: each oneof sets at most one member, each other field is
    present or not (``optional`` ones truly absent), each set field drawn by ``field_values``. PLAUSIBLE
    sets a field one time in four and always sets a oneof such as an input."""
    cls = getattr(pb, descriptor.name)
    groups = [o for o in descriptor.oneofs]
    in_group = {f.name for o in groups for f in o.fields}
    singles = [f for f in descriptor.fields if f.name not in in_group]
    optional_groups = [o for o in groups if len(o.fields) == 1]  # proto3 `optional`: a synthetic oneof
    if mode == PLAUSIBLE:  # an input's parts are all there; other fields set one time in four
        present = st.just(True) if descriptor.name in DENSE else st.integers(0, 3).map(lambda x: x == 0)
    else:
        present = st.booleans()

    @st.composite
    def build(draw):
        msg = cls()
        for f in singles + [o.fields[0] for o in optional_groups]:
            if draw(present):
                _assign(msg, f, draw(field_values(f, depth, mode)))
        for o in groups:
            if o in optional_groups:
                continue
            choice = draw(st.sampled_from(list(o.fields) if mode == PLAUSIBLE else [None, *o.fields]))
            if choice is not None:
                _assign(msg, choice, draw(field_values(choice, depth, mode)))
        return msg

    return build()


METADATA = st.one_of(st.just(()), st.just(()), st.just(()), st.tuples(st.tuples(st.just("x-session-id"),
                                                                     st.sampled_from(SESSION_IDS + ("other",)))))


@st.composite
def requests(draw):
    """(rpc name, request message, metadata) for any rpc of the service."""
    method = draw(st.sampled_from(list(SERVICE.methods)))
    mode = draw(st.sampled_from([WILD, PLAUSIBLE]))
    return method.name, draw(message(method.input_type, mode=mode)), draw(METADATA)


# ---------------------------------------------------------------------------------------------- running
@dataclass
class FuzzResult:
    """What the run saw: status codes per rpc, the requests that got a bad code, the run's time."""

    counts: Counter = field(default_factory=Counter)  # (rpc, code name) -> n
    reasons: Counter = field(default_factory=Counter)  # (rpc, code name, the status message's field) -> n
    bad: list[tuple[str, str, str, str]] = field(default_factory=list)  # (rpc, code, details, request)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def table(self) -> str:
        """A markdown table: one row per rpc, one column per status code seen."""
        codes = sorted({c for _, c in self.counts}, key=lambda c: (c != "OK", c))
        rpcs = [m.name for m in SERVICE.methods]
        lines = ["| rpc | " + " | ".join(codes) + " |", "|---|" + "---:|" * len(codes)]
        for rpc in rpcs:
            lines.append(f"| {rpc} | " + " | ".join(str(self.counts.get((rpc, c), 0)) for c in codes) + " |")
        lines.append("| all | " + " | ".join(str(sum(n for (_, c), n in self.counts.items() if c == code))
                                              for code in codes) + " |")
        return "\n".join(lines)


def call(stub, rpc: str, request, metadata) -> tuple[grpc.StatusCode, str]:
    method = SERVICE.methods_by_name[rpc]
    try:  # a client stream (ImportSession) sends the one message; a server stream is read to its end
        result = getattr(stub, rpc)(iter([request]) if method.client_streaming else request,
                                    timeout=CALL_TIMEOUT_S, metadata=metadata or None)
        if method.server_streaming:
            for _ in result:
                pass
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def _short(request) -> str:
    text = repr(request)
    return text if len(text) <= 600 else text[:600] + "..."


class _TimeUp(Exception):
    """Ends a run at its time limit (raised inside the hypothesis loop, caught by ``fuzz``)."""


def fuzz(address: str, n: int, seed: int | None = None, progress: bool = False, max_seconds: float | None = None,
         out: str | None = None) -> FuzzResult:
    """Send ``n`` generated requests to ``address`` (one at a time) and count what came back; stop early after
    ``max_seconds``; every 500 requests (and at the end) write the counts so far to ``out`` (JSON)."""
    result = FuzzResult()
    t0 = time.monotonic()
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1),
                                                 ("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.ReTopKServiceStub(channel)

        @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], derandomize=seed is None,
                  suppress_health_check=list(HealthCheck))
        @given(requests())
        def one(case):
            if max_seconds is not None and time.monotonic() - t0 > max_seconds:
                raise _TimeUp
            rpc, request, metadata = case
            code, details = call(stub, rpc, request, metadata)
            result.counts[(rpc, code.name)] += 1
            result.reasons[(rpc, code.name, details.split(":")[0][:40])] += 1
            if code in BAD_CODES:
                result.bad.append((rpc, code.name, details, _short(request)))
            if result.total % 500 == 0:
                result.seconds = time.monotonic() - t0
                if progress:
                    print(f"  {result.total} requests, {result.seconds:.0f} s", file=sys.stderr, flush=True)
                if out:
                    write(result, out)

        if seed is not None:
            from hypothesis import seed as hypothesis_seed

            one = hypothesis_seed(seed)(one)
        try:
            one()
        except _TimeUp:
            pass
    result.seconds = time.monotonic() - t0
    return result


def write(result: FuzzResult, path: str, **extra) -> None:
    with open(path, "w") as f:
        json.dump({"requests": result.total, "seconds": result.seconds, **extra,
                   "counts": {f"{r} {c}": n for (r, c), n in sorted(result.counts.items())},
                   "bad": result.bad}, f, indent=1)


def healthy(address: str) -> bool:
    """Both health names SERVING and a plain greedy Generate answers."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE.full_name):
            if health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status != \
                    health_pb2.HealthCheckResponse.SERVING:
                return False
        replies = list(pb_grpc.ReTopKServiceStub(channel).Generate(
            pb.GenerateRequest(text="The capital of France is", max_new_tokens=3, ignore_eos=True), timeout=60))
        return sum(len(r.token_ids) for r in replies) == 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="how many requests to send (default 10000)")
    parser.add_argument("--address", help="HOST:PORT of a running server (default: start one)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: derandomized)")
    parser.add_argument("--out", help="write the counts and failures as JSON here (also every 500 requests)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop sending after this long")
    args = parser.parse_args(argv)
    server = None
    if args.address is None:
        from tests._live_server import launch_server

        server = launch_server(*SERVER_ARGS, timeout=900)  # a busy machine loads the model slowly
        address = server.address
        print(f"server pid {server.process.pid} on {address}", file=sys.stderr, flush=True)
    else:
        address = args.address
    try:
        result = fuzz(address, args.requests, args.seed, progress=True, max_seconds=args.max_seconds, out=args.out)
        ok = healthy(address)
    finally:
        exit_code = server.stop() if server is not None else 0
    print(result.table())
    print(f"\n{result.total} requests in {result.seconds:.0f} s ({result.total / result.seconds:.1f}/s); "
          f"{len(result.bad)} with INTERNAL/UNKNOWN; healthy after: {ok}; server exit code {exit_code}")
    print("most frequent refusals (rpc, code, field):")
    for (rpc, code, why), count in result.reasons.most_common(25):
        if code != "OK":
            print(f"  {count:6d}  {rpc} {code} {why}")
    for rpc, code, details, request in result.bad[:20]:
        print(f"  {rpc} {code}: {details}\n    {request}")
    if args.out:
        write(result, args.out, healthy_after=ok, exit_code=exit_code)
    return 0 if not result.bad and ok and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
