"""The OpenAI wire format: request bodies (checked field by field), responses, stream chunks and errors.

Unknown fields are refused, as OpenAI does, so a typo is not silently ignored. Features specwise does not implement
(n > 1, logprobs, echo, penalties, tools) are refused with a message that says so, never ignored. The optional
`speculative` object and `top_k` / `ignore_eos` are specwise's extensions (the last two as in vLLM).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specwise.specs import K_MAX

MAX_STOP = 4


class ProtocolError(Exception):
    """A client mistake: answered with `status` and OpenAI's error object."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpeculativeOptions(Strict):
    """Per-request speculation: off, or which of the server's drafters and which draft length (1..K_MAX or 'auto')."""

    enabled: bool = True
    drafter: str | None = None
    k: Annotated[int, Field(ge=1, le=K_MAX)] | Literal["auto"] | None = None
    history: bool | None = None  # false: neither draft from nor add to the server's cross-request history (suffix)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """Fields shared by completions and chat completions."""

    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    speculative: SpeculativeOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.n != 1:
            raise ValueError("n must be 1: specwise returns one choice per request")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (leave them at 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=0)] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: Annotated[str, Field(max_length=0)] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError(
                    "give one prompt (a string, or a list holding one string): batched prompts are not supported"
                )
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def pydantic_error(errors: list[dict]) -> ProtocolError:
    """One readable message for a failed request body: each problem as 'field: what is wrong'."""
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # drop pydantic's union-branch labels such as 'str' or 'list[str]' from the path
        loc = [
            x
            for x in loc
            if not (
                x in {"str", "int", "float", "bool"}
                or "[" in x
                or x.startswith("function-")
                or x.startswith("literal")
                or x.startswith("constrained")
            )
        ]
        where = ".".join(loc)
        msg = e.get("msg", "invalid")
        if e.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON ({e.get('ctx', {}).get('error', 'parse error')})"
            where = ""
        elif e.get("type") == "extra_forbidden":
            msg = "unrecognized request argument (not part of the API)"
        elif e.get("type") == "missing":
            msg = "required field is missing"
        msg = msg.removeprefix("Value error, ")
        param = param or where or None
        parts.append(f"{where}: {msg}" if where else msg)
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return ProtocolError("; ".join(parts) + more, param=param)


def now() -> int:
    return int(time.time())


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
