"""Rendering a conversation with tools through the model's chat template.

A template that knows tools (it reads the ``tools`` variable, as Qwen2.5's, Llama 3.1's or Hermes' do)
gets the tools, assistant messages' ``tool_calls`` and ``role: "tool"`` messages as they are. A template
that does not (SmolLM2's) would drop them silently, so the conversation is rewritten into what it can
render, in the Hermes convention the engine parses (engine/tools.py):

- the tools are described in the system message (added when there is none), with how to call one:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- an assistant message's tool calls are appended to its text in that form;
- a tool's result keeps its role "tool" when the template renders that role, else it becomes a user
  message ``<tool_response>...</tool_response>``.
"""

from __future__ import annotations

import json

TOOLS_SYSTEM = ("You can call functions. The available functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
                "To call a function, reply with a JSON object inside <tool_call></tool_call> tags, one per call:\n"
                '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>')


def knows_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads the ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def _call_text(call: dict) -> str:
    fn = call.get("function", call)
    arguments = fn.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass  # quoted as the string it is
    return "<tool_call>\n" + json.dumps({"name": fn.get("name", ""), "arguments": arguments},
                                        ensure_ascii=False) + "\n</tool_call>"


def rewrite(messages: list[dict], tools: list[dict] | None, tool_role: bool = True) -> list[dict]:
    """The conversation for a template without tool support (see the module docstring)."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            content = "\n".join([content] * bool(content) + [_call_text(c) for c in m["tool_calls"]])
        elif role == "tool" and not tool_role:
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        described = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        block = TOOLS_SYSTEM.format(tools=described)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_messages(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], dict]:
    """(messages, extra keyword arguments of apply_chat_template) for this tokenizer's template."""
    plain = not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if plain:
        return [{"role": m["role"], "content": m.get("content") or ""} for m in messages], {}
    if knows_tools(tokenizer):
        return [{k: v for k, v in m.items() if v not in (None, "", [])} | {"content": m.get("content") or ""}
                for m in messages], ({"tools": tools} if tools else {})
    try:  # does the template render a "tool" role? (a generic one does; others raise for unknown roles)
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}],
                                      tokenize=False)
        tool_role = True
    except Exception:  # noqa: BLE001 - any template error means: it does not
        tool_role = False
    return rewrite(messages, tools, tool_role), {}
