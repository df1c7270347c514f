"""`npuc serve MODEL.om`: an OpenAI-compatible HTTP server over a model's slots.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (the chat template of the
tokenizer stored in the .om), `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus text format). Built on Starlette and uvicorn (`pip install 'npuc[serve]'`);
the runtime core does not import this module.

One thread owns the session: it runs the scheduler (apps/scheduler.py) and nothing
else touches the model. Each loop it takes new requests and cancellations, runs one
step (admissions, then one decode step of every active slot) and hands each token to its
request's asyncio queue. The HTTP side validates a request fully before it reaches the
model (an OpenAI-style JSON error with a 4xx status otherwise), answers 429 with
Retry-After when `--max-queue` requests already wait for a slot, and cancels a request
whose client disconnects (its slot is free at the next step). On SIGTERM uvicorn stops
accepting connections and lets the requests in flight finish (streams included) before
the scheduler stops; new requests meanwhile get 503.

Greedy only: `temperature` must be 0 (or absent). Every choice carries `token_ids`, so a
model compiled without a tokenizer is served too; `text` is there when one is stored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from npuc.apps.generate import check_prompt, load_tokenizer_object, tokenizer_functions, tokenizer_section
from npuc.apps.scheduler import Event, Scheduler
from npuc.errors import NpucError

log = logging.getLogger("npuc.serve")

DEFAULT_MAX_TOKENS = 16
COMPLETION_FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "ignore_eos",
                               "user", "seed", "stream_options"})
CHAT_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
                         "stream", "ignore_eos", "user", "seed", "stream_options"})
# Latency histogram bounds, seconds (Prometheus `le` buckets).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RequestError(Exception):
    """A bad request: an OpenAI-style error body with this status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


# -- metrics ---------------------------------------------------------------------------------------

class Histogram:
    def __init__(self, name: str, help_: str) -> None:
        self.name, self.help = name, help_
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.lock = threading.Lock()

    def observe(self, v: float) -> None:
        with self.lock:
            self.sum += v
            self.counts[next((i for i, b in enumerate(BUCKETS) if v <= b), len(BUCKETS))] += 1

    def render(self) -> list[str]:
        with self.lock:
            lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
            total = 0
            for b, c in zip((*BUCKETS, float("inf")), self.counts, strict=True):
                total += c
                lines.append(f'{self.name}_bucket{{le="{"+Inf" if b == float("inf") else b}"}} {total}')
            lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {total}"]
        return lines


@dataclass
class Metrics:
    ttft: Histogram = field(default_factory=lambda: Histogram(
        "npuc_time_to_first_token_seconds", "From a request's arrival to its first token."))
    itl: Histogram = field(default_factory=lambda: Histogram(
        "npuc_inter_token_latency_seconds", "Between consecutive tokens of one request."))
    tokens: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # finish reason or HTTP error status -> count
    recent: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) of recent steps

    def count(self, what: str) -> None:
        self.requests[what] = self.requests.get(what, 0) + 1

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        self.recent = [(t, n) for t, n in self.recent if now - t <= window]
        return sum(n for _, n in self.recent) / window


# -- the scheduler's thread ------------------------------------------------------------------------

@dataclass
class Pending:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Event | NpucError]
    arrived: float
    rid: int = -1
    last: float = 0.0


class Engine:
    """The one thread that runs the model."""

    def __init__(self, session: Any, max_queue: int) -> None:
        self.sched = Scheduler(session)
        self.max_queue = max_queue
        self.metrics = Metrics()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, Pending] = {}
        self._stop = False
        self.waiting = 0  # submitted, not yet admitted into a slot (read by the HTTP side)
        self.thread = threading.Thread(target=self._run, name="npuc-scheduler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=30)

    def submit(self, p: Pending) -> None:
        self.waiting += 1
        self._inbox.put(("submit", p))
        self._wake.set()

    def cancel(self, p: Pending) -> None:
        self._inbox.put(("cancel", p))
        self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            self._drain()
            if self.sched.idle:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                events = self.sched.step()
            except Exception as exc:  # noqa: BLE001 - a kernel failure ends every request in flight, not the server
                log.exception("the scheduler's step failed")
                err = exc if isinstance(exc, NpucError) else NpucError("NPUC-E0412", f"the model failed: {exc}")
                for gone in list(self._live.values()):
                    gone.loop.call_soon_threadsafe(gone.out.put_nowait, err)
                    self.sched.cancel(gone.rid)
                self._live.clear()
                continue
            now = time.monotonic()
            self.waiting = self.sched.queued
            if events:
                self.metrics.recent.append((now, sum(e.token is not None for e in events)))
            for e in events:
                p = self._live.get(e.request)
                if p is None:
                    continue
                if e.token is not None:
                    self.metrics.tokens += 1
                    (self.metrics.ttft if not p.last else self.metrics.itl).observe(now - (p.last or p.arrived))
                    p.last = now
                if e.finish_reason is not None:
                    self.metrics.count(e.finish_reason)
                    del self._live[e.request]
                p.loop.call_soon_threadsafe(p.out.put_nowait, e)

    def _drain(self) -> None:
        while True:
            try:
                what, p = self._inbox.get_nowait()
            except queue.Empty:
                return
            if what == "submit":
                try:
                    p.rid = self.sched.submit(p.prompt, p.max_tokens, p.ignore_eos)  # checked by the HTTP side
                except NpucError as e:  # what the HTTP side's checks missed ends this request, not the thread
                    p.loop.call_soon_threadsafe(p.out.put_nowait, e)
                    continue
                self._live[p.rid] = p
            elif p.rid in self._live:
                self.sched.cancel(p.rid)
                del self._live[p.rid]
                self.metrics.count("cancelled")
            self.waiting = self.sched.queued


# -- requests --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Parsed:
    prompt: list[int]
    max_tokens: int
    stream: bool
    ignore_eos: bool
    model: str


def _int(body: dict[str, Any], name: str, default: int) -> int:
    v = body.get(name, default)
    if v is None:
        return default
    if type(v) is not int:
        raise RequestError(f"'{name}' must be an integer, not {json.dumps(v)[:40]}", name)
    return v


def _common(body: dict[str, Any], fields: frozenset[str]) -> tuple[bool, bool]:
    """(stream, ignore_eos), once the fields every endpoint shares are checked."""
    unknown = sorted(set(body) - fields)
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; npuc serve takes {sorted(fields)}", unknown[0])
    for name, greedy in (("temperature", 0), ("top_p", 1)):  # absent, or the greedy value
        v = body.get(name)
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool) or v != greedy):
            raise RequestError(f"'{name}' must be {greedy}: npuc serve decodes greedily", name)
    if _int(body, "n", 1) != 1:
        raise RequestError("'n' must be 1", "n")
    stream, ignore = body.get("stream", False), body.get("ignore_eos", False)
    for name, v in (("stream", stream), ("ignore_eos", ignore)):
        if not isinstance(v, bool):
            raise RequestError(f"'{name}' must be true or false", name)
    return stream, ignore


class App:
    """The Starlette application around one Engine."""

    def __init__(self, om: str, max_queue: int = 64, device: str = "cpu") -> None:
        from npuc.runtime.executor import open_session

        self.session = open_session(om, device=device)
        self.engine = Engine(self.session, max_queue)
        self.model_name = om.rsplit("/", 1)[-1].removesuffix(".om")
        self.info = self.engine.sched.info
        self.encode: Callable[[str], list[int]] | None = None
        self.decode: Callable[[list[int]], str] | None = None
        self.tokenizer: Any = None
        if tokenizer_section(self.session) is not None:
            self.tokenizer = load_tokenizer_object(self.session)
            self.encode, self.decode = tokenizer_functions(self.tokenizer)
        self.draining = False
        self._next_id = 0

    # -- parsing ---------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.encode is None:
                raise RequestError("a text prompt needs a tokenizer, and this model holds none: send token ids "
                                   "(a list of integers)", "prompt")
            return self.encode(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
            return self._prompt_ids(prompt[0])  # a batch of one
        if not isinstance(prompt, list) or not all(type(t) is int for t in prompt):
            raise RequestError("'prompt' must be a string or a list of token ids (one prompt a request)", "prompt")
        return prompt

    def _check(self, ids: list[int], max_tokens: int) -> None:
        try:
            check_prompt(self.info, ids)  # generate's own refusals, as a 400
        except NpucError as e:
            raise RequestError(e.message, "prompt") from None
        if max_tokens < 1:
            raise RequestError(f"'max_tokens' must be at least 1, not {max_tokens}", "max_tokens")

    def parse_completion(self, body: dict[str, Any]) -> Parsed:
        stream, ignore = _common(body, COMPLETION_FIELDS)
        if "prompt" not in body:
            raise RequestError("'prompt' is required", "prompt")
        ids = self._prompt_ids(body["prompt"])
        max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS)
        self._check(ids, max_tokens)
        return Parsed(ids, max_tokens, stream, ignore, str(body.get("model") or self.model_name))

    def parse_chat(self, body: dict[str, Any]) -> Parsed:
        stream, ignore = _common(body, CHAT_FIELDS)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise RequestError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}", "messages")
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("chat needs the chat template of a tokenizer stored in the .om, and this model has "
                               "none: use /v1/completions", "messages")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # noqa: BLE001 - the template's own refusal of these messages
            raise RequestError(f"the chat template refuses these messages: {e}", "messages") from None
        if hasattr(ids, "keys"):  # a BatchEncoding (transformers 5), not the ids
            ids = ids["input_ids"]
        max_tokens = _int(body, "max_completion_tokens", _int(body, "max_tokens", DEFAULT_MAX_TOKENS))
        self._check(list(ids), max_tokens)
        return Parsed(list(ids), max_tokens, stream, ignore, str(body.get("model") or self.model_name))

    # -- running ---------------------------------------------------------------------------------

    def admit(self, parsed: Parsed) -> Pending:
        if self.draining:
            raise RequestError("the server is shutting down", status=503, kind="service_unavailable")
        if self.engine.waiting >= self.engine.max_queue:
            self.engine.metrics.count("429")
            raise RequestError(f"{self.engine.waiting} requests already wait for a slot (--max-queue "
                               f"{self.engine.max_queue}); retry shortly", status=429, kind="rate_limit_exceeded")
        loop = asyncio.get_running_loop()
        p = Pending(parsed.prompt, parsed.max_tokens, parsed.ignore_eos, loop, asyncio.Queue(), time.monotonic())
        self.engine.submit(p)
        return p

    async def events(self, p: Pending) -> AsyncIterator[Event]:
        while True:
            e = await p.out.get()
            if isinstance(e, NpucError):
                raise e
            yield e
            if e.finish_reason is not None:
                return

    def new_id(self, prefix: str) -> str:
        self._next_id += 1
        return f"{prefix}-{self._next_id}"


def _finish(reason: str | None) -> str | None:
    return {"cache_full": "length", "cancelled": None}.get(reason or "", reason)


def build(om: str, max_queue: int = 64, device: str = "cpu") -> Any:
    """The ASGI application for `om`."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    app_state = App(om, max_queue, device)
    engine = app_state.engine

    def error(e: RequestError) -> JSONResponse:
        if e.status != 429:
            engine.metrics.count(str(e.status))
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise RequestError("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    async def watch_disconnect(request: Request, p: Pending) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                engine.cancel(p)
                return

    async def serve(request: Request, chat: bool) -> Response:
        try:
            body = await body_of(request)
            parsed = app_state.parse_chat(body) if chat else app_state.parse_completion(body)
            p = app_state.admit(parsed)
        except RequestError as e:
            return error(e)
        rid = app_state.new_id("chatcmpl" if chat else "cmpl")
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if parsed.stream:
            return StreamingResponse(stream(rid, created, obj, parsed, p, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(watch_disconnect(request, p))
        tokens: list[int] = []
        reason = None
        try:
            async for ev in app_state.events(p):
                if ev.token is not None:
                    tokens.append(ev.token)
                reason = ev.finish_reason
        except NpucError as err:
            return JSONResponse({"error": {"message": err.message, "type": "server_error", "param": None,
                                           "code": err.code}}, status_code=500)
        finally:
            watcher.cancel()
        choice: dict[str, Any] = {"index": 0, "token_ids": tokens, "finish_reason": _finish(reason), "logprobs": None}
        text = app_state.decode(tokens) if app_state.decode is not None else None
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        elif text is not None:  # with a stored tokenizer; token_ids always
            choice["text"] = text
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": parsed.model,
                             "choices": [choice], "usage": {"prompt_tokens": len(parsed.prompt),
                                                            "completion_tokens": len(tokens),
                                                            "total_tokens": len(parsed.prompt) + len(tokens)}})

    async def stream(rid: str, created: int, obj: str, parsed: Parsed, p: Pending, chat: bool) -> AsyncIterator[str]:
        tokens: list[int] = []
        sent = ""
        finished = False
        try:
            if chat:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": parsed.model,
                            "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
            async for e in app_state.events(p):
                delta: dict[str, Any] = {"token_ids": [e.token] if e.token is not None else []}
                if e.token is not None:
                    tokens.append(e.token)
                    if app_state.decode is not None:  # the text the new token completes
                        text = app_state.decode(tokens)
                        piece, sent = text[len(sent):] if text.startswith(sent) else "", text
                        delta["text"] = piece
                finished = e.finish_reason is not None
                choice: dict[str, Any] = {"index": 0, "token_ids": delta["token_ids"],
                                          "finish_reason": _finish(e.finish_reason), "logprobs": None}
                if chat:
                    choice["delta"] = {"content": delta.get("text")}
                elif "text" in delta:
                    choice["text"] = delta["text"]
                yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else obj, "created": created,
                            "model": parsed.model, "choices": [choice]})
            yield "data: [DONE]\n\n"
        except NpucError as err:
            yield _sse({"error": {"message": err.message, "type": "server_error", "param": None, "code": err.code}})
        finally:
            if not finished:  # the client went away (or the model failed): free the slot
                engine.cancel(p)

    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    async def health(request: Request) -> Response:
        if app_state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": app_state.model_name, "object": "model",
                                                         "owned_by": "npuc"}]})

    async def metrics(request: Request) -> Response:
        m = engine.metrics
        lines = ["# HELP npuc_queue_depth Requests waiting for a slot.", "# TYPE npuc_queue_depth gauge",
                 f"npuc_queue_depth {engine.waiting}",
                 "# HELP npuc_active_slots Slots decoding a request.", "# TYPE npuc_active_slots gauge",
                 f"npuc_active_slots {engine.sched.active}",
                 "# HELP npuc_slots The model's slots.", "# TYPE npuc_slots gauge", f"npuc_slots {engine.sched.slots}",
                 "# HELP npuc_tokens_per_second Tokens generated per second over the last 10 s.",
                 "# TYPE npuc_tokens_per_second gauge", f"npuc_tokens_per_second {m.tokens_per_second():.3f}",
                 "# HELP npuc_generated_tokens_total Tokens generated.", "# TYPE npuc_generated_tokens_total counter",
                 f"npuc_generated_tokens_total {m.tokens}",
                 "# HELP npuc_requests_total Requests ended, by how.", "# TYPE npuc_requests_total counter"]
        lines += [f'npuc_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(m.requests.items())]
        lines += m.ttft.render() + m.itl.render()
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            app_state.draining = True
            engine.stop()

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    async def internal(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed: %r", request.method, request.url.path, exc)
        engine.metrics.count("500")
        return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}: {exc}"[:300],
                                       "type": "server_error", "param": None, "code": None}}, status_code=500)

    starlette_app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={Exception: internal})
    starlette_app.state.npuc = app_state
    return starlette_app


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def run(om: str, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 64, device: str = "cpu") -> None:
    import uvicorn

    app = build(om, max_queue, device)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=60)
    server = uvicorn.Server(config)
    original = server.handle_exit

    def on_exit(sig: int, frame: Any) -> None:  # stop admitting at once; uvicorn drains the connections
        app.state.npuc.draining = True
        original(sig, frame)

    server.handle_exit = on_exit  # type: ignore[method-assign]
    # uvicorn raises a captured signal again once it has drained; with this handler in place
    # that is a no-op, so a SIGTERM ends in exit 0 after the requests in flight finish.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    server.run()
