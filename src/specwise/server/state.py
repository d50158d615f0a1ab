"""The server's state: the scheduler, the model's name, metrics, keys, what /v1/models shows, the callbacks a finished
request feeds, and whose outputs a suffix drafter may draft from. Apart from app.py so the routes and a request's
life (generate.py) both import it without importing each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from specwise import __version__
from specwise.engine.engine import GenerationResult, Sequence
from specwise.engine.scheduler import Scheduler
from specwise.errors import SpecwiseError
from specwise.monitor.live import ClientSide
from specwise.server.metrics import Metrics
from specwise.specs import DEFAULT_MAX_QUEUE

SUFFIX_HISTORY = ("per-key", "shared", "off")  # whose outputs a request's suffix drafts may come from


@dataclass
class ServerState:
    scheduler: Scheduler
    model_name: str
    metrics: Metrics
    api_keys: tuple[str, ...] = ()  # any of them opens /v1 and the docs; none: open to all
    admin_key: str | None = None  # enables /admin (the policy switch); never the client API key
    info: dict = field(default_factory=dict)  # target identity, drafters, policy: shown by /v1/models
    on_finish: list[Callable[[Sequence, GenerationResult, ClientSide], None]] = field(default_factory=list)
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
