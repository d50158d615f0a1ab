"""Systems under test: what the runner may ask of one (`Backend`), the requests and phases it runs, and the one
dispatch loop that puts a phase's requests under its load (`dispatch`). The in-process engine backend is
engine_backend.py, the HTTP backend (any OpenAI-compatible server) http_backend.py.

A backend runs one phase — a list of requests under one load, for one configuration — and hands each finished
request to `on_record` as it completes. TTFT, inter-chunk latencies and E2E are taken as a client sees them (from
submission to streamed output).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from specwise.harness.load import Load
from specwise.harness.server_reports import CounterDelta
from specwise.harness.store import Record

WARM_UP = ("Hello, world. Hello", 8)  # (prompt, tokens) every backend sends before measuring


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
    counters: CounterDelta | None = None


@dataclass(frozen=True)
class PhaseWork:
    """One phase for a backend to run: a configuration's requests under one load. Each finished request goes to
    `on_record` on the calling thread; `progress` ticks once per finished request."""

    config: str
    load: Load
    requests: list[Request]
    on_record: Callable[[Record], None]
    progress: Callable[[], None] | None = None


class Backend(Protocol):
    """What the runner may ask of a system under test."""

    whole_phases: bool  # True when switching configuration is costly (a server restart): switch per phase only

    def info(self) -> dict:
        """Provenance: target identity, each configuration's drafter, hardware."""
        ...

    def warm_up(self) -> None:
        """Pay one-time costs before anything is measured."""
        ...

    def run(self, work: PhaseWork) -> Phase:
        """Run one phase, handing each finished request to `work.on_record` on the calling thread."""
        ...

    def close(self) -> None:
        """Release what the backend holds (servers it launched, connections)."""
        ...

    def observed(self) -> tuple[list[int], bool]:
        """(processes besides this one and its descendants that do the measured work, whether that work runs on
        another machine): what the background load is told apart from."""
        ...

    def facts(self, config: str) -> dict | None:
        """What this configuration's own system reports about itself — target, server, hardware — taken from that
        configuration (its engine, its launched server); None until it is known (a server not yet launched)."""
        ...


def dispatch(work: PhaseWork, submit: Callable[[Request], None], poll: Callable[[float | None], list[Record]]) -> float:
    """The load loop every backend shares; returns the phase's wall time in seconds.

    Closed loop (`concurrent@N`): keep N requests in flight. Open loop (`poisson@R`): submit each request at its
    arrival time, whatever is in flight — the same schedule for every configuration (a paired comparison) and every
    run of the plan. `submit` starts a request without waiting for it; `poll(timeout)` advances or waits for the
    backend (up to `timeout` seconds, None = until something finishes) and returns the records that finished.
    """
    load, requests = work.load, work.requests
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
            work.on_record(rec)
            if work.progress:
                work.progress()
    return time.perf_counter() - start
