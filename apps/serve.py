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

Decoding is greedy unless the request asks otherwise (`temperature` absent is 0, not
OpenAI's 1: an answer is reproducible by default); the sampling fields, stop strings and
logprobs are docs/serving.md's. Every choice carries `token_ids`, so a model compiled
without a tokenizer is served too; `text` is there when one is stored.
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
from dataclasses import dataclass, field, replace
from typing import Any

from npuc.apps.generate import check_prompt, load_tokenizer_object, tokenizer_functions, tokenizer_section
from npuc.apps.openai_format import StopStrings, chat_logprobs, completion_logprobs
from npuc.apps.sampling import GREEDY, SamplingParams
from npuc.apps.sampling import check as check_sampling
from npuc.apps.scheduler import Event, Scheduler
from npuc.apps.speculative import SpeculativeConfig
from npuc.errors import NpucError

log = logging.getLogger("npuc.serve")

DEFAULT_MAX_TOKENS = 16
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                             "repetition_penalty", "seed", "logit_bias", "min_tokens", "stop_token_ids"})
COMPLETION_FIELDS = frozenset({"model", "prompt", "max_tokens", "n", "stream", "ignore_eos", "user", "stream_options",
                               "stop", "logprobs", "echo", "response_format", "structured_outputs", *SAMPLING_FIELDS})
CHAT_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "ignore_eos",
                         "user", "stream_options", "stop", "logprobs", "top_logprobs", "response_format",
                         "structured_outputs", "tools", "tool_choice", "parallel_tool_calls", *SAMPLING_FIELDS})
# vLLM's structured_outputs keys -> apps/structured.grammar_for's kinds
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark", "json_object": "json_object"}
MAX_LOGPROBS = 20
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
    sampling: SamplingParams
    logprobs: int
    echo: bool
    n: int
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[tuple[int, Event] | NpucError]  # (choice, event)
    arrived: float
    rids: list[int] = field(default_factory=list)  # the scheduler's request of each choice
    last: float = 0.0


class Engine:
    """The one thread that runs the model."""

    def __init__(self, session: Any, max_queue: int, speculative: SpeculativeConfig | None = None,
                 draft: Any = None) -> None:
        self.sched = Scheduler(session, speculative=speculative, draft=draft)
        self.max_queue = max_queue
        self.metrics = Metrics()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, tuple[Pending, int]] = {}  # scheduler request -> (its HTTP request, choice)
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

    def cancel(self, p: Pending, why: str = "cancel", choice: int | None = None) -> None:
        """End the request's choices (or one): why is "cancel", or "stop" (a stop string matched)."""
        self._inbox.put((why, (p, choice)))
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
                told = set()
                for rid, (gone, _) in list(self._live.items()):
                    if id(gone) not in told:
                        gone.loop.call_soon_threadsafe(gone.out.put_nowait, err)
                        told.add(id(gone))
                    self.sched.cancel(rid)
                self._live.clear()
                continue
            now = time.monotonic()
            self.waiting = self.sched.queued
            if events:
                self.metrics.recent.append((now, sum(e.token is not None for e in events)))
            for e in events:
                entry = self._live.get(e.request)
                if entry is None:
                    continue
                p, choice = entry
                if e.token is not None:
                    self.metrics.tokens += 1
                    (self.metrics.ttft if not p.last else self.metrics.itl).observe(now - (p.last or p.arrived))
                    p.last = now
                if e.finish_reason is not None:
                    self.metrics.count(e.finish_reason)
                    del self._live[e.request]
                p.loop.call_soon_threadsafe(p.out.put_nowait, (choice, e))

    def _drain(self) -> None:
        while True:
            try:
                what, p = self._inbox.get_nowait()
            except queue.Empty:
                return
            if what == "submit":
                try:  # checked by the HTTP side
                    p.rids = self.sched.submit_many(p.prompt, p.n, p.max_tokens, p.ignore_eos, p.sampling, p.logprobs,
                                                    p.echo and p.logprobs >= 0)
                except NpucError as e:  # what the HTTP side's checks missed ends this request, not the thread
                    p.loop.call_soon_threadsafe(p.out.put_nowait, e)
                    continue
                for i, rid in enumerate(p.rids):
                    self._live[rid] = (p, i)
            else:
                p, choice = p
                for i, rid in enumerate(p.rids):
                    if (choice is None or choice == i) and rid in self._live:
                        self.sched.cancel(rid)
                        del self._live[rid]
                        self.metrics.count("cancelled" if what == "cancel" else what)
            self.waiting = self.sched.queued


# -- requests --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Parsed:
    prompt: list[int]
    max_tokens: int
    stream: bool
    ignore_eos: bool
    model: str
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()
    logprobs: int = -1  # alternatives per token; -1: no logprobs
    echo: bool = False
    n: int = 1
    tool_format: str | None = None  # parse the output for tool calls in this format (apps/tools.py)


def _int(body: dict[str, Any], name: str, default: int) -> int:
    v = body.get(name, default)
    if v is None:
        return default
    if type(v) is not int:
        raise RequestError(f"'{name}' must be an integer, not {json.dumps(v)[:40]}", name)
    return v


def _refused(e: NpucError, param: str) -> RequestError:
    """A check's NpucError (a sampling value, a grammar, a tool's schema) as the 400 naming `param`."""
    return RequestError(f"{e.message} ({e.hint})", param)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise RequestError(f"'{name}' must be a number, not {json.dumps(v)[:40]}", name)
    return float(v)


def _sampling(body: dict[str, Any], vocab: int) -> SamplingParams:
    """The request's sampling fields, checked (a 400 naming the field) before the model sees them."""
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise RequestError("'logit_bias' must be an object of token id: bias", "logit_bias")
    logit_bias: dict[int, float] = {}
    for k, v in bias.items():
        if not (isinstance(k, str) and k.strip().lstrip("-").isdigit()) or not isinstance(v, int | float) \
                or isinstance(v, bool):
            raise RequestError(f"'logit_bias' must map token ids to numbers, not {json.dumps({k: v})[:60]}",
                               "logit_bias")
        logit_bias[int(k)] = float(v)
    stops = body.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(type(t) is int for t in stops):
        raise RequestError("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise RequestError(f"'seed' must be an integer, not {json.dumps(seed)[:40]}", "seed")
    params = SamplingParams(
        temperature=_number(body, "temperature", 0.0), top_p=_number(body, "top_p", 1.0),
        top_k=_int(body, "top_k", 0), min_p=_number(body, "min_p", 0.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0), seed=seed % 2**64 if seed is not None else None,
        logit_bias=logit_bias, min_tokens=_int(body, "min_tokens", 0), stop_token_ids=tuple(stops))
    if params.top_k == -1:  # vLLM's spelling of "off"
        params = replace(params, top_k=0)
    try:
        check_sampling(params, vocab)
    except NpucError as e:
        raise _refused(e, e.message.split()[0]) from None
    return params


def _messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages as the template takes them: content a string (a list of text parts is
    joined), or absent on an assistant message that carries tool_calls."""
    if not isinstance(value, list) or not value:
        raise RequestError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}", "messages")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}", "messages")
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            m = {**m, "content": "".join(p["text"] for p in content)}
        elif not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise RequestError("each message's 'content' must be a string (or text parts)", "messages")
        out.append(m)
    return out


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise RequestError("'stop' must be a string or a list of strings", "stop")
    return tuple(s for s in items if s)


def _common(body: dict[str, Any], fields: frozenset[str]) -> tuple[bool, bool]:
    """(stream, ignore_eos), once the fields every endpoint shares are checked."""
    unknown = sorted(set(body) - fields)
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; npuc serve takes {sorted(fields)}", unknown[0])
    stream, ignore = body.get("stream", False), body.get("ignore_eos", False)
    for name, v in (("stream", stream), ("ignore_eos", ignore)):
        if not isinstance(v, bool):
            raise RequestError(f"'{name}' must be true or false", name)
    return stream, ignore


class App:
    """The Starlette application around one Engine."""

    def __init__(self, om: str, max_queue: int = 64, device: str = "cpu", tool_parser: str | None = None,
                 speculative: SpeculativeConfig | None = None, draft: str | None = None) -> None:
        from npuc.runtime.executor import open_session

        self.tool_parser = tool_parser
        self.session = open_session(om, device=device)
        draft_session = open_session(draft, device=device) if draft is not None else None
        self.engine = Engine(self.session, max_queue, speculative, draft_session)
        self.model_name = om.rsplit("/", 1)[-1].removesuffix(".om")
        self.info = self.engine.sched.info
        self.encode: Callable[[str], list[int]] | None = None
        self.decode: Callable[[list[int]], str] | None = None
        self.tokenizer: Any = None
        self.piece: Callable[[list[int]], str] | None = None  # a token's own text, special tokens included
        if tokenizer_section(self.session) is not None:
            self.tokenizer = load_tokenizer_object(self.session)
            self.encode, self.decode = tokenizer_functions(self.tokenizer)
            tokenizer = self.tokenizer
            self.piece = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False))
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

    def _check(self, ids: list[int], max_tokens: int, allow_zero: bool = False) -> None:
        try:
            check_prompt(self.info, ids)  # generate's own refusals, as a 400
        except NpucError as e:
            raise RequestError(e.message, "prompt") from None
        if max_tokens < (0 if allow_zero else 1):
            raise RequestError(f"'max_tokens' must be at least {0 if allow_zero else 1}, not {max_tokens}",
                               "max_tokens")

    def _grammar(self, body: dict[str, Any]) -> str | None:
        """The llguidance grammar that response_format or structured_outputs asks for, checked
        against the model's tokenizer (a 400 naming the field otherwise)."""
        from npuc.apps.structured import grammar_for

        fmt, so = body.get("response_format"), body.get("structured_outputs")
        if fmt is not None and so is not None:
            raise RequestError("give response_format or structured_outputs, not both", "structured_outputs")
        kind: str | None = None
        spec: Any = None
        field_name = "response_format" if fmt is not None else "structured_outputs"
        if fmt is not None:
            t = fmt.get("type") if isinstance(fmt, dict) else None
            if t == "text":
                return None
            if t == "json_object":
                kind = "json_object"
            elif t == "json_schema":
                js = fmt.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                    raise RequestError("response_format.json_schema must be {\"name\", \"schema\": {...}}",
                                       "response_format")
                kind, spec = "json_schema", js.get("schema", {})
            else:
                raise RequestError("response_format.type must be text, json_object or json_schema", "response_format")
        elif so is not None:
            given = [k for k in STRUCTURED if isinstance(so, dict) and so.get(k) not in (None, False)]
            if len(given) != 1 or set(so) - set(STRUCTURED):
                raise RequestError(f"structured_outputs takes exactly one of {sorted(STRUCTURED)}", "structured_outputs")
            kind, spec = STRUCTURED[given[0]], so[given[0]]
            if kind == "json_schema" and isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError:
                    raise RequestError("structured_outputs.json is not valid JSON", "structured_outputs") from None
        if kind is None:
            return None
        try:
            grammar = grammar_for(kind, spec)
            self.engine.sched.grammar_tokenizer().check(grammar)
        except NpucError as e:
            raise _refused(e, field_name) from None
        return grammar

    def _n(self, body: dict[str, Any]) -> int:
        n = _int(body, "n", 1)
        slots = self.engine.sched.slots
        if not 1 <= n <= slots:
            raise RequestError(f"'n' must be from 1 to {slots}, the model's slots (its choices share one prefill, "
                               f"each in a slot of its own), not {n}", "n")
        return n

    def _stops(self, body: dict[str, Any]) -> tuple[str, ...]:
        stops = _stop(body)
        if stops and self.decode is None:
            raise RequestError("'stop' strings need a tokenizer, and this model holds none: use stop_token_ids",
                               "stop")
        return stops

    def parse_completion(self, body: dict[str, Any]) -> Parsed:
        stream, ignore = _common(body, COMPLETION_FIELDS)
        if "prompt" not in body:
            raise RequestError("'prompt' is required", "prompt")
        ids = self._prompt_ids(body["prompt"])
        max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS)
        logprobs = body.get("logprobs")
        if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= MAX_LOGPROBS):
            raise RequestError(f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}, not "
                               f"{json.dumps(logprobs)[:40]}", "logprobs")
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise RequestError("'echo' must be true or false", "echo")
        scored = echo and logprobs is not None
        self._check(ids, max_tokens, allow_zero=scored)
        sampling = replace(_sampling(body, self.info.vocab), grammar=self._grammar(body))
        return Parsed(ids, max_tokens, stream, ignore, str(body.get("model") or self.model_name), sampling,
                      self._stops(body), -1 if logprobs is None else logprobs, echo, self._n(body))

    def parse_chat(self, body: dict[str, Any]) -> Parsed:
        from npuc.apps import tools as tool_calls

        stream, ignore = _common(body, CHAT_FIELDS)
        messages = _messages(body.get("messages"))
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("chat needs the chat template of a tokenizer stored in the .om, and this model has "
                               "none: use /v1/completions", "messages")
        try:
            tools = tool_calls.check_tools(body["tools"]) if body.get("tools") is not None else None
            choice = tool_calls.check_choice(body.get("tool_choice"), tools)
        except tool_calls.ToolError as e:
            raise RequestError(str(e), e.param) from None
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise RequestError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
        try:
            kw = {"tools": tools} if tools else {}
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
        except Exception as e:  # noqa: BLE001 - the template's own refusal of these messages
            raise RequestError(f"the chat template refuses these messages: {e}", "messages") from None
        if hasattr(ids, "keys"):  # a BatchEncoding (transformers 5), not the ids
            ids = ids["input_ids"]
        max_tokens = _int(body, "max_completion_tokens", _int(body, "max_tokens", DEFAULT_MAX_TOKENS))
        self._check(list(ids), max_tokens)
        logprobs = body.get("logprobs", False)
        if not isinstance(logprobs, bool | None):
            raise RequestError("'logprobs' must be true or false", "logprobs")
        top = body.get("top_logprobs")
        if top is not None and (type(top) is not int or not 0 <= top <= MAX_LOGPROBS):
            raise RequestError(f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}, not "
                               f"{json.dumps(top)[:40]}", "top_logprobs")
        if top is not None and not logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        grammar = self._grammar(body)
        fmt = None
        if tools and choice != "none":
            fmt = self.tool_parser or tool_calls.detect_format(getattr(self.tokenizer, "chat_template", None))
            forced = tool_calls.grammar(fmt, tools, str(choice), parallel)
            if forced is not None:
                if grammar is not None:
                    raise RequestError("a required or named tool_choice already constrains the output: give no "
                                       "response_format with it", "response_format")
                from npuc.apps.structured import grammar_for

                try:
                    grammar = grammar_for("lark", forced)
                    self.engine.sched.grammar_tokenizer().check(grammar)
                except NpucError as e:
                    raise _refused(e, "tools") from None
        sampling = replace(_sampling(body, self.info.vocab), grammar=grammar)
        return Parsed(list(ids), max_tokens, stream, ignore, str(body.get("model") or self.model_name), sampling,
                      self._stops(body), (top or 0) if logprobs else -1, False, self._n(body), fmt)

    # -- running ---------------------------------------------------------------------------------

    def admit(self, parsed: Parsed) -> Pending:
        if self.draining:
            raise RequestError("the server is shutting down", status=503, kind="service_unavailable")
        if self.engine.waiting >= self.engine.max_queue:
            self.engine.metrics.count("429")
            raise RequestError(f"{self.engine.waiting} requests already wait for a slot (--max-queue "
                               f"{self.engine.max_queue}); retry shortly", status=429, kind="rate_limit_exceeded")
        loop = asyncio.get_running_loop()
        p = Pending(parsed.prompt, parsed.max_tokens, parsed.ignore_eos, parsed.sampling, parsed.logprobs, parsed.echo,
                    parsed.n, loop, asyncio.Queue(), time.monotonic())
        self.engine.submit(p)
        return p

    async def events(self, p: Pending) -> AsyncIterator[tuple[int, Event]]:
        """(choice, event) as they come; the caller stops once every choice is done (a choice
        ended by a stop string gets no further event)."""
        while True:
            e = await p.out.get()
            if isinstance(e, NpucError):
                raise e
            yield e

    def new_id(self, prefix: str) -> str:
        self._next_id += 1
        return f"{prefix}-{self._next_id}"


class Output:
    """One choice's output as its events arrive: the tokens and their logprobs, and the text
    that may be sent (stop strings cut it, and hold back what could still become a match)."""

    def __init__(self, app: App, parsed: Parsed, p: Pending, index: int = 0, chat: bool = False) -> None:
        self.app, self.parsed, self.p, self.index, self.chat = app, parsed, p, index, chat
        self.done = False
        self.tokens: list[int] = []
        self.lps: list[Any] = []
        self.prompt_lp: list[Any] = []
        self.reason: str | None = None
        self.text = ""  # released so far
        self._stop = StopStrings(parsed.stop)

    def add(self, e: Event) -> bool:
        """Take an event; True when the output ends at a stop string (the choice is cancelled)."""
        if self.done:  # in flight when a stop string ended it
            return False
        self.done = e.finish_reason is not None
        if e.prompt_logprobs is not None:
            self.prompt_lp = list(e.prompt_logprobs)
        if e.token is not None:
            self.tokens.append(e.token)
            self.lps.append(e.logprobs)
        self.reason = e.finish_reason
        decode = self.app.decode
        if decode is None or e.token is None:
            return False
        piece, hit = self._stop.update(decode(self.tokens))
        self.text += piece
        if hit:
            if e.finish_reason is None:
                self.app.engine.cancel(self.p, "stop", self.index)
            self.reason = "stop"
            self.done = True
        return hit

    def tool_calls(self) -> tuple[str | None, list[dict[str, Any]]] | None:
        """(content, calls) where the request gave tools and the output holds calls."""
        from npuc.apps.tools import parse_output

        fmt, piece = self.parsed.tool_format, self.app.piece
        if fmt is None or piece is None:
            return None
        eos = self.app.info.eos
        content, calls = parse_output(fmt, piece([t for t in self.tokens if t not in eos]))
        return (content, calls) if calls else None

    def flush(self) -> str:
        """The text held back, once the output ended without a stop string."""
        if self.app.decode is None:
            return ""
        piece = self._stop.flush(self.app.decode(self.tokens))
        self.text += piece
        return piece


def _finish(reason: str | None) -> str | None:
    return {"cache_full": "length", "cancelled": None}.get(reason or "", reason)


def build(om: str, max_queue: int = 64, device: str = "cpu", tool_parser: str | None = None,
          speculative: SpeculativeConfig | None = None, draft: str | None = None) -> Any:
    """The ASGI application for `om`; `speculative` and `draft` (a draft model's .om) as
    apps/scheduler.Scheduler takes them."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    app_state = App(om, max_queue, device, tool_parser, speculative, draft)
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
        outs = [Output(app_state, parsed, p, i, chat) for i in range(parsed.n)]
        try:
            async for i, ev in app_state.events(p):
                outs[i].add(ev)
                if all(o.done for o in outs):
                    break
        except NpucError as err:
            return JSONResponse({"error": {"message": err.message, "type": "server_error", "param": None,
                                           "code": err.code}}, status_code=500)
        finally:
            watcher.cancel()
        choices = [choice_of(out) for out in outs]
        completion = sum(len(out.tokens) for out in outs)
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": parsed.model, "choices": choices,
                             "usage": {"prompt_tokens": len(parsed.prompt), "completion_tokens": completion,
                                       "total_tokens": len(parsed.prompt) + completion}})

    def choice_of(out: Output) -> dict[str, Any]:
        parsed = out.parsed
        decode = app_state.decode
        choice: dict[str, Any] = {"index": out.index, "token_ids": out.tokens, "finish_reason": _finish(out.reason),
                                  "logprobs": None}
        out.flush()
        if out.chat:
            choice["message"] = {"role": "assistant", "content": out.text if decode is not None else None}
            called = out.tool_calls()
            if called is not None:
                choice["message"] = {"role": "assistant", "content": called[0], "tool_calls": called[1]}
                choice["finish_reason"] = "tool_calls"
            if parsed.logprobs >= 0:
                choice["logprobs"] = chat_logprobs(app_state.piece, out.tokens, out.lps)
        else:
            if decode is not None:  # with a stored tokenizer; token_ids always
                choice["text"] = (decode(parsed.prompt) if parsed.echo else "") + out.text
            if parsed.logprobs >= 0:
                pre = parsed.prompt if parsed.echo else []
                choice["logprobs"] = completion_logprobs(app_state.piece, [*pre, *out.tokens],
                                                         [*(out.prompt_lp if parsed.echo else []), *out.lps])
        return choice

    async def stream(rid: str, created: int, obj: str, parsed: Parsed, p: Pending, chat: bool) -> AsyncIterator[str]:
        outs = [Output(app_state, parsed, p, i, chat) for i in range(parsed.n)]
        decode = app_state.decode
        offsets = [0] * parsed.n
        echoed = [False] * parsed.n

        def chunk(i: int, token_ids: list[int], text: str | None, reason: str | None, logprobs: Any,
                  delta: dict[str, Any] | None = None) -> str:
            choice: dict[str, Any] = {"index": i, "token_ids": token_ids, "finish_reason": _finish(reason),
                                      "logprobs": logprobs}
            if chat:
                choice["delta"] = delta if delta is not None else {"content": text}
            elif text is not None:
                choice["text"] = text
            return _sse({"id": rid, "object": "chat.completion.chunk" if chat else obj, "created": created,
                         "model": parsed.model, "choices": [choice]})

        try:
            if chat:
                for i in range(parsed.n):
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": parsed.model,
                                "choices": [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}]})
            async for i, e in app_state.events(p):
                out = outs[i]
                if out.done:
                    continue
                before = len(out.text)
                out.add(e)
                if parsed.echo and not chat and not echoed[i]:  # the prompt first
                    echoed[i] = True
                    lp = completion_logprobs(app_state.piece, parsed.prompt, out.prompt_lp) \
                        if parsed.logprobs >= 0 else None
                    ptext = decode(parsed.prompt) if decode is not None else None
                    offsets[i] = len(ptext or "")
                    yield chunk(i, [], ptext, None, lp)
                piece = out.text[before:] + (out.flush() if out.done else "")
                lp = None
                if e.token is not None and parsed.logprobs >= 0:
                    if chat:
                        lp = chat_logprobs(app_state.piece, [e.token], [e.logprobs])
                    else:
                        lp = completion_logprobs(app_state.piece, [e.token], [e.logprobs], offsets[i])
                        offsets[i] += len(lp["tokens"][0])
                ids = [e.token] if e.token is not None else []
                if parsed.tool_format is not None:  # the output is parsed once it is whole: nothing before
                    if not out.done:
                        continue
                    called = out.tool_calls()
                    if called is not None:
                        calls = [{"index": j, **c} for j, c in enumerate(called[1])]
                        yield chunk(i, out.tokens, None, "tool_calls", None,
                                    {"content": called[0], "tool_calls": calls})
                    else:
                        yield chunk(i, out.tokens, out.text, out.reason, None)
                    if all(o.done for o in outs):
                        break
                    continue
                yield chunk(i, ids, piece if decode is not None else None, out.reason if out.done else None, lp)
                if all(o.done for o in outs):
                    break
            yield "data: [DONE]\n\n"
        except NpucError as err:
            yield _sse({"error": {"message": err.message, "type": "server_error", "param": None, "code": err.code}})
        finally:
            if not all(o.done for o in outs):  # the client went away (or the model failed): free the slots
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
        sp = engine.sched.stats  # speculative decoding (apps/speculative.py)
        lines += ["# HELP npuc_decode_steps_total Decode steps run (decode or verify).",
                  "# TYPE npuc_decode_steps_total counter", f"npuc_decode_steps_total {sp.steps}",
                  "# HELP npuc_verify_steps_total Steps that checked drafted tokens.",
                  "# TYPE npuc_verify_steps_total counter", f"npuc_verify_steps_total {sp.verify_steps}",
                  "# HELP npuc_draft_tokens_total Drafted tokens checked.", "# TYPE npuc_draft_tokens_total counter",
                  f"npuc_draft_tokens_total {sp.drafted}",
                  "# HELP npuc_draft_accepted_tokens_total Drafted tokens accepted.",
                  "# TYPE npuc_draft_accepted_tokens_total counter", f"npuc_draft_accepted_tokens_total {sp.accepted}",
                  "# HELP npuc_draft_acceptance_rate Accepted over checked drafted tokens.",
                  "# TYPE npuc_draft_acceptance_rate gauge", f"npuc_draft_acceptance_rate {sp.acceptance:.4f}",
                  "# HELP npuc_tokens_per_step Tokens a decode step gave, on average.",
                  "# TYPE npuc_tokens_per_step gauge", f"npuc_tokens_per_step {sp.tokens_per_step:.4f}"]
        book = engine.sched.prefixes  # prefix reuse (apps/prefix_cache.py), where the model has a pool
        if book is not None:
            lines += ["# HELP npuc_prefix_cache_hits_total Prompts that reused a cached prefix.",
                      "# TYPE npuc_prefix_cache_hits_total counter", f"npuc_prefix_cache_hits_total {book.stats.hits}",
                      "# HELP npuc_prefix_cache_misses_total Prompts prefilled whole.",
                      "# TYPE npuc_prefix_cache_misses_total counter",
                      f"npuc_prefix_cache_misses_total {book.stats.misses}",
                      "# HELP npuc_prefix_cache_tokens_saved_total Prompt positions loaded instead of computed.",
                      "# TYPE npuc_prefix_cache_tokens_saved_total counter",
                      f"npuc_prefix_cache_tokens_saved_total {book.stats.tokens_saved}"]
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


def run(om: str, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 64, device: str = "cpu",
        tool_parser: str | None = None, speculative: SpeculativeConfig | None = None, draft: str | None = None) -> None:
    import uvicorn

    app = build(om, max_queue, device, tool_parser, speculative, draft)
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
