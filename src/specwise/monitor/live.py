"""The server's side of monitoring: the request log (`--log`) and live drift gauges (`--drift-baseline`).

Each finished request becomes a `LogEntry`: appended to the SQLite log when one is open — by a writer thread of its
own, so a slow disk never stalls the server's event loop — and kept in a window of recent requests that `/metrics`
compares with the evaluation run, as `specwise_acceptance_rate` and `specwise_drift_alert` (1 when the monitor would
say drifted or invalid). The window keeps counts, never text: its memory is bounded by its entry count however long
the prompts (`--log-text` puts text in the file only).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specwise.errors import SpecwiseError
from specwise.harness.background import Sampler
from specwise.monitor.drift import Baseline, compare
from specwise.monitor.requestlog import LogEntry, RequestLog
from specwise.speccounts import SpecCounts

if TYPE_CHECKING:  # the server hands in the engine's objects; importing them would pull torch in
    from specwise.engine.engine import GenerationResult, Sequence

log = logging.getLogger("specwise.server")
ON_DRIFT = ("alert", "revert")
BACKGROUND_EVERY_S = 10.0  # how often a logging server samples the machine's background (what `monitor` reads)


@dataclass(frozen=True)
class ClientSide:
    """What the server saw of a finished request from its client's side: time to first token and end to end (from
    submission, seconds), the load it met (running + waiting requests, itself included) and its prompt."""

    ttft: float | None
    e2e: float
    load: int
    prompt: str | list[dict]


@dataclass(frozen=True)
class WatchOptions:
    """What a serving process keeps of its traffic: the request log (None: none; with prompt texts or not; its size
    bound), the drift window and test level, how many recent requests the gauges hold, what a detected drift does,
    and how often the background is sampled into the log."""

    log_path: str | None = None
    log_text: bool = False
    log_max_bytes: int | None = None
    window_seconds: float = 3600.0
    alpha: float = 0.01
    max_recent: int = 20000
    on_drift: str = "alert"
    background_every: float = BACKGROUND_EVERY_S


class DriftWatch:
    """Turns finished requests into log entries; writes them and/or keeps them for live drift gauges."""

    def __init__(
        self,
        engine,
        options: WatchOptions | None = None,
        baseline: Baseline | None = None,
        revert: Callable[[str], None] | None = None,
    ):
        o = options or WatchOptions()
        log_path, log_text, on_drift, max_recent = o.log_path, o.log_text, o.on_drift, o.max_recent
        window_seconds, alpha, log_max_bytes, background_every = (
            o.window_seconds,
            o.alpha,
            o.log_max_bytes,
            o.background_every,
        )
        if on_drift not in ON_DRIFT:
            raise SpecwiseError(f"--on-drift {on_drift!r} is not allowed: choose {' or '.join(ON_DRIFT)}")
        self.engine, self.log_text, self.baseline = engine, log_text, baseline
        self.on_drift, self.revert, self.reverted = on_drift, revert, False
        self.window, self.alpha = window_seconds, alpha
        self.log = RequestLog(log_path, max_bytes=log_max_bytes) if log_path else None
        self.recent: collections.deque[LogEntry] = collections.deque(maxlen=max_recent)
        self._writes: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        if self.log is not None:
            self._writer = threading.Thread(target=self._write_loop, name="specwise-request-log", daemon=True)
            self._writer.start()
            self._sampler = threading.Thread(
                target=self._sample_loop, args=(background_every,), name="specwise-background", daemon=True
            )
            self._sampler.start()
        self._lock = threading.Lock()
        self._cached: tuple[float, tuple[float, float, list[str]]] | None = None
        self._identities: dict[str | None, dict | None] = {}

    def _draft(self, name: str | None) -> dict | None:
        if name not in self._identities:
            d = self.engine.drafters.get(name) if name else None
            self._identities[name] = d.provenance(self.engine.target.identity.sha256) if d else None
        return self._identities[name]

    def on_finish(self, seq: Sequence, result: GenerationResult, client: ClientSide) -> None:
        s = seq.stats
        prompt = client.prompt
        entry = LogEntry(
            time=time.time(),
            prompt_tokens=seq.prompt_len,
            output_tokens=len(result.token_ids),
            ttft=client.ttft,
            e2e=client.e2e,
            load=client.load,
            speculative=bool(s.drafted),
            drafter=seq.drafter,
            spec=s.counts(),
            decode_time=s.decode_time,
            finish_reason=result.finish_reason,
            target=self.engine.target.identity.to_dict(),
            draft=self._draft(seq.drafter) if s.drafted else None,
            prompt=(prompt if isinstance(prompt, str) else json.dumps(prompt)) if self.log_text else None,
            output=result.text if self.log_text else None,
            tokens=list(result.token_ids) if self.log_text else None,
            chat=not isinstance(prompt, str) if self.log_text else None,
        )
        self.observe(entry)

    def observe(self, entry: LogEntry) -> None:
        """Log a finished request, keep it for the drift window, and revert speculation if that drifted (once)."""
        if self.log is not None:
            self._writes.put(("entry", entry))
        if self.baseline is not None:
            with self._lock:
                self.recent.append(dataclasses.replace(entry, prompt=None, output=None, tokens=None))
            if self.on_drift == "revert" and not self.reverted and self.revert is not None:
                reasons = self._assess()[2]
                if reasons:  # once: a person turns speculation back on (specwise policy set)
                    self.reverted = True
                    self.revert("drift: " + "; ".join(reasons))

    def on_policy(self, change) -> None:
        """Record a run-time policy change in the request log."""
        if self.log is not None:
            self._writes.put(("policy", change.to_dict()))

    def _sample_loop(self, every: float = BACKGROUND_EVERY_S) -> None:
        """The machine's background (every process but this server) into the log, one sample per `every` seconds."""
        sampler = Sampler()
        last = sampler.snapshot()
        while not self._stop.wait(every):
            try:
                now = sampler.snapshot()
                self._writes.put(("background", (time.time(), sampler.between(last, now).to_dict())))
                last = now
            except Exception:  # a sample lost, never the server
                log.exception("background sample failed")

    def _write_loop(self) -> None:
        assert self.log is not None
        while True:
            kind, item = self._writes.get()
            try:
                if kind == "stop":
                    return
                if kind == "entry":
                    self.log.add(item)
                elif kind == "policy":
                    self.log.add_policy_change(item)
                elif kind == "background":
                    self.log.add_background(*item)
            except Exception:  # a full disk loses log rows, never requests
                log.exception("request log write failed")
            finally:
                self._writes.task_done()

    def flush(self) -> None:
        """Wait until every entry handed in so far is in the log file."""
        if self._writer is not None:
            self._writes.join()

    def gauges(self) -> dict[str, tuple[str, float]]:
        """specwise_acceptance_rate and specwise_drift_alert over the recent window (recomputed at most every 5 s)."""
        if self.baseline is None:
            return {}
        rate, alert, _ = self._assess()
        return {
            "specwise_acceptance_rate": ("Accepted over drafted tokens in the drift window.", rate),
            "specwise_drift_alert": ("1 when traffic in the drift window no longer matches the evaluation.", alert),
            "specwise_drift_reverted": ("1 once --on-drift revert has turned speculation off.", float(self.reverted)),
        }

    def _assess(self) -> tuple[float, float, list[str]]:
        """(acceptance rate, alert 0/1, the rows that drifted or were invalidated) over the window; recomputed at
        most every 5 s (the monitor's comparison, the same rule as `specwise monitor`)."""
        now = time.time()
        if self._cached and now - self._cached[0] < 5:
            return self._cached[1]
        with self._lock:
            entries = [e for e in self.recent if e.time >= now - self.window]
        rate = SpecCounts.pooled(e.spec for e in entries).acceptance_rate
        reasons: list[str] = []
        if entries and self.baseline is not None:
            try:
                reasons = [
                    f"{r.metric} {r.verdict}" for r in compare(self.baseline, entries, self.alpha) if r.verdict != "ok"
                ]
            except Exception:  # a gauge must never break /metrics
                log.exception("drift comparison failed")
        out = (float("nan") if rate is None else rate, float(bool(reasons)), reasons)
        self._cached = (now, out)
        return out

    def close(self) -> None:
        """Write what is queued, then close the log."""
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(5)
            self._sampler = None
        if self._writer is not None:
            self._writes.put(("stop", None))
            self._writer.join(30)
            self._writer = None
        if self.log is not None:
            self.log.close()
