"""One completion request from its parsed body to its answer: checked, queued on the scheduler (off the event loop:
tokenizing a long prompt takes a while), its engine events relayed from the scheduler's thread, and answered as JSON
or as an SSE stream. A client that goes away — streaming or not — has its sequences taken back within a step; an
engine failure ends the request with an error (a stream with an error event)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from specwise.engine.engine import GenerationResult, Sequence, StreamEvent
from specwise.engine.request import RequestOptions
from specwise.engine.sampling import SamplingParams
from specwise.engine.scheduler import QueueFull, SchedulerDown
from specwise.errors import SpecwiseError
from specwise.monitor.live import ClientSide
from specwise.server.protocol import (
    ProtocolError,
    SamplingFields,
    SpeculativeOptions,
    StreamOptions,
    error_body,
    now,
    sse,
)
from specwise.server.state import ServerState
from specwise.server.usage import chat_logprobs, completion_logprobs, spec_usage, token_usage

log = logging.getLogger("specwise.server")
_GONE = object()  # the relay's sentinel: the client disconnected


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


@dataclass(frozen=True)
class Prepared:
    """A request as the server runs it: its fields, its prompts (texts, or one chat's messages), its token limit
    (None: it may fill the context), whether it is a chat, and how many top logprobs each token reports."""

    body: SamplingFields
    prompts: list
    max_tokens: int | None
    chat: bool
    logprobs: int | None


def _submit(state: ServerState, prepared: Prepared, sink, tenant: tuple[str, bool] = ("", True)) -> list[Sequence]:
    """Queue every sequence of a request (each prompt × n choices; choice j of a seeded request draws from the seed's
    stream j), each prompt rendered and encoded once. All or none: a refusal takes back the ones already queued.
    Runs off the event loop (tokenizing a long prompt takes a while)."""
    body, prompts, max_tokens, logprobs = prepared.body, prepared.prompts, prepared.max_tokens, prepared.logprobs
    submitted: list[Sequence] = []
    sched = state.scheduler
    options = _options(body.speculative, max_tokens is None, tenant)
    try:
        sched.check_admission()  # a full queue or a stopped engine refuses before any tokenizing
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
        if param in ("drafter", "k", "verify"):
            param = "speculative"
        elif param == "prompt" and isinstance(prompts[0], list):
            param = "messages"
        elif param == "top_logprobs" and not isinstance(prompts[0], list):
            param = "logprobs"
        raise ProtocolError(str(exc), param, 400, "invalid_request_error", exc.code) from None
    except BaseException:
        _take_back(state, submitted)
        raise


async def _submit_off_loop(state: ServerState, request: Request, prepared: Prepared, sink) -> list[Sequence]:
    """`_submit` on a worker thread, so a long prompt's tokenizing never stalls other streams. If the client goes
    away meanwhile, whatever it queued is taken back once the thread is done."""
    job = asyncio.get_running_loop().run_in_executor(None, _submit, state, prepared, sink, state.tenant(request))
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


async def generate(state: ServerState, request: Request, prepared: Prepared):
    body, prompts, chat = prepared.body, prepared.prompts, prepared.chat
    _check_model(state, body.model)
    tok = state.scheduler.engine.tokenizer
    relay = _Relay()
    started = time.perf_counter()
    load = state.scheduler.running + state.scheduler.waiting + 1  # the load this request meets, itself included
    seqs = await _submit_off_loop(state, request, prepared, relay)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    choices = {seq.request_id: _Choice(i, seq) for i, seq in enumerate(seqs)}

    def finish(choice: _Choice, result: GenerationResult, at: float) -> None:
        choice.result = result
        seq = choice.seq
        ttft = choice.first - started if choice.first is not None else None
        tokens = len(result.token_ids)
        state.metrics.on_request(
            ttft, choice.itl, at - started, seq.prompt_len, tokens, result.finish_reason, seq.stats.cached_tokens
        )
        client = ClientSide(ttft, at - started, load, prompts[choice.index // body.choices()])
        for hook in state.on_finish:
            try:
                hook(seq, result, client)
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
            item["logprobs"] = chat_logprobs(tok, lps) if chat else completion_logprobs(tok, lps)
        if chat:
            item["message"] = {"role": "assistant", "content": c.result.text}
        else:
            item["text"] = c.result.text
        out.append(item)
    usage = token_usage(seqs, sum(c.tokens for c in choices.values()))
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": now(),
        "model": state.model_name,
        "choices": out,
        "usage": {**usage, "speculative": spec_usage(seqs)},
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
    tok = state.scheduler.engine.tokenizer
    created, obj = now(), "chat.completion.chunk" if chat else "text_completion"
    seqs = [c.seq for c in choices.values()]
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)  # as vLLM: both must be set

    def chunk(c: _Choice, text: str | None, finish_reason: str | None, event: StreamEvent | None = None) -> dict:
        lps = None
        if event is not None and event.logprobs:  # set only for a request that asked for logprobs
            lps = chat_logprobs(tok, event.logprobs) if chat else completion_logprobs(tok, event.logprobs, c.streamed)
        if chat:
            delta = {"role": "assistant", "content": ""} if event is None and finish_reason is None else {}
            if text:
                delta = {"content": text}
            item = {"index": c.index, "delta": delta, "finish_reason": finish_reason, "logprobs": lps}
        else:
            item = {"index": c.index, "text": text or "", "finish_reason": finish_reason, "logprobs": lps}
        out = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [item]}
        if continuous:
            out["usage"] = token_usage(seqs, sum(x.tokens for x in choices.values()))
        return out

    done = False
    try:
        if chat:
            for c in choices.values():
                yield sse(chunk(c, None, None))
        while any(c.result is None for c in choices.values()):
            at, event = await _next_event(state, relay)
            if isinstance(event, BaseException):  # one choice failed: the request ends, its siblings with it
                _take_back(state, [c.seq for c in choices.values() if c.result is None])
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
            last["speculative"] = spec_usage([c.seq])  # specwise's per-sequence statistics
            yield sse(last)
        else:
            if include_usage:
                usage = token_usage(seqs, sum(c.tokens for c in choices.values()))
                yield sse(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": state.model_name,
                        "choices": [],
                        "usage": {**usage, "speculative": spec_usage(seqs)},
                    }
                )
            yield "data: [DONE]\n\n"
        done = True
    finally:
        if not done:  # the client went away mid-stream: free its batch slots now
            _take_back(state, seqs)
