"""How one request is served beside its sampling: the per-request options, in one object from the protocol (or the
CLI) to the engine. Adding a per-request field means adding it here and where the protocol reads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOptions:
    """Per-request serving options (sampling is `SamplingParams`); every default is the engine's behaviour.

    `speculative`: may this request draft at all; `drafter` names one of the engine's drafters (None: its default);
    `k` overrides the engine's draft length (1..K_MAX or "auto"); `fill_context` lets it generate up to the rest of
    the context (OpenAI's default when a chat request gives no limit); `history` lets it draft from, and add to,
    drafters' cross-request history (suffix), and `tenant` says whose history that is; `verify` overrides the
    engine's verification method; `choice` is the index of this sequence among a request's `n` (its random stream:
    choice 0 of a seeded request is what the same request with n = 1 gives).
    """

    speculative: bool = True
    drafter: str | None = None
    k: int | str | None = None
    fill_context: bool = False
    history: bool = True
    tenant: str = ""
    verify: str | None = None
    choice: int = 0
