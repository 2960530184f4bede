"""The OpenAI-compatible routes (one APIRouter), answered by the gRPC servicer's own methods (see
``context.HttpContext``).

    POST /v1/completions        prompt -> text (streaming as server-sent events with ``stream: true``)
    POST /v1/chat/completions   messages -> the assistant's reply (streaming likewise)
    GET  /v1/models             the served model (GET /v1/models/{id}: that one, or 404)
    GET  /health                readiness: 200 while gRPC health says SERVING for retopk.v1.ReTopKService
                                (model loaded, engine alive, not draining), else 503; no key needed

Every /v1 route needs ``Authorization: Bearer <key>`` when the server has a key, checked by the servicer.
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
from grpc_health.v1 import health_pb2
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.http import convert
from retopk_server.http.context import Aborted, HttpContext
from retopk_server.http.errors import ApiError, from_status
from retopk_server.http.schemas import ChatCompletionRequest, CompletionRequest
from retopk_server.service.auth import Unauthenticated
from retopk_server.service.supervision import READINESS

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


class Served:
    """What the routes answer with, one per app (``app.state.served``): the server's ReTopKServicer (engine
    started), its grpc health servicer, the body limit and the time the app was made (the models' ``created``)."""

    def __init__(self, servicer, health_servicer, max_body_bytes: int) -> None:
        self.servicer, self.health_servicer, self.max_body_bytes = servicer, health_servicer, max_body_bytes
        self.created = int(time.time())

    def hook(self, name: str, *args) -> None:
        try:
            getattr(self.servicer.observer, name)(*args)
        except Exception:
            log.exception("observer hook %s failed", name)

    def refused(self, error: ApiError, t0: float) -> None:
        """Metrics of a Generate the HTTP front refused before the servicer saw it (as the servicer counts)."""
        self.hook("on_error", None, error.code)
        self.hook("on_rpc", "Generate", error.code, time.monotonic() - t0)

    def authenticate(self, context: HttpContext) -> None:
        """The servicer's key check, first: a caller without a key learns nothing from its body's checks."""
        try:
            self.servicer.authenticate(context)
        except Unauthenticated:
            raise ApiError("UNAUTHENTICATED", "missing or wrong API key: send the header "
                                              "'Authorization: Bearer <key>'") from None

    async def model_info(self, request: Request) -> pb.ModelInfo:
        context = HttpContext(request.headers, request.client)
        self.authenticate(context)  # HTTP's wording of a missing key (the header), not gRPC's (metadata)
        try:
            return await self.servicer.GetModelInfo(pb.GetModelInfoRequest(), context)
        except Aborted as a:
            raise from_status(a.code, a.message) from None

    def model_card(self, info: pb.ModelInfo) -> dict:
        return {"id": info.name, "object": "model", "created": self.created, "owned_by": "retopk",
                "max_model_len": info.max_context}

    async def start(self, request: Request, schema):
        """Check, parse and submit a request -> (body, its Generate stream, the first response, the renamer)."""
        t0 = time.monotonic()
        context = HttpContext(request.headers, request.client)
        servicer = self.servicer
        try:
            self.authenticate(context)
            try:
                raw = convert.drop_neutral(await read_json(request, self.max_body_bytes),
                                           schema is ChatCompletionRequest)
                body = schema.model_validate(raw)
            except ValidationError as e:
                raise convert.validation_error(e) from None
            info = servicer.engine.info
            if body.model != info.name:
                raise ApiError("NOT_FOUND", f"model: the model {body.model!r} does not exist; this server serves "
                                            f"{info.name!r} (GET /v1/models)", "model")
            message = convert.generate_message(body, info.vocab_size, servicer.config.max_new_tokens)
        except ApiError as e:
            self.refused(e, t0)
            raise
        if body.user is not None:
            log.debug("request from user %r", body.user[:64])
        rename = convert.field_renamer(body)
        stream = servicer.Generate(message, context)
        try:
            first = await _unless_disconnected(request, anext(stream))
        except Aborted as a:
            raise from_status(a.code, a.message, rename) from None
        except BaseException:
            await stream.aclose()
            raise
        return body, stream, first, rename


def served_of(request: Request) -> Served:
    return request.app.state.served


ServedDep = Annotated[Served, Depends(served_of)]  # a route's parameter: this app's Served


async def rest(stream, rename) -> list[pb.GenerateResponse]:
    try:
        return [r async for r in stream]
    except Aborted as a:
        raise from_status(a.code, a.message, rename) from None
    finally:
        await stream.aclose()


def sse_stream(body, stream, first, rename, envelope: dict, chunks):
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
                    response = await anext(stream)
                except StopAsyncIteration:
                    break
        except Aborted as a:  # after the first token: the status line is long sent
            yield _sse(from_status(a.code, a.message, rename).body())
        else:
            if include_usage:
                yield _sse({**envelope, "choices": [], "usage": convert.usage(*finals)})
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"

    return _ClosingStream(events(), media_type="text/event-stream", headers=SSE_HEADERS)


router = APIRouter()


@router.get("/health")
async def health(request: Request, served: ServedDep):
    try:
        answer = await served.health_servicer.Check(health_pb2.HealthCheckRequest(service=READINESS),
                                                    HttpContext(request.headers, request.client))
        serving = answer.status == health_pb2.HealthCheckResponse.SERVING
    except Aborted:
        serving = False
    return JSONResponse({"status": "ok" if serving else "unavailable"}, status_code=200 if serving else 503)


@router.get("/v1/models")
async def list_models(request: Request, served: ServedDep):
    return {"object": "list", "data": [served.model_card(await served.model_info(request))]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request, served: ServedDep):
    info = await served.model_info(request)
    if model != info.name:
        raise ApiError("NOT_FOUND", f"model: the model {model!r} does not exist; this server serves "
                                    f"{info.name!r}", "model")
    return served.model_card(info)


@router.post("/v1/completions")
async def completions(request: Request, served: ServedDep):
    body, stream, first, rename = await served.start(request, CompletionRequest)
    envelope = convert.envelope("text_completion", first.request_id, body.model)

    offsets: dict[int, convert.CompletionLogprobs] = {}  # per choice: its tokens' text offsets

    def choice(r: pb.GenerateResponse) -> dict:
        lp = offsets.setdefault(r.index, convert.CompletionLogprobs()).of(r)
        return {"index": r.index, "text": r.text, "logprobs": lp, "finish_reason": convert.finish_reason(r)}

    if body.stream:
        def chunks(r: pb.GenerateResponse, opening: bool):
            if r.text or r.logprobs or r.finish_reason:
                yield {**envelope, "choices": [choice(r)]}

        return sse_stream(body, stream, first, rename, envelope, chunks)
    responses = [first, *await _unless_disconnected(request, rest(stream, rename))]
    choices = []
    for group in convert.by_choice(responses):
        merged, logprobs = None, convert.CompletionLogprobs()
        for r in group:
            merged = convert.merge_logprobs(merged, logprobs.of(r))
        choices.append({"index": group[0].index, "text": "".join(r.text for r in group), "logprobs": merged,
                        "finish_reason": convert.finish_reason(group[-1])})
    finals = [r for r in responses if r.finish_reason]
    return {**envelope, "choices": choices, "usage": convert.usage(*finals)}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, served: ServedDep):
    body, stream, first, rename = await served.start(request, ChatCompletionRequest)
    if body.stream:
        envelope = convert.envelope("chat.completion.chunk", first.request_id, body.model)

        def chunks(r: pb.GenerateResponse, opening: bool):
            if opening:
                yield {**envelope, "choices": [{"index": r.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}
            if r.text or r.logprobs or r.finish_reason or r.tool_calls:
                delta = {"content": r.text} if r.text else {}
                if calls := convert.tool_call_deltas(r):
                    delta["tool_calls"] = calls
                yield {**envelope, "choices": [{"index": r.index, "delta": delta,
                                                "logprobs": convert.chat_logprobs(r),
                                                "finish_reason": convert.finish_reason(r)}]}

        return sse_stream(body, stream, first, rename, envelope, chunks)
    envelope = convert.envelope("chat.completion", first.request_id, body.model)
    responses = [first, *await _unless_disconnected(request, rest(stream, rename))]
    choices = []
    for group in convert.by_choice(responses):
        merged = None
        for r in group:
            merged = convert.merge_logprobs(merged, convert.chat_logprobs(r))
        message = {"role": "assistant", "content": "".join(r.text for r in group)}
        if calls := convert.whole_tool_calls(group):
            message["tool_calls"] = calls
            message["content"] = message["content"] or None
        choices.append({"index": group[0].index, "message": message, "logprobs": merged,
                        "finish_reason": convert.finish_reason(group[-1])})
    finals = [r for r in responses if r.finish_reason]
    return {**envelope, "choices": choices, "usage": convert.usage(*finals)}


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


def create_app(servicer, health_servicer, max_body_bytes: int | None = None) -> FastAPI:
    """The ASGI app of one server: ``servicer`` its ReTopKServicer (engine started), ``health_servicer`` its grpc
    health; ``max_body_bytes`` defaults to ``body_bytes`` of the servicer's limits."""
    if max_body_bytes is None:
        max_body_bytes = body_bytes(servicer.limits.max_message_bytes)
    app = FastAPI(title="retopk (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = Served(servicer, health_servicer, max_body_bytes)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.include_router(router)
    return app
