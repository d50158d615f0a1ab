"""The OpenAI wire format: request bodies (checked field by field), responses, stream chunks and errors.

Unknown fields are refused, as OpenAI does, so a typo is not silently ignored. Features specwise does not implement
(echo, best_of, tools, logprobs of the prompt) are refused with a message that says so, never ignored. The optional
`speculative` object is specwise's extension; `top_k`, `ignore_eos`, `min_tokens`, `repetition_penalty` and
`stream_options.continuous_usage_stats` are vLLM's, which load-testing clients (GuideLLM, `vllm bench serve`) send.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from specwise.specs import K_MAX

MAX_STOP = 4
MAX_N = 16  # choices of one request (n), and prompts × n of one completions request
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries of logit_bias, OpenAI's cap (each costs work per row per step)
MAX_MESSAGES = 4096  # messages of one chat request (the engine also refuses more than its context can hold)
_TOKEN_ID = re.compile(r"[0-9]{1,12}")
VERIFY = Literal["coupled", "rejection"]  # specs.VERIFY_METHODS (a test keeps them equal)


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
    verify: VERIFY | None = None  # how sampled drafts are verified (the server's --verify when absent)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (tokens so far) on every chunk


class SamplingFields(Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # as vLLM: absent means the one model this server serves
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = 1.0
    top_k: Annotated[int, Field(ge=-1)] | None = 0  # vLLM: -1 or 0 = off
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0, allow_inf_nan=False)] | None = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = 0
    user: str | None = None
    ignore_eos: bool | None = False
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

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed (as OpenAI), got {len(v)}")
        for key in v:
            if not _TOKEN_ID.fullmatch(key.strip()):  # ASCII digits only: "²".isdigit() is true, int("²") fails
                raise ValueError(f'logit_bias keys are token ids (strings of digits such as "50256"), got {key!r}')
        return v

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def choices(self) -> int:
        return self.n or 1

    def bias(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), b) for k, b in (self.logit_bias or {}).items()))


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: Annotated[str, Field(max_length=0)] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v, info: ValidationInfo):
        prompts = [v] if isinstance(v, str) else v
        if not prompts:
            raise ValueError("the prompt list is empty: give at least one prompt")
        if any(not p for p in prompts):
            raise ValueError("the prompt is empty" if isinstance(v, str) else "a prompt in the list is empty")
        n = info.data.get("n") or 1
        if len(prompts) * n > MAX_N:
            raise ValueError(
                f"{len(prompts)} prompts × n={n} is more than the {MAX_N} sequences one request may ask for: split it"
            )
        return v

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def top_logprobs(self) -> int | None:
        return self.logprobs

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
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
