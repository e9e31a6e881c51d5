"""The HTTP API as a Starlette app: OpenAI's chat and text completions, Anthropic's Messages API,
the model list, health and Prometheus metrics.

Starlette routes requests, checks API keys (with the backend here), runs blocking work on its
thread pool, streams server-sent events and notices a streaming client that hangs up; uvicorn
(`http_server`) speaks HTTP and frames bodies by their Content-Length. Written here: each API's
error shapes, the body's bound (413) and read timeout (408), and the bridge from the engine's
thread to the event loop.

A request is parsed and tokenized on a worker thread (the engine may hold the tokenizer's lock) and
refused, if it must be, before any byte of its answer, streamed or not. A client that hangs up,
streaming or not, queued or generating, cancels its job; the engine stops it at its next cycle.
"""

import asyncio
import functools
import json
import threading
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Optional, Union

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, SimpleUser
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import messages_api, openai_api, responses_api
from ..errors import DFlashError
from .requests import count_tokens, parse_messages, parse_request, parse_responses
from .api_errors import APIError
from .worker import Engine, Job
from .reasoning import AnswerParts
from .tools import ToolError

MAX_BODY = 4 * 1024 * 1024
# Seconds a client may stay silent while its body is read (one shorter than its Content-Length):
# it is answered 408. uvicorn closes a keep-alive connection idle this long.
READ_TIMEOUT_S = 30
OPEN_PATHS = ("/health", "/metrics")  # served without an API key
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# Refusals sent before the body was read whole: the connection cannot carry another request.
CLOSING = (408, 411, 413)


@dataclass
class Settings:
    """What the app serves, read at each request: the worker and the registry of its metrics (`metrics`)."""
    engine: Engine
    registry: CollectorRegistry
    api_key: Optional[str] = None
    read_timeout_s: float = READ_TIMEOUT_S


def create_app(settings: Settings) -> Starlette:
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", functools.partial(generate, api="chat"), methods=["POST"]),
        Route("/v1/completions", functools.partial(generate, api="completions"), methods=["POST"]),
        Route("/v1/messages", functools.partial(generate, api="messages"), methods=["POST"]),
        Route("/v1/messages/count_tokens", messages_count_tokens, methods=["POST"]),
        Route("/v1/responses", functools.partial(generate, api="responses"), methods=["POST"]),
    ]
    auth = Middleware(AuthenticationMiddleware, backend=_APIKey(settings), on_error=_unauthorised)
    app = Starlette(routes=routes, middleware=[auth],
                    exception_handlers={HTTPException: _http_error, Exception: _crashed})
    app.state.settings = settings
    return app


class _JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()  # as json.dumps writes it (a -inf log probability included)


def _anthropic(conn: HTTPConnection) -> bool:
    return conn.scope["path"].startswith("/v1/messages")


def _error(e: APIError, anthropic: bool) -> Response:
    """An error in the shape of its API: OpenAI's, or Anthropic's `{"type": "error", ...}`."""
    return _JSON(_error_body(e, anthropic), e.status, headers={"Connection": "close"} if e.status in CLOSING else None)


def _error_body(e: APIError, anthropic: bool) -> dict:
    return e.anthropic_body() if anthropic else e.body()


def _refused(conn: HTTPConnection, e: APIError) -> Response:
    """A request refused before it reached the engine: counted (`/metrics`), then answered."""
    engine = conn.app.state.settings.engine
    if e.status >= 500:
        engine.stats["failed"] += 1
    else:
        engine.refused(e.status)
    return _error(e, _anthropic(conn))


def _refusal(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, (DFlashError, ToolError)):
        return APIError(400, str(e))
    # A bug, not the client's fault: still an answer, not a dropped connection.
    return APIError(500, f"The request could not be handled: {e}", "server_error")


def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no route, a method a route does not take)."""
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    if exc.status_code == 404:
        e = APIError(404, f"No route {path}.", code="not_found")
    elif exc.status_code == 405:
        e = APIError(405, f"{request.method} is not allowed on {request.url.path}.")
    else:
        e = APIError(exc.status_code, exc.detail)
    response = _refused(request, e)
    response.headers.update(exc.headers or {})
    return response


def _crashed(request: Request, exc: Exception) -> Response:
    """A bug: still an answer in the API's shape (uvicorn logs the traceback)."""
    return _refused(request, APIError(500, f"The request could not be handled: {exc}", "server_error"))


class _APIKey(AuthenticationBackend):
    """`Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`, where the server has a key."""

    def __init__(self, settings: Settings):
        self.settings = settings

    async def authenticate(self, conn: HTTPConnection):
        key = self.settings.api_key
        if not key or conn.scope["path"] in OPEN_PATHS:
            return None
        if conn.headers.get("authorization") == f"Bearer {key}" or conn.headers.get("x-api-key") == key:
            return AuthCredentials(["api"]), SimpleUser("client")
        raise AuthenticationError("Invalid or missing API key; send 'Authorization: Bearer <key>'.")


def _unauthorised(conn: HTTPConnection, exc: AuthenticationError) -> Response:
    return _refused(conn, APIError(401, str(exc), "authentication_error", code="invalid_api_key"))


async def health(request: Request) -> Response:
    engine = request.app.state.settings.engine
    pc = engine.prompt_cache
    cache = {} if pc is None else {"prompt_cache": {"entries": len(pc), "bytes": pc.nbytes, "hits": pc.hits,
                                                    "misses": pc.misses, "cached_tokens": pc.cached_tokens}}
    if pc is not None and pc.disk is not None:
        cache["prompt_cache"]["disk"] = {"entries": len(pc.disk), "bytes": pc.disk.nbytes, "hits": pc.disk.hits,
                                         "folder": str(pc.disk.folder)}
    return _JSON({"status": "ok", **engine.stats, "queued": engine.queued(), **cache})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.settings.registry), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> Response:
    model = request.app.state.settings.engine.model_id
    return _JSON({"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "dflash-mlx"}]})


async def _read_json(request: Request) -> Any:
    """The request's JSON body; APIError if it is chunked, too long, does not arrive in time or is not JSON."""
    length = request.headers.get("content-length")  # uvicorn has checked that it is a number
    if length is None and "transfer-encoding" in request.headers:
        raise APIError(411, "Send the request body with a Content-Length header, not chunked.")
    if length is not None and int(length) > MAX_BODY:
        raise APIError(413, f"The request body is over {MAX_BODY} bytes.")
    try:
        return json.loads(await _read(request, length) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}.")
    except RecursionError:
        raise APIError(400, "The request body nests objects and arrays too deep to read; flatten it.")


async def _read(request: Request, length: Optional[str]) -> bytes:
    """The body, each part within the read timeout of the one before (a client that stalls: 408)."""
    timeout = request.app.state.settings.read_timeout_s
    parts, stream = [], request.stream()
    try:
        while True:
            parts.append(await asyncio.wait_for(anext(stream), timeout))
    except StopAsyncIteration:
        return b"".join(parts)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout:g} s "
                            f"(Content-Length {length}); send all of it.")
    finally:
        await stream.aclose()


async def messages_count_tokens(request: Request) -> Response:
    """Anthropic's token count: the prompt a Messages request would run, in tokens."""
    engine = request.app.state.settings.engine
    try:
        body = await _read_json(request)
        n = await run_in_threadpool(count_tokens, engine, body)
    except ClientDisconnect:
        return Response()  # no one to answer
    except Exception as e:
        return _refused(request, _refusal(e))
    return _JSON({"input_tokens": n})


async def generate(request: Request, api: str) -> Response:
    """`api`: "chat", "completions", "messages" (Anthropic's) or "responses"."""
    engine = request.app.state.settings.engine
    parse = {"messages": parse_messages, "responses": parse_responses}.get(
        api, functools.partial(parse_request, chat=api == "chat"))
    try:
        body = await _read_json(request)
        job, stream = await run_in_threadpool(parse, engine, body)
    except ClientDisconnect:
        return Response()  # no one to answer
    except Exception as e:
        return _refused(request, _refusal(e))
    engine.submit(job)
    events = JobEvents(job)
    if stream:
        frames = (_message_events(engine, job, events) if api == "messages"
                  else _response_events(engine, job, events, body) if api == "responses"
                  else _chunk_events(engine, job, events, api == "chat"))
        return StreamingResponse(frames, headers=SSE_HEADERS, background=BackgroundTask(events.close))
    answer = (_message(engine, job, events) if api == "messages"
              else _response(engine, job, events, body) if api == "responses"
              else _completion(engine, job, events, api == "chat"))
    return await _unless_client_leaves(request, answer)


class JobEvents:
    """A job's events on the event loop, up to its last one (the final event, an error, or the end).

    The engine puts them on the job's `queue.Queue`, whose `get` blocks: a thread per job forwards
    them to the loop. A reader that stops before the last one (its client hung up) cancels the job.
    """

    def __init__(self, job: Job):
        self.job, self.done = job, False
        self._events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._forward, args=(loop,), daemon=True, name="dflash-events").start()

    def _forward(self, loop) -> None:
        while True:
            event = self.job.events.get()
            try:
                loop.call_soon_threadsafe(self._events.put_nowait, event)
            except RuntimeError:  # the loop has closed (the server stopped): drain the job all the same
                pass
            if event is None:
                self.job.ended = True
                return

    async def stream(self) -> AsyncIterator[Any]:
        try:
            while not self.done:
                event = await self._events.get()
                # The answer is whole at its final event: the engine may still be keeping its caches.
                self.done = event is None or isinstance(event, APIError) or event.finish_reason is not None
                if event is not None:
                    yield event
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the job unless its answer is whole."""
        if not self.done:
            self.job.cancelled.set()


async def _unless_client_leaves(request: Request, answer: Awaitable[Response]) -> Response:
    """`answer`, unless the client hangs up first: then it is cancelled, and with it its job."""
    work = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(_hang_up(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        work.cancel()  # nothing, once it is done
    return work.result() if work.done() else Response()


async def _hang_up(request: Request) -> None:
    """Returns when the client disconnects (its body has been read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _off_loop(job: Job, fn, *args):
    """fn(*args), on a worker thread where it may wait for the tokenizer (tool calls, log probabilities)."""
    if job.tools or job.logprobs is not None:
        return await run_in_threadpool(fn, *args)
    return fn(*args)


def _data(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _named(events) -> bytes:
    return "".join(f"event: {name}\ndata: {json.dumps(obj)}\n\n" for name, obj in events).encode()


async def _gathered(events: JobEvents) -> Union[openai_api.Answer, APIError]:
    """A whole answer from its events, or the error that ended it."""
    answer = openai_api.Answer()
    async for event in events.stream():
        if isinstance(event, APIError):
            return event
        answer.add(event)
    return answer


async def _completion(engine: Engine, job: Job, events: JobEvents, chat: bool) -> Response:
    answer = await _gathered(events)
    if isinstance(answer, APIError):
        return _JSON(answer.body(), answer.status)
    body = await _off_loop(job, openai_api.completion, engine.model_id, job, chat, answer, engine.tokenizer)
    return _JSON(body)


async def _chunk_events(engine: Engine, job: Job, events: JobEvents, chat: bool) -> AsyncIterator[bytes]:
    """OpenAI's stream: `data: <chunk>` per event, then `data: [DONE]`."""
    chunks = await _off_loop(job, openai_api.Chunks, engine.model_id, job, chat, engine.tokenizer)
    for obj in chunks.start():
        yield _data(obj)
    async with aclosing(events.stream()) as stream:
        async for event in stream:
            if isinstance(event, APIError):  # the answer cannot go on: its finish reason says so, then why
                yield _data(chunks.failed())
                yield _data(event.body())
                break
            for obj in await _off_loop(job, chunks.feed, event):
                yield _data(obj)
    yield b"data: [DONE]\n\n"


async def _message(engine: Engine, job: Job, events: JobEvents) -> Response:
    answer = await _gathered(events)
    if isinstance(answer, APIError):
        return _error(answer, True)

    def whole():
        thinking, content, calls = AnswerParts(engine.tokenizer, job).feed(answer.text, final=True,
                                                                           cut=answer.finish == "length")
        stop = answer.stats.stop_sequence if answer.stats else None
        return messages_api.message(engine.model_id, content, calls, answer.finish, stop, answer.stats, thinking)

    return _JSON(await _off_loop(job, whole))


async def _message_events(engine: Engine, job: Job, events: JobEvents) -> AsyncIterator[bytes]:
    """Anthropic's stream: `event: <name>` and `data: <object>` from message_start to message_stop."""
    out = messages_api.EventStream(engine.model_id)
    parts = await _off_loop(job, AnswerParts, engine.tokenizer, job)

    def step(event, first: bool):
        final = event.finish_reason is not None
        thinking, text, calls = parts.feed(event.text, final=final, cut=event.finish_reason == "length")
        named = list(out.start(event.stats)) if first else []
        named += out.thinking(thinking)
        named += out.text(text)
        for call in calls:
            named += out.call(call)
        if final:
            named += out.end(event.finish_reason, event.stats.stop_sequence, event.stats)
        return _named(named)

    first = True  # message_start waits for the prompt to be read: its usage counts the prompt
    async with aclosing(events.stream()) as stream:
        async for event in stream:
            if isinstance(event, APIError):
                yield _named([("error", _error_body(event, True))])
                return
            yield await _off_loop(job, step, event, first)
            first = False


async def _response(engine: Engine, job: Job, events: JobEvents, body: dict) -> Response:
    answer = await _gathered(events)
    if isinstance(answer, APIError):
        return _JSON(answer.body(), answer.status)

    def whole():
        reasoning, text, calls = AnswerParts(engine.tokenizer, job).feed(answer.text, final=True,
                                                                         cut=answer.finish == "length")
        return responses_api.ResponseEvents(engine.model_id, body).whole(text, calls, answer.finish, answer.stats,
                                                                         reasoning)

    return _JSON(await _off_loop(job, whole))


async def _response_events(engine: Engine, job: Job, events: JobEvents, body: dict) -> AsyncIterator[bytes]:
    """The Responses API's stream: `event: <type>` and `data: <object>`, from response.created to
    response.completed (or .incomplete, or .failed): never a stream without its end."""
    out = responses_api.ResponseEvents(engine.model_id, body)
    parts = await _off_loop(job, AnswerParts, engine.tokenizer, job)

    def step(event):
        final = event.finish_reason is not None
        reasoning, text, calls = parts.feed(event.text, final=final, cut=event.finish_reason == "length")
        named = list(out.add_reasoning(reasoning))
        named += out.add_text(text)
        for call in calls:
            named += out.add_call(call)
        if final:
            named += out.end(event.finish_reason, event.stats)
        return _named(named)

    yield _named(out.start())
    async with aclosing(events.stream()) as stream:
        async for event in stream:
            if isinstance(event, APIError):
                yield _named(out.failed(event))
                return
            yield await _off_loop(job, step, event)
