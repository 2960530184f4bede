"""Tool calls: the constraint that forces a call, and the parsers that turn generated text into calls.

Convention (Hermes / Qwen, what templates with tool support render and what a template without it is
told in a system message, runtime/chat_tools.py): a call is ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` in the reply.

tool_choice
    none      no parsing: the reply is text
    auto      ``AutoParser``: text outside ``<tool_call>`` blocks streams as content; each block becomes one
              call once it is closed (a block that is not a JSON object with a string ``name`` stays text)
    required  the output is constrained (``forced_schema``) to ``{"name": N, "arguments": A}`` with N one
    function  of the allowed functions and A valid against N's parameters; ``ForcedParser`` streams it as
              one call: its id and name once the name is complete, then the arguments piece by piece

A parser's ``feed(text)`` and ``finish()`` return (content text, [ToolCall pieces]).
"""

from __future__ import annotations

import json
import re
import secrets

from retopk_server.engine.requests import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# the constrained output's fixed head (xgrammar writes JSON with ", " and ": " separators, keys in order)
_FORCED_HEAD = re.compile(r'^\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def forced_schema(tools: list[dict], only: str | None = None) -> str:
    """The JSON schema of one call of ``only`` (or of any of ``tools``): {"name": const, "arguments": params}."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if only is not None and fn["name"] != only:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return json.dumps(schema)


class ForcedParser:
    """The constrained ``{"name": N, "arguments": A}`` as call 0, streamed (the closing "}" held back)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.sent = 0  # characters of the arguments already sent
        self.started = False
        self.called = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        return "", self._pieces(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return "", self._pieces(final=True)

    def _pieces(self, final: bool) -> list[ToolCall]:
        out = []
        match = _FORCED_HEAD.match(self.buffer)
        if match is None:
            return out
        if not self.started:
            self.started = self.called = True
            out.append(ToolCall(0, id=call_id(), name=json.loads(f'"{match.group(1)}"')))
        args = self.buffer[match.end():]
        if final and args.endswith("}"):
            args = args[:-1]  # the wrapper's own brace
        elif not final:
            args = args[:-1]  # it may be the wrapper's brace
        if len(args) > self.sent:
            out.append(ToolCall(0, arguments=args[self.sent:]))
            self.sent = len(args)
        return out


class AutoParser:
    """Text with ``<tool_call>`` blocks: content outside them, one call per closed block."""

    def __init__(self) -> None:
        self.pending = ""  # text not yet classified (inside a block, or a possible start of one)
        self.inside = False
        self.calls = 0

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.pending += text
        content, calls = [], []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    break
                block, self.pending = self.pending[:end], self.pending[end + len(CLOSE):]
                self.inside = False
                call = self._call(block)
                if call is None:
                    content.append(OPEN + block + CLOSE)
                else:
                    calls.append(call)
            else:
                start = self.pending.find(OPEN)
                if start >= 0:
                    content.append(self.pending[:start])
                    self.pending = self.pending[start + len(OPEN):]
                    self.inside = True
                    continue
                hold = max((n for n in range(min(len(OPEN) - 1, len(self.pending)), 0, -1)
                            if self.pending.endswith(OPEN[:n])), default=0)
                cut = len(self.pending) - hold
                content.append(self.pending[:cut])
                self.pending = self.pending[cut:]
                break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.pending = self.pending, ""
        if self.inside:
            self.inside = False
            call = self._call(rest)
            return ("", [call]) if call is not None else (OPEN + rest, [])
        return rest, []

    def _call(self, block: str) -> ToolCall | None:
        try:
            value = json.loads(block.strip())
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            text = arguments
        else:
            text = json.dumps(arguments, ensure_ascii=False)
        call = ToolCall(self.calls, id=call_id(), name=value["name"], arguments=text)
        self.calls += 1
        return call


def parser_for(tool_choice: str, tools: list[dict] | None):
    """The parser of a request's reply, or None (no tools, or tool_choice "none")."""
    if not tools or tool_choice == "none":
        return None
    return AutoParser() if tool_choice == "auto" else ForcedParser()
