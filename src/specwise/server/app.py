"""`specwise serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE stream), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus), `GET /openapi.json`. Every client mistake is a 4xx in OpenAI's error shape; a fault of
the server is a 500 that fails only the request it hit. Requests run on the scheduler's thread; the event loop only
parses, queues and relays.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specwise import __version__
from specwise.engine.engine import GenerationResult, Sequence, StreamEvent, TokenLogprob
from specwise.engine.request import RequestOptions
from specwise.engine.sampling import SamplingParams
from specwise.engine.scheduler import QueueFull, Scheduler, SchedulerDown
from specwise.errors import SpecwiseError
from specwise.server.admin import policy_from_body, policy_view
from specwise.server.metrics import CONTENT_TYPE, Metrics
from specwise.server.protocol import (
    ChatRequest,
    CompletionRequest,
    ProtocolError,
    SamplingFields,
    SpeculativeOptions,
    StreamOptions,
    error_body,
    now,
    pydantic_error,
    sse,
)
from specwise.speccounts import SpecCounts
from specwise.specs import DEFAULT_MAX_QUEUE

log = logging.getLogger("specwise.server")
DEFAULT_MAX_BODY = 1 << 20
SUFFIX_HISTORY = ("per-key", "shared", "off")  # whose outputs a request's suffix drafts may come from
DOC_PATHS = ("/docs", "/redoc", "/openapi.json")  # behind the API key too: they describe what a key opens
_GONE = object()  # the relay's sentinel: the client disconnected


@dataclass
class ServerState:
    scheduler: Scheduler
    model_name: str
    metrics: Metrics
    api_keys: tuple[str, ...] = ()  # any of them opens /v1 and the docs; none: open to all
    admin_key: str | None = None  # enables /admin (the policy switch); never the client API key
    info: dict = field(default_factory=dict)  # target identity, drafters, policy: shown by /v1/models
    on_finish: list[Callable[[Sequence, GenerationResult, dict], None]] = field(default_factory=list)
    suffix_history: str = SUFFIX_HISTORY[0]  # per-key: requests see the history of their own key's requests only

    def __post_init__(self) -> None:
        if self.suffix_history not in SUFFIX_HISTORY:
            raise SpecwiseError(
                f"--suffix-history {self.suffix_history!r} is not allowed: choose one of {', '.join(SUFFIX_HISTORY)}"
            )

    def tenant(self, request: Request) -> tuple[str, bool]:
        """(tenant, may use history) for a request: its API key's under per-key, one for all under shared."""
        if self.suffix_history == "off":
            return "", False
        if self.suffix_history == "shared":
            return "", True
        return request.scope.get("specwise_key", ""), True

    @classmethod
    def build(
        cls,
        engine,
        name: str,
        policy=None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        api_key: str | list[str] | tuple[str, ...] | None = None,
        admin_key: str | None = None,
        suffix_history: str = SUFFIX_HISTORY[0],
    ) -> ServerState:
        """Metrics, a scheduler over `engine` feeding them, and the provenance /v1/models shows."""
        metrics = Metrics(name)
        scheduler = Scheduler(engine, policy, max_queue=max_queue, on_step=metrics.on_step)
        scheduler.on_policy.append(metrics.on_policy)
        suffix = [d for d in engine.drafters.values() if hasattr(d, "history_tokens")]  # suffix drafters
        if suffix:
            metrics.add_gauges(
                lambda: {
                    "specwise_suffix_history_tokens": (
                        "Tokens of earlier outputs kept for suffix drafting (all tenants).",
                        float(sum(d.history_tokens() for d in suffix)),
                    ),
                    "specwise_suffix_history_bytes": (
                        "Approximate memory of the suffix drafting history (all tenants).",
                        float(sum(d.history_bytes() for d in suffix)),
                    ),
                }
            )
        info = {
            "target": engine.target.identity.to_dict(),
            "drafters": list(engine.drafters),
            "default_drafter": engine.drafter.name if engine.drafter else None,
            "k": engine.k_spec,
            "policy": scheduler.policy.describe(),
            "max_batch": engine.max_batch,
            "max_len": engine.max_len,
            "kernels": engine.target.model.kernels,
            "version": __version__,
            "suffix_history": suffix_history,
        }
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
        return cls(scheduler, name, metrics, keys, admin_key, info, suffix_history=suffix_history)


def _key_index(auth: str, keys: tuple[str, ...]) -> int | None:
    """Which of `keys` the Authorization header carries, compared in constant time (every key, every time)."""
    found = None
    given = auth.encode("utf-8", "replace")
    for i, key in enumerate(keys):
        if hmac.compare_digest(given, f"Bearer {key}".encode()) and found is None:
            found = i
    return found


class BodyLimit:
    """ASGI middleware: refuse request bodies over `limit` bytes (413) and check the bearer token on /v1 and the
    API documents (401); the index of the key a request came with goes into its scope (`specwise_key`)."""

    def __init__(self, app, limit: int, api_keys: tuple[str, ...], admin_key: str | None = None):
        self.app, self.limit, self.api_keys, self.admin_key = app, limit, api_keys, admin_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope["path"]
        if self.api_keys and (path.startswith("/v1") or path.startswith(DOC_PATHS)):
            auth = headers.get("authorization", "")
            index = _key_index(auth, self.api_keys)
            if index is None:
                why = "no API key given" if not auth else "the API key is wrong"
                return await _send_error(
                    send, 401, f"{why}: send 'Authorization: Bearer <key>'", "invalid_request_error", "invalid_api_key"
                )
            scope["specwise_key"] = f"key-{index}"
        if path.startswith("/admin"):
            auth = headers.get("authorization", "")
            if not self.admin_key:
                return await _send_error(
                    send,
                    404,
                    "the admin API is off: start the server with --admin-key",
                    "invalid_request_error",
                    "admin_disabled",
                )
            if _key_index(auth, (self.admin_key,)) is None:
                why = (
                    "that is the client API key; the admin API takes the --admin-key"
                    if _key_index(auth, self.api_keys) is not None
                    else ("no admin key given" if not auth else "the admin key is wrong")
                )
                return await _send_error(
                    send,
                    401,
                    f"{why}: send 'Authorization: Bearer <admin key>'",
                    "invalid_request_error",
                    "invalid_admin_key",
                )
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            return await _send_error(
                send,
                413,
                f"the request body is {declared} bytes; at most {self.limit} are allowed",
                "invalid_request_error",
                "request_too_large",
            )
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await _send_error(
                    send,
                    413,
                    f"the request body is over {self.limit} bytes, the most allowed",
                    "invalid_request_error",
                    "request_too_large",
                )
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def _send_error(send, status: int, message: str, type_: str, code: str) -> None:

    payload = json.dumps(error_body(message, type_, None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def create_app(state: ServerState, max_body: int = DEFAULT_MAX_BODY) -> FastAPI:
    app = FastAPI(
        title="specwise",
        version=__version__,
        description="OpenAI-compatible server with speculative decoding and a load-aware policy.",
    )
    app.state.specwise = state

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        err = pydantic_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ProtocolError)
    async def _protocol(_request: Request, exc: ProtocolError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return JSONResponse(
            error_body(message, "invalid_request_error", None, None),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _fault(_request: Request, exc: Exception):
        log.exception("internal error")
        return JSONResponse(
            error_body(
                f"internal server error ({type(exc).__name__}); the request was not completed",
                "server_error",
                None,
                None,
            ),
            status_code=500,
        )

    @app.get("/health")
    async def health():
        """Liveness: 200 while the engine thread is up, 503 (with the reason) once it has stopped."""
        sched = state.scheduler
        if sched.alive:
            return {"status": "ok"}
        why = f"{type(sched.failure).__name__}: {sched.failure}" if sched.failure else "the engine is not running"
        return JSONResponse({"status": "down", "reason": why}, status_code=503)

    @app.get("/v1/models")
    async def models() -> dict:
        """The one model this server serves, with specwise's provenance (target hash, drafters, policy)."""
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "specwise",
                    "specwise": {**state.info, "policy": state.scheduler.policy.describe()},
                }
            ],
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus text format, vLLM's metric names."""
        state.metrics.on_queue(state.scheduler.running, state.scheduler.waiting)
        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI text completion (one prompt or a list, n choices each); add `"speculative": {"enabled", "drafter",
        "k", "verify", "history"}` to choose speculation."""
        return await _generate(state, request, body, body.prompts(), body.max_tokens, False, body.top_logprobs())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        """OpenAI chat completion, rendered with the model's chat template."""
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        return await _generate(state, request, body, [messages], body.limit(), True, body.top_logprobs_n())

    @app.get("/admin/policy")
    async def get_policy() -> dict:
        """The load policy now, and every change made at run time (admin key)."""
        return policy_view(state.scheduler)

    @app.put("/admin/policy")
    async def put_policy(body: Annotated[dict[str, Any], Body()]) -> dict:
        """Replace the load policy from the next engine step (admin key); running requests are not dropped. The
        body: {"mode": "always"|"never"}, {"mode": "auto", "high": H, "low": L}, {"mode": "table", "table": [[load,
        k], …]}, or a specwise policy file (`specwise export-config --format specwise`); an optional "reason"."""
        policy, reason = policy_from_body(body, list(state.scheduler.engine.drafters))
        state.scheduler.set_policy(policy, "admin", reason)
        return {**policy_view(state.scheduler), "policy": policy.describe(), "applies": "from the next step"}

    app.add_middleware(BodyLimit, limit=max_body, api_keys=state.api_keys, admin_key=state.admin_key)
    return app


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise ProtocolError(
            f"the model {name!r} does not exist on this server: it serves {state.model_name!r}",
            "model",
            404,
            "invalid_request_error",
            "model_not_found",
        )


def _params(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's sampling settings from a request (null fields take OpenAI's defaults, as absent ones)."""
    return SamplingParams(
        max_new_tokens=max_tokens or 1,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=max(body.top_k or 0, 0),
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=body.stop_list(),
        ignore_eos=bool(body.ignore_eos),
        min_tokens=body.min_tokens or 0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=body.bias(),
        logprobs=logprobs,
    )


def _submit(
    state: ServerState,
    body: SamplingFields,
    prompts: list,
    max_tokens: int | None,
    logprobs: int | None,
    sink,
    tenant: tuple[str, bool] = ("", True),
) -> list[Sequence]:
    """Queue every sequence of a request (each prompt × n choices; choice j of a seeded request draws from the seed's
    stream j), each prompt rendered and encoded once. All or none: a refusal takes back the ones already queued.
    Runs off the event loop (tokenizing a long prompt takes a while)."""
    submitted: list[Sequence] = []
    sched = state.scheduler
    options = _options(body.speculative, max_tokens is None, tenant)
    try:
        sched._check_queue()  # a full queue or a stopped engine refuses before any tokenizing
        params = _params(body, max_tokens, logprobs)
        for prompt in prompts:
            tokens = sched.engine.encode_prompt(prompt)
            for j in range(body.choices()):
                submitted.append(sched.submit(prompt, params, sink, dataclasses.replace(options, choice=j), tokens))
        return submitted
    except QueueFull as exc:
        _take_back(state, submitted)
        raise ProtocolError(
            str(exc), None, 429, "rate_limit_error", "queue_full", {"Retry-After": str(int(exc.retry_after + 0.999))}
        ) from None
    except SchedulerDown as exc:
        _take_back(state, submitted)
        raise ProtocolError(str(exc), None, 503, "server_error", exc.code) from None
    except SpecwiseError as exc:  # the engine names the input at fault; here it becomes the request's field
        _take_back(state, submitted)
        param = exc.param
        if param in ("drafter", "k", "k_max", "verify"):
            param = "speculative"
        elif param == "prompt" and isinstance(prompts[0], list):
            param = "messages"
        elif param == "top_logprobs" and not isinstance(prompts[0], list):
            param = "logprobs"
        raise ProtocolError(str(exc), param, 400, "invalid_request_error", exc.code) from None
    except BaseException:
        _take_back(state, submitted)
        raise


async def _submit_off_loop(state: ServerState, request: Request, body, prompts, max_tokens, logprobs, sink):
    """`_submit` on a worker thread, so a long prompt's tokenizing never stalls other streams. If the client goes
    away meanwhile, whatever it queued is taken back once the thread is done."""
    job = asyncio.get_running_loop().run_in_executor(
        None, _submit, state, body, prompts, max_tokens, logprobs, sink, state.tenant(request)
    )
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:

        def undo(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                _take_back(state, f.result())

        job.add_done_callback(undo)
        raise


def _options(spec: SpeculativeOptions | None, fill_context: bool, tenant: tuple[str, bool]) -> RequestOptions:
    """The engine's options for a request, from its `speculative` object (absent fields: the server's defaults);
    without a token limit it may fill the context, as OpenAI's chat does; `tenant`: whose history it may use."""
    owner, may_share = tenant
    spec = spec or SpeculativeOptions()
    return RequestOptions(
        speculative=spec.enabled,
        drafter=spec.drafter,
        k=spec.k,
        fill_context=fill_context,
        history=may_share and spec.history is not False,
        tenant=owner,
        verify=spec.verify,
    )


def _take_back(state: ServerState, seqs: list[Sequence]) -> None:
    for seq in seqs:
        state.scheduler.cancel(seq.request_id)


def _spec_usage(seqs: list[Sequence]) -> dict:
    """specwise's speculation statistics of a request: its sequence's, or pooled over its choices."""
    seq = seqs[0]
    s = seq.stats
    head = {
        "enabled": seq.speculative,
        "drafter": seq.drafter,
        "k": None if seq.controller is None else getattr(seq.controller, "k", "auto"),
        "verify": seq.verify,
    }
    if len(seqs) > 1:
        return {**head, **SpecCounts.pooled(x.stats for x in seqs).to_usage()}
    return {
        **head,
        **s.to_usage(),
        "queue_time": s.queue_time,
        "prefill_time": s.prefill_time,
        "decode_time": s.decode_time,
    }


def _usage(seqs: list[Sequence], completion_tokens: int) -> dict:
    prompt_tokens = sum(s.prompt_len for s in seqs if s.noise.stream == 0)  # each prompt counted once, not per choice
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_text(state: ServerState, token: int) -> str:
    return state.scheduler.engine.tokenizer.decode([token], skip_special_tokens=False)


def _logprob(lp: float) -> float:
    return max(lp, -9999.0)  # as vLLM: JSON has no −inf


def _chat_logprobs(state: ServerState, entries: list[TokenLogprob]) -> dict:
    def item(token: int, lp: float) -> dict:
        text = _token_text(state, token)
        return {"token": text, "logprob": _logprob(lp), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in entries]}


def _completion_logprobs(state: ServerState, entries: list[TokenLogprob], offset: int = 0) -> dict:
    tokens, offsets = [], []
    for t, _, _ in entries:
        offsets.append(offset)
        tokens.append(_token_text(state, t))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(lp) for _, lp, _ in entries],
        "top_logprobs": [{_token_text(state, a): _logprob(b) for a, b in top} for _, _, top in entries],
        "text_offset": offsets,
    }


class _Relay:
    """Carries engine events from the scheduler's thread into this request's asyncio queue, with arrival times."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, event: StreamEvent | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # RuntimeError: the event loop has closed (server shutting down)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (time.perf_counter(), event))


@dataclass
class _Choice:
    """One sequence of a request as the client sees it: its index, what was streamed, timings for /metrics."""

    index: int
    seq: Sequence
    tokens: int = 0  # output tokens so far (after stop strings)
    streamed: int = 0  # characters of text sent (completions' logprobs text_offset)
    first: float | None = None
    last: float = 0.0
    itl: list[float] = field(default_factory=list)
    result: GenerationResult | None = None

    def observe(self, at: float, event: StreamEvent) -> None:
        if event.token_ids:
            if self.first is None:
                self.first = at
            else:
                self.itl.append(at - self.last)
            self.last = at
        self.tokens += len(event.token_ids)


async def _generate(
    state: ServerState,
    request: Request,
    body: SamplingFields,
    prompts: list,
    max_tokens: int | None,
    chat: bool,
    logprobs: int | None,
):
    _check_model(state, body.model)
    relay = _Relay()
    started = time.perf_counter()
    load = state.scheduler.running + state.scheduler.waiting + 1  # the load this request meets, itself included
    seqs = await _submit_off_loop(state, request, body, prompts, max_tokens, logprobs, relay)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    choices = {seq.request_id: _Choice(i, seq) for i, seq in enumerate(seqs)}

    def finish(choice: _Choice, result: GenerationResult, at: float) -> None:
        choice.result = result
        seq = choice.seq
        ttft = choice.first - started if choice.first is not None else None
        tokens = len(result.token_ids)
        state.metrics.on_request(ttft, choice.itl, at - started, seq.prompt_len, tokens, result.finish_reason)
        record = {"ttft": ttft, "e2e": at - started, "load": load, "prompt": prompts[choice.index // body.choices()]}
        for hook in state.on_finish:
            try:
                hook(seq, result, record)
            except Exception:
                log.exception("request log hook failed")

    if body.stream:
        opts = body.stream_options
        return StreamingResponse(
            _stream(state, choices, relay, rid, chat, opts, finish),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    watcher = asyncio.create_task(_watch_disconnect(request, relay))
    try:
        while any(c.result is None for c in choices.values()):
            at, event = await _next_event(state, relay)
            if event is _GONE:  # the client went away: its slots are free from the next step
                _take_back(state, seqs)
                return Response(status_code=499)
            if isinstance(event, BaseException):
                _take_back(state, seqs)
                raise ProtocolError(
                    f"the engine failed while generating ({type(event).__name__}); retry the request",
                    None,
                    500,
                    "server_error",
                )
            choice = choices[event.request_id]
            choice.observe(at, event)
            if event.result is not None:
                finish(choice, event.result, at)
    except asyncio.CancelledError:
        _take_back(state, seqs)
        raise
    finally:
        watcher.cancel()
    out = []
    for c in choices.values():
        assert c.result is not None
        item: dict = {"index": c.index, "finish_reason": c.result.finish_reason, "logprobs": None}
        if c.result.logprobs is not None:
            lps = c.result.logprobs
            item["logprobs"] = _chat_logprobs(state, lps) if chat else _completion_logprobs(state, lps)
        if chat:
            item["message"] = {"role": "assistant", "content": c.result.text}
        else:
            item["text"] = c.result.text
        out.append(item)
    usage = _usage(seqs, sum(c.tokens for c in choices.values()))
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": now(),
        "model": state.model_name,
        "choices": out,
        "usage": {**usage, "speculative": _spec_usage(seqs)},
    }


async def _watch_disconnect(request: Request, relay: _Relay) -> None:
    """Wait for the client's disconnect (the body is already read, so the next message is that) and tell the loop
    waiting on `relay`: a non-streaming request's slots are freed within a step of the client going away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            relay.queue.put_nowait((time.perf_counter(), _GONE))
            return


async def _next_event(state: ServerState, relay: _Relay, every: float = 2.0) -> tuple[float, Any]:
    """The next event of a request; if the engine's thread has died with nothing more to say, its error."""
    while True:
        try:
            return await asyncio.wait_for(relay.queue.get(), timeout=every)
        except TimeoutError:
            if not state.scheduler.alive:
                failure = state.scheduler.failure or RuntimeError("the engine stopped")
                return time.perf_counter(), failure


async def _stream(
    state: ServerState,
    choices: dict[str, _Choice],
    relay: _Relay,
    rid: str,
    chat: bool,
    opts: StreamOptions | None,
    finish,
) -> AsyncIterator[str]:
    created, obj = now(), "chat.completion.chunk" if chat else "text_completion"
    seqs = [c.seq for c in choices.values()]
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)  # as vLLM: both must be set

    def chunk(c: _Choice, text: str | None, finish_reason: str | None, event: StreamEvent | None = None) -> dict:
        lps = None
        if event is not None and event.logprobs:  # set only for a request that asked for logprobs
            lps = (
                _chat_logprobs(state, event.logprobs)
                if chat
                else _completion_logprobs(state, event.logprobs, c.streamed)
            )
        if chat:
            delta = {"role": "assistant", "content": ""} if event is None and finish_reason is None else {}
            if text:
                delta = {"content": text}
            item = {"index": c.index, "delta": delta, "finish_reason": finish_reason, "logprobs": lps}
        else:
            item = {"index": c.index, "text": text or "", "finish_reason": finish_reason, "logprobs": lps}
        out = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [item]}
        if continuous:
            out["usage"] = _usage(seqs, sum(x.tokens for x in choices.values()))
        return out

    done = False
    try:
        if chat:
            for c in choices.values():
                yield sse(chunk(c, None, None))
        while any(c.result is None for c in choices.values()):
            at, event = await _next_event(state, relay)
            if isinstance(event, BaseException):
                yield sse(error_body(f"the engine failed while generating ({type(event).__name__})", "server_error"))
                break
            c = choices[event.request_id]
            c.observe(at, event)
            if event.result is None:
                if event.text or event.logprobs:
                    yield sse(chunk(c, event.text, None, event))
                    c.streamed += len(event.text)
                continue
            finish(c, event.result, at)
            last = chunk(c, event.text or None, event.result.finish_reason, event)
            last["speculative"] = _spec_usage([c.seq])  # specwise's per-sequence statistics
            yield sse(last)
        else:
            if include_usage:
                usage = _usage(seqs, sum(c.tokens for c in choices.values()))
                yield sse(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": state.model_name,
                        "choices": [],
                        "usage": {**usage, "speculative": _spec_usage(seqs)},
                    }
                )
            yield "data: [DONE]\n\n"
        done = True
    finally:
        if not done:  # the client went away mid-stream: free its batch slots now
            _take_back(state, seqs)
