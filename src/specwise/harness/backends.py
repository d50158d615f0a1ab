"""Systems under test: what the runner may ask of one (`Backend`), the one dispatch loop that puts a phase's
requests under its load (`dispatch`), and the in-process engine backend, which runs every configuration on one copy
of the target weights (the HTTP backend, for any OpenAI-compatible server, is http_backend.py).

A backend runs one phase — a list of requests under one load, for one configuration — and hands each finished
request to `on_record` as it completes. TTFT, inter-chunk latencies and E2E are taken as a client sees them (from
submission to streamed output); prefill, decode and speculation statistics come from the engine. The engine is
imported only when this backend is built, so the rest of the harness never imports torch.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from specwise.errors import SpecwiseError
from specwise.harness.load import Load
from specwise.harness.store import Record

# Secrets a server command may carry: a key flag's value, a secret-looking environment assignment, a bearer token.
_SECRET_FLAG = re.compile(r"(--?(?:\w+[-_])*(?:key|token|secret|password))(=|\s+)(\"[^\"]*\"|'[^']*'|\S+)", re.I)
_SECRET_ENV = re.compile(r"\b(\w*(?:KEY|TOKEN|SECRET|PASSWORD))=(\"[^\"]*\"|'[^']*'|\S+)", re.I)
_BEARER = re.compile(r"(Bearer\s+)[^\s'\"]+", re.I)


def redact(command: str | None) -> str | None:
    """A server command as it may be stored and shown: every API key, token or password in it replaced by ***."""
    if command is None:
        return None
    out = _SECRET_FLAG.sub(lambda m: f"{m[1]}{m[2]}***", command)
    out = _SECRET_ENV.sub(lambda m: f"{m[1]}=***", out)
    return _BEARER.sub(lambda m: f"{m[1]}***", out)


@dataclass(frozen=True)
class Config:
    """One configuration under comparison: a name, a drafter spec (None = baseline) and a draft length. Over HTTP,
    `options` are extra request-body fields and `launch` the command that starts this configuration's server."""

    name: str
    drafter: str | None = None
    k: int | str = "auto"
    options: dict | None = None
    launch: str | None = None
    verify: str | None = None  # in-process: this configuration's verification method (None: evaluate's --verify)

    def to_dict(self) -> dict:
        d: dict = {"name": self.name, "drafter": self.drafter, "k": self.k}
        if self.options is not None or self.launch is not None:
            d.update(options=self.options, launch=redact(self.launch))  # what is stored: never a key
        if self.verify is not None:  # absent otherwise, so earlier plans keep their fingerprint
            d["verify"] = self.verify
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        return cls(d["name"], d.get("drafter"), d.get("k", "auto"), d.get("options"), d.get("launch"), d.get("verify"))


@dataclass(frozen=True)
class Request:
    task_id: str
    groups: list[str]
    repeat: int
    seed: int
    prompt: str | list[dict]
    max_tokens: int


@dataclass(frozen=True)
class Phase:
    """What one phase measured besides its records: its wall time, and the server's own spec-decode counters over
    it where the server exposes them (None otherwise)."""

    seconds: float
    counters: dict | None = None


class Backend(Protocol):
    """What the runner may ask of a system under test."""

    whole_phases: bool  # True when switching configuration is costly (a server restart): switch per phase only

    def info(self) -> dict:
        """Provenance: target identity, each configuration's drafter, hardware."""
        ...

    def warm_up(self) -> None:
        """Pay one-time costs before anything is measured."""
        ...

    def run(
        self,
        config: str,
        load: Load,
        requests: list[Request],
        on_record: Callable[[Record], None],
        progress: Callable[[], None] | None = None,
    ) -> Phase:
        """Run one phase, handing each finished request to `on_record` on the calling thread."""
        ...

    def close(self) -> None:
        """Release what the backend holds (servers it launched, connections)."""
        ...

    def facts(self, config: str) -> dict | None:
        """What this configuration's own system reports about itself — target, server, hardware — taken from that
        configuration (its engine, its launched server); None until it is known (a server not yet launched)."""
        ...


COMPARED = ("target", "server", "hardware")  # what must be the same for a paired comparison to mean anything


def check_comparable(facts: dict[str, dict]) -> None:
    """Refuse configurations whose systems differ in target, server build or hardware, saying what differs."""
    names = list(facts)
    for field_ in COMPARED:
        values = {n: json.dumps(facts[n].get(field_), sort_keys=True) for n in names}
        if len(set(values.values())) > 1:
            detail = "; ".join(f"{n}: {describe(facts[n].get(field_))}" for n in names)
            raise SpecwiseError(
                f"the configurations differ in {field_} ({detail}): a paired comparison needs the same target, "
                "server build and hardware"
            )


def describe(value) -> str:
    """A fact for people: `unknown` where a system did not say."""
    if value is None or value == "":
        return "unknown"
    if isinstance(value, dict):
        return ", ".join(f"{k} {describe(v)}" for k, v in value.items())
    return str(value)


def dispatch(
    load: Load,
    requests: list[Request],
    submit: Callable[[Request], None],
    poll: Callable[[float | None], list[Record]],
    on_record: Callable[[Record], None],
    progress: Callable[[], None] | None = None,
) -> float:
    """The load loop every backend shares; returns the phase's wall time in seconds.

    Closed loop (`concurrent@N`): keep N requests in flight. Open loop (`poisson@R`): submit each request at its
    arrival time, whatever is in flight — the same schedule for every configuration (a paired comparison) and every
    run of the plan. `submit` starts a request without waiting for it; `poll(timeout)` advances or waits for the
    backend (up to `timeout` seconds, None = until something finishes) and returns the records that finished.
    """
    pending = list(requests)
    arrivals = load.arrivals(len(pending), seed=zlib.crc32(load.name.encode())) if load.kind == "poisson" else None
    start = time.perf_counter()
    submitted = finished = 0
    while finished < len(requests):
        if arrivals is None:
            while pending and submitted - finished < load.value:
                submit(pending.pop(0))
                submitted += 1
            timeout = None
        else:
            while pending and time.perf_counter() - start >= arrivals[submitted]:
                submit(pending.pop(0))
                submitted += 1
            timeout = max(0.0, arrivals[submitted] - (time.perf_counter() - start)) if pending else None
        for rec in poll(timeout):
            finished += 1
            on_record(rec)
            if progress:
                progress()
    return time.perf_counter() - start


def hardware() -> dict:
    """CPU model and thread count of this machine (the engine backend adds the accelerator)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_threads": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


class EngineBackend:
    """Runs configurations on the in-process engine; one target load, one engine per configuration."""

    whole_phases = False

    def __init__(
        self,
        model: str | None,
        configs: list[Config],
        device: str = "cpu",
        max_batch: int = 8,
        max_len: int = 1536,
        temperature: float = 0.0,
        dtype: str = "auto",
        quantize: str | None = None,
        verify: str = "coupled",
        activations: str = "auto",
    ):
        from specwise.engine import Engine, load_target

        self.target = load_target(model, device=device, dtype=dtype, quantize=quantize, activations=activations)
        self.temperature = temperature
        self._facts: dict[str, dict] = {}
        self.engines = {
            c.name: Engine(
                self.target, drafter=c.drafter, k=c.k, max_batch=max_batch, max_len=max_len, verify=c.verify or verify
            )
            for c in configs
        }

    def info(self) -> dict:
        """Provenance: target identity, each configuration's drafter and its extra resources, hardware."""
        from specwise.engine.weights import device_info

        dev = self.target.device
        hw = {**hardware(), **device_info(self.target)}
        configs = {}
        for name, e in self.engines.items():
            d = e.drafter
            configs[name] = {
                "drafter": d.name if d else None,
                "k": e.k_spec if d else None,
                "draft_extra_memory_bytes": d.extra_memory_bytes() if d else 0,
                "draft_device": str(dev) if d else None,
                "draft_identity": d.provenance(self.target.identity.sha256) if d else None,
            }
        return {"target": self.target.identity.to_dict(), "configs": configs, "hardware": hw, "backend": "engine"}

    def facts(self, config: str) -> dict | None:
        """From this configuration's own engine: the target it runs, this specwise, this machine (read once: the
        runner asks after every phase)."""
        from specwise import __version__
        from specwise.engine.weights import device_info

        if config not in self._facts:
            target = self.engines[config].target
            self._facts[config] = {
                "target": target.identity.to_dict(),
                "server": {"kind": "specwise (in process)", "version": __version__},
                "hardware": {**hardware(), **device_info(target)},
            }
        return self._facts[config]

    def warm_up(self) -> None:
        """One short generation per configuration, so the first measured request pays no one-time costs."""
        from specwise.engine import SamplingParams

        for e in self.engines.values():
            e.generate(["Hello, world. Hello"], SamplingParams(max_new_tokens=8))

    def run(
        self,
        config: str,
        load: Load,
        requests: list[Request],
        on_record: Callable[[Record], None],
        progress: Callable[[], None] | None = None,
    ) -> Phase:
        """Run one phase on this configuration's engine, stepping it on this thread."""
        from specwise.engine import SamplingParams

        engine = self.engines[config]
        live: dict[
            str, tuple[Request, float, list[tuple[float, int]]]
        ] = {}  # request id → (request, submitted, chunk times)
        refused: list[Record] = []

        def submit(req: Request) -> None:
            params = SamplingParams(max_new_tokens=req.max_tokens, temperature=self.temperature, seed=req.seed)
            now = time.perf_counter()
            try:
                live[engine.submit(req.prompt, params)] = (req, now, [])
            except SpecwiseError as exc:
                refused.append(
                    Record(config, load.name, req.task_id, req.repeat, req.groups, req.seed, now, now, error=str(exc))
                )

        def poll(timeout: float | None) -> list[Record]:
            done = refused[:]
            refused.clear()
            if done:
                return done
            if not engine.has_work:  # open loop, nothing in flight: wait for the next arrival
                time.sleep(timeout or 0.0)
                return []
            for event in engine.step():
                req, t_submit, chunks = live[event.request_id]
                t = time.perf_counter()
                if event.token_ids:
                    chunks.append((t, len(event.text)))
                if event.result is not None:
                    del live[event.request_id]
                    done.append(_record(config, load, req, t_submit, t, chunks, event.result, engine.verify))
            return done

        return Phase(dispatch(load, requests, submit, poll, on_record, progress))

    def close(self) -> None:
        """Nothing to release: the engines go with the backend."""


def _record(
    config: str, load: Load, req: Request, submitted: float, finished: float, chunks: list, result, verify: str
) -> Record:
    s = result.stats
    times = [t for t, _ in chunks]
    return Record(
        config,
        load.name,
        req.task_id,
        req.repeat,
        req.groups,
        req.seed,
        submitted,
        finished,
        output=result.text,
        prompt_tokens=s.prompt_tokens,
        output_tokens=s.generated_tokens,
        finish_reason=result.finish_reason,
        ttft=times[0] - submitted if times else None,
        itl=[b - a for a, b in itertools.pairwise(times)],
        chunks=[[t - submitted, n] for t, n in chunks if n],  # what a reader sees arrive: time, characters
        e2e=finished - submitted,
        prefill=s.prefill_time,
        decode=s.decode_time,
        spec={**s.counts().to_dict(), "verify": verify},  # "coupled": a seeded output is plain decoding's
    )
