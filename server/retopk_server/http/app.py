"""The OpenAI-compatible routes (one APIRouter), answered through the same Gateway as the gRPC servicer
(service/gateway.py): the same key check, affinity check, validation, limits and metrics.

    POST /v1/completions        prompt -> text (streaming as server-sent events with ``stream: true``)
    POST /v1/chat/completions   messages -> the assistant's reply (streaming likewise)
    GET  /v1/models             the served model (GET /v1/models/{id}: that one, or 404)
    GET  /health                readiness: 200 while gRPC health says SERVING for retopk.v1.ReTopKService
                                (model loaded, engine alive, not draining), else 503; no key needed

Every /v1 route needs ``Authorization: Bearer <key>`` when the server has a key; the headers ``authorization``
and ``x-session-id`` are what gRPC's metadata of those names is. HTTP has no deadline (a client that goes away
cancels the request instead).
A body is read up to ``body_bytes`` (413 beyond), parsed as strict JSON (NaN / Infinity refused) and
validated by ``schemas``; every refusal is an OpenAI error object with a 4xx status naming the field.
A streamed request answers its errors as JSON with the matching status until the first token (prefill
included); an error after it arrives as a last ``data: {"error": ...}`` event. A client that goes away
cancels its request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.http import openai_bodies
from retopk_server.http.errors import ApiError, from_call_error
from retopk_server.http.schemas import ChatCompletionRequest, CompletionRequest
from retopk_server.service.auth import Caller, Unauthenticated
from retopk_server.service.gateway import Call, CallError, Gateway, Generation, Metadata
from retopk_server.service.health import Health
from retopk_shared.metadata import AUTHORIZATION, SESSION_METADATA

log = logging.getLogger("retopk_server.http")

JSON_EXPANSION = 3  # JSON may escape a character in 12 bytes ("\ud83d\ude00") where the gRPC message's UTF-8 takes 4
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> dict:
    """The request's body as a JSON object; 413 past ``limit`` bytes (read no further), 400 if not JSON."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and (len(length) > 18 or int(length) > limit):  # no int() of a 5000-digit header
        raise ApiError("RESOURCE_EXHAUSTED", f"body: Content-Length {length[:20]} bytes, the limit is {limit}", "body",
                       http_status=413)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise ApiError("RESOURCE_EXHAUSTED", f"body: over {limit} bytes, the limit", "body", http_status=413)
        parts.append(part)
    raw = b"".join(parts)
    if not raw.strip():
        raise ApiError("INVALID_ARGUMENT", "body: empty; send a JSON object", "body")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ApiError("INVALID_ARGUMENT", f"body: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                       "body") from None
    except (ValueError, RecursionError) as e:  # bad UTF-8, NaN, an int of too many digits, deep nesting
        raise ApiError("INVALID_ARGUMENT", f"body: not valid JSON: {e}", "body") from None
    if not isinstance(body, dict):
        raise ApiError("INVALID_ARGUMENT", f"body: must be a JSON object, got {type(body).__name__}", "body")
    try:  # "\ud800" parses to a lone surrogate, which no string field can hold
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError("INVALID_ARGUMENT", "body: holds a lone UTF-16 surrogate escape (not Unicode text)",
                       "body") from None
    return body


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so a client that goes away cancels its
    request in the engine at once (not when the iterator is garbage collected)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, awaitable):
    """Await ``awaitable``; cancel it (CANCELLED) if the client disconnects first. Returns only once it has
    ended either way, so that the generator it was reading may be closed."""
    task, watcher = asyncio.ensure_future(awaitable), asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # no-op once done
        await asyncio.wait({task, watcher})
    if task.cancelled():
        raise ApiError("CANCELLED", "the client went away")
    return task.result()


def body_bytes(max_message_bytes: int) -> int:
    """The largest body the front reads: the gRPC front's receive limit (service/limits.py's max_message_bytes,
    ModelInfo.limits.max_message_bytes) times JSON_EXPANSION, so that a request gRPC takes fits as JSON too."""
    return JSON_EXPANSION * max_message_bytes


def metadata_of(request: Request) -> Metadata:
    """The request's headers that carry what gRPC's metadata of the same names does."""
    return tuple((name, value) for name, value in request.headers.items() if name in (AUTHORIZATION, SESSION_METADATA))


class Served:
    """What the routes answer with, one per app (``app.state.served``): the server's Gateway (engine started), its
    Health, the body limit and the time the app was made (the models' ``created``)."""

    def __init__(self, gateway: Gateway, health: Health, max_body_bytes: int) -> None:
        self.gateway, self.health, self.max_body_bytes = gateway, health, max_body_bytes
        self.created = int(time.time())

    def authenticate(self, metadata: Metadata) -> Caller:
        """The gateway's key check, first: a caller without a key learns nothing from its body's checks."""
        try:
            return self.gateway.authenticate(metadata)
        except Unauthenticated:  # HTTP's wording of a missing key (the header), not gRPC's (metadata)
            raise ApiError("UNAUTHENTICATED", "missing or wrong API key: send the header "
                                              "'Authorization: Bearer <key>'") from None

    def model_info(self, request: Request) -> pb.ModelInfo:
        call = self.gateway.call("GetModelInfo")
        try:
            self.authenticate(metadata_of(request))
            return self.gateway.model_info()
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            raise from_call_error(call.stopped(exc)) from None
        finally:
            call.end()

    def model_card(self, info: pb.ModelInfo) -> dict:
        return {"id": info.name, "object": "model", "created": self.created, "owned_by": "retopk",
                "max_model_len": info.max_context}

    async def start(self, request: Request, schema):
        """Check, parse and submit a request -> (body, its Generation, the first response, the renamer)."""
        call: Call = self.gateway.call("Generate")
        rename = None
        try:
            metadata = metadata_of(request)
            caller = self.authenticate(metadata)
            try:
                raw = openai_bodies.drop_neutral(await read_json(request, self.max_body_bytes),
                                                 schema is ChatCompletionRequest)
                body = schema.model_validate(raw)
            except ValidationError as e:
                raise openai_bodies.validation_error(e) from None
            info = self.gateway.engine.info
            if body.model != info.name:
                raise ApiError("NOT_FOUND", f"model: the model {body.model!r} does not exist; this server serves "
                                            f"{info.name!r} (GET /v1/models)", "model")
            message = openai_bodies.generate_message(body, info.vocab_size, self.gateway.config.max_new_tokens)
            rename = openai_bodies.field_renamer(body)
            if body.user is not None:
                log.debug("request from user %r", body.user[:64])
            generation = await self.gateway.generate(call, caller, message, metadata, deadline=None)
        except BaseException as exc:  # refused before the engine took it, or the client went away meanwhile
            if (error := call.stopped(exc)) is None:
                raise
            raise from_call_error(error, rename) from None
        try:
            first = await _unless_disconnected(request, anext(generation))
        except CallError as error:
            generation.close()
            raise from_call_error(error, rename) from None
        except BaseException:
            generation.close()
            raise
        return body, generation, first, rename


def served_of(request: Request) -> Served:
    return request.app.state.served


ServedDep = Annotated[Served, Depends(served_of)]  # a route's parameter: this app's Served


async def rest(generation: Generation, rename) -> list[pb.GenerateResponse]:
    try:
        return [r async for r in generation]
    except CallError as error:
        raise from_call_error(error, rename) from None
    finally:
        generation.close()


def sse_stream(body, generation: Generation, first, rename, envelope: dict, chunks):
    """The server-sent events of a streamed request: ``chunks(response, opening)`` yields the chunks of one
    GenerateResponse; with include_usage every chunk has ``usage: null`` and a last one the usage."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    async def events():
        finals, seen = [], set()  # the last response of each finished choice; the choices begun
        try:
            response = first
            while True:
                for chunk in chunks(response, response.index not in seen):
                    yield _sse({**chunk, "usage": None} if include_usage else chunk)
                seen.add(response.index)
                if response.finish_reason:
                    finals.append(response)
                try:
                    response = await anext(generation)
                except StopAsyncIteration:
                    break
        except CallError as error:  # after the first token: the status line is long sent
            yield _sse(from_call_error(error, rename).body())
        else:
            if include_usage:
                yield _sse({**envelope, "choices": [], "usage": openai_bodies.usage(*finals)})
        finally:
            generation.close()
        yield "data: [DONE]\n\n"

    return _ClosingStream(events(), media_type="text/event-stream", headers=SSE_HEADERS)


router = APIRouter()


@router.get("/health")
async def health(served: ServedDep):
    serving = served.health.serving()  # readiness, as gRPC health answers it for retopk.v1.ReTopKService
    return JSONResponse({"status": "ok" if serving else "unavailable"}, status_code=200 if serving else 503)


@router.get("/v1/models")
async def list_models(request: Request, served: ServedDep):
    return {"object": "list", "data": [served.model_card(served.model_info(request))]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request, served: ServedDep):
    info = served.model_info(request)
    if model != info.name:
        raise ApiError("NOT_FOUND", f"model: the model {model!r} does not exist; this server serves "
                                    f"{info.name!r}", "model")
    return served.model_card(info)


@router.post("/v1/completions")
async def completions(request: Request, served: ServedDep):
    body, generation, first, rename = await served.start(request, CompletionRequest)
    envelope = openai_bodies.envelope("text_completion", first.request_id, body.model)

    offsets: dict[int, openai_bodies.CompletionLogprobs] = {}  # per choice: its tokens' text offsets

    def choice(r: pb.GenerateResponse) -> dict:
        lp = offsets.setdefault(r.index, openai_bodies.CompletionLogprobs()).of(r)
        return {"index": r.index, "text": r.text, "logprobs": lp, "finish_reason": openai_bodies.finish_reason(r)}

    if body.stream:
        def chunks(r: pb.GenerateResponse, opening: bool):
            if r.text or r.logprobs or r.finish_reason:
                yield {**envelope, "choices": [choice(r)]}

        return sse_stream(body, generation, first, rename, envelope, chunks)
    responses = [first, *await _unless_disconnected(request, rest(generation, rename))]
    choices = []
    for group in openai_bodies.by_choice(responses):
        merged, logprobs = None, openai_bodies.CompletionLogprobs()
        for r in group:
            merged = openai_bodies.merge_logprobs(merged, logprobs.of(r))
        choices.append({"index": group[0].index, "text": "".join(r.text for r in group), "logprobs": merged,
                        "finish_reason": openai_bodies.finish_reason(group[-1])})
    finals = [r for r in responses if r.finish_reason]
    return {**envelope, "choices": choices, "usage": openai_bodies.usage(*finals)}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, served: ServedDep):
    body, generation, first, rename = await served.start(request, ChatCompletionRequest)
    if body.stream:
        envelope = openai_bodies.envelope("chat.completion.chunk", first.request_id, body.model)

        def chunks(r: pb.GenerateResponse, opening: bool):
            if opening:
                yield {**envelope, "choices": [{"index": r.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}
            if r.text or r.logprobs or r.finish_reason or r.tool_calls:
                delta = {"content": r.text} if r.text else {}
                if calls := openai_bodies.tool_call_deltas(r):
                    delta["tool_calls"] = calls
                yield {**envelope, "choices": [{"index": r.index, "delta": delta,
                                                "logprobs": openai_bodies.chat_logprobs(r),
                                                "finish_reason": openai_bodies.finish_reason(r)}]}

        return sse_stream(body, generation, first, rename, envelope, chunks)
    envelope = openai_bodies.envelope("chat.completion", first.request_id, body.model)
    responses = [first, *await _unless_disconnected(request, rest(generation, rename))]
    choices = []
    for group in openai_bodies.by_choice(responses):
        merged = None
        for r in group:
            merged = openai_bodies.merge_logprobs(merged, openai_bodies.chat_logprobs(r))
        message = {"role": "assistant", "content": "".join(r.text for r in group)}
        if calls := openai_bodies.whole_tool_calls(group):
            message["tool_calls"] = calls
            message["content"] = message["content"] or None
        choices.append({"index": group[0].index, "message": message, "logprobs": merged,
                        "finish_reason": openai_bodies.finish_reason(group[-1])})
    finals = [r for r in responses if r.finish_reason]
    return {**envelope, "choices": choices, "usage": openai_bodies.usage(*finals)}


async def api_error(request: Request, exc: ApiError):
    return exc.response()


async def http_error(request: Request, exc: HTTPException):
    code = {404: "NOT_FOUND", 405: "INVALID_ARGUMENT"}.get(exc.status_code, "INVALID_ARGUMENT")
    response = ApiError(code, f"{request.method} {request.url.path}: {exc.detail}").response()
    response.status_code = exc.status_code
    response.headers.update(exc.headers or {})  # 405's Allow
    return response


async def internal_error(request: Request, exc: Exception):  # a bug of ours, never the client's input
    log.error("internal error answering %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError("INTERNAL", f"internal error: {type(exc).__name__}").response()


def create_app(gateway: Gateway, health: Health, max_body_bytes: int | None = None) -> FastAPI:
    """The ASGI app of one server: ``gateway`` its Gateway (engine started), ``health`` its Health;
    ``max_body_bytes`` defaults to ``body_bytes`` of the gateway's limits."""
    if max_body_bytes is None:
        max_body_bytes = body_bytes(gateway.limits.max_message_bytes)
    app = FastAPI(title="retopk (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = Served(gateway, health, max_body_bytes)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.include_router(router)
    return app
