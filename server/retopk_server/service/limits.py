"""The sizes a client may send, each bounded and derived once from the server's limits and the model.

Every check raises ``InvalidArgument`` naming the field, before any work is queued; the limits are
reported in ModelInfo.limits (``reported``) and bound gRPC's own message size (``max_message_bytes``).

    max_prompt_tokens    tokens one request may feed (the server's --max-prompt-tokens, else the context)
    max_text_chars       characters of Generate.text, of Tokenize.text and of a chat's messages together:
                         CHARS_PER_TOKEN x max_prompt_tokens (no tokenizer packs more into a token; a text
                         longer than that is refused before the tokenizer spends time on it)
    max_chat_messages    messages of one chat input
    max_stop_strings     stop strings of one request (wire.MAX_STOP); each at most max_stop_chars
    max_stop_token_ids   stop token ids of one request
    max_detokenize_ids   token ids of one Detokenize: a whole context
    max_message_bytes    gRPC's receive limit: the largest text as UTF-8 (4 bytes a character) plus the
                         largest token id list (5 bytes an id) plus MESSAGE_SLACK_BYTES for the rest
    max_method_state_bytes  one session's attention-method state (runtime/method_limits.py)
    max_session_chunk_bytes     one chunk of a session artifact (ExportSession, ImportSession): SESSION_CHUNK_BYTES
    max_session_artifact_bytes  one session artifact (engine/session_artifact.py): a full-context KV cache at
                         float32 and its token ids, the largest method state, the conversation's text (4 bytes a
                         character, max_text_chars per context's worth) and MESSAGE_SLACK_BYTES
"""

from __future__ import annotations

from dataclasses import dataclass

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.runtime.method_limits import dense_kv_bytes, state_cap_bytes
from retopk_server.service.wire import MAX_STOP, InvalidArgument

CHARS_PER_TOKEN = 32
MAX_CHAT_MESSAGES = 1024
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MESSAGE_SLACK_BYTES = 1 << 20
SESSION_CHUNK_BYTES = 1 << 20  # below max_message_bytes, so a chunk always fits one gRPC message


@dataclass(frozen=True)
class InputLimits:
    """See the module docstring; ``of(config, info)`` derives them, ``info`` is the runner's ModelInfo."""

    info: object
    max_prompt_tokens: int
    max_text_chars: int
    max_chat_messages: int = MAX_CHAT_MESSAGES
    max_stop_strings: int = MAX_STOP
    max_stop_chars: int = MAX_STOP_CHARS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS

    @classmethod
    def of(cls, config, info) -> InputLimits:
        prompt = config.max_prompt_tokens or info.max_context
        return cls(info=info, max_prompt_tokens=prompt, max_text_chars=CHARS_PER_TOKEN * prompt)

    @property
    def max_detokenize_ids(self) -> int:
        return self.info.max_context

    @property
    def max_message_bytes(self) -> int:
        return 4 * self.max_text_chars + 5 * max(self.max_prompt_tokens, self.max_detokenize_ids) + MESSAGE_SLACK_BYTES

    @property
    def max_method_state_bytes(self) -> int:
        return state_cap_bytes(self.info)

    @property
    def max_session_chunk_bytes(self) -> int:
        return SESSION_CHUNK_BYTES

    @property
    def max_session_artifact_bytes(self) -> int:
        return (dense_kv_bytes(self.info) + 8 * self.info.max_context + self.max_method_state_bytes
                + 4 * self.max_text_chars + MESSAGE_SLACK_BYTES)

    def reported(self) -> dict:
        """The pb.Limits fields these limits fill."""
        return dict(max_text_chars=self.max_text_chars, max_chat_messages=self.max_chat_messages,
                    max_stop_strings=self.max_stop_strings, max_stop_chars=self.max_stop_chars,
                    max_stop_token_ids=self.max_stop_token_ids, max_detokenize_ids=self.max_detokenize_ids,
                    max_message_bytes=self.max_message_bytes, max_method_state_bytes=self.max_method_state_bytes,
                    max_session_chunk_bytes=self.max_session_chunk_bytes,
                    max_session_artifact_bytes=self.max_session_artifact_bytes)

    # ---- checks ------------------------------------------------------------------------------------------
    def _text(self, field: str, text: str) -> None:
        if len(text) > self.max_text_chars:
            raise InvalidArgument(field, f"too long: {len(text)} characters, the limit is {self.max_text_chars} "
                                         f"(ModelInfo.limits.max_text_chars)")

    def _chat(self, field: str, chat: pb.ChatMessages) -> None:
        if len(chat.messages) > self.max_chat_messages:
            raise InvalidArgument(f"{field}.messages", f"at most {self.max_chat_messages} messages, "
                                                       f"got {len(chat.messages)}")
        total = sum(len(m.role) + len(m.content) + len(m.tool_call_id) + len(m.name)
                    + sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls) for m in chat.messages)
        if total > self.max_text_chars:
            raise InvalidArgument(f"{field}.messages", f"too long: {total} characters in all, the limit is "
                                                       f"{self.max_text_chars} (ModelInfo.limits.max_text_chars)")

    def _ids(self, field: str, ids, limit: int) -> None:
        if len(ids) > limit:
            raise InvalidArgument(field, f"at most {limit} token ids, got {len(ids)}")

    def generate(self, message: pb.GenerateRequest) -> None:
        """The sizes of a GenerateRequest's input, stop strings and stop token ids."""
        which = message.WhichOneof("input")
        if which == "text":
            self._text("text", message.text)
        elif which == "token_ids":
            self._ids("token_ids", message.token_ids.ids, self.max_prompt_tokens)
        elif which == "chat":
            self._chat("chat", message.chat)
        for i, s in enumerate(message.stop[:self.max_stop_strings]):
            if len(s) > self.max_stop_chars:
                raise InvalidArgument(f"stop[{i}]", f"at most {self.max_stop_chars} characters, got {len(s)}")
        self._ids("stop_token_ids", message.stop_token_ids, self.max_stop_token_ids)

    def tokenize(self, message: pb.TokenizeRequest) -> None:
        which = message.WhichOneof("input")
        if which == "text":
            self._text("text", message.text)
        elif which == "chat":
            self._chat("chat", message.chat)

    def detokenize(self, message: pb.DetokenizeRequest) -> None:
        self._ids("token_ids", message.token_ids, self.max_detokenize_ids)
