"""`specwise serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE stream), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus), `GET /openapi.json`. Every client mistake is a 4xx in OpenAI's error shape; a fault of
the server is a 500 that fails only the request it hit. Requests run on the scheduler's thread; the event loop only
parses, queues and relays. Here: the server's state and the routes; the gate before them is middleware.py, a
completion request's life generate.py, what its answer says of it usage.py, the admin API admin.py.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specwise import __version__
from specwise.server.admin import policy_from_body, policy_view
from specwise.server.generate import Prepared, generate
from specwise.server.metrics import CONTENT_TYPE
from specwise.server.middleware import BodyLimit, key_index
from specwise.server.protocol import (
    ChatRequest,
    CompletionRequest,
    ProtocolError,
    error_body,
    pydantic_error,
)
from specwise.server.state import ServerState

log = logging.getLogger("specwise.server")
DEFAULT_MAX_BODY = 1 << 20


def create_app(
    state: ServerState, max_body: int = DEFAULT_MAX_BODY, allowed_hosts: tuple[str, ...] | None = None
) -> FastAPI:
    """The ASGI app; `allowed_hosts` (None: any) are the Host header values it answers (DNS rebinding)."""
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
    async def health(request: Request):
        """Liveness: 200 while the engine thread is up, 503 once it has stopped: `engine_down`, and the failure's
        text only for the admin key (an exception's text can carry paths and request content)."""
        sched = state.scheduler
        if sched.alive:
            return {"status": "ok"}
        body = {"status": "down", "reason": "engine_down"}
        auth = request.headers.get("authorization", "")
        if state.admin_key and key_index(auth, (state.admin_key,)) is not None:
            body["detail"] = (
                f"{type(sched.failure).__name__}: {sched.failure}" if sched.failure else "the engine is not running"
            )
        return JSONResponse(body, status_code=503)

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
        prepared = Prepared(body, body.prompts(), body.max_tokens, False, body.top_logprobs())
        return await generate(state, request, prepared)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        """OpenAI chat completion, rendered with the model's chat template."""
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        return await generate(state, request, Prepared(body, [messages], body.limit(), True, body.top_logprobs_n()))

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

    app.add_middleware(
        BodyLimit, limit=max_body, api_keys=state.api_keys, admin_key=state.admin_key, allowed_hosts=allowed_hosts
    )
    return app
