"""Continuous batching for the server: one thread owns the engine and runs its loop; other threads submit, cancel and
receive events through thread-safe queues.

Between steps the loop takes in new requests and cancellations, applies the load policy (may this step draft?), runs
one engine step — which admits waiting requests into free slots, verifies every running request's draft in one
batched target pass and retires finished ones — and hands each event to its request's sink. Speculative and plain
requests share the batch; at temperature 0 a request's output does not depend on its neighbours.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from specwise.engine.engine import Engine, Prompt, Sequence, StreamEvent
from specwise.engine.request import RequestOptions
from specwise.engine.sampling import SamplingParams
from specwise.errors import SpecwiseError
from specwise.policy import Policy, PolicyChange
from specwise.specs import DEFAULT_MAX_QUEUE

log = logging.getLogger("specwise.scheduler")
Sink = Callable[[StreamEvent | BaseException], None]


class SchedulerDown(SpecwiseError):
    """The engine's thread has stopped: nothing more can be served (the server answers 503)."""


class QueueFull(SpecwiseError):
    """The bounded waiting queue is full; the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class StepReport:
    """What one step did, for metrics: batch size, load, whether drafting was allowed, (drafted, accepted) per row."""

    running: int
    waiting: int
    speculating: bool
    rows: list[tuple[int, int]]
    seconds: float
    switches: int = 0


class Scheduler:
    """Runs `engine` on a background thread; `submit` and `cancel` are safe to call from any thread."""

    def __init__(
        self,
        engine: Engine,
        policy: Policy | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        on_step: Callable[[StepReport], None] | None = None,
    ):
        if not isinstance(max_queue, int) or max_queue < 1:
            raise SpecwiseError(f"max_queue={max_queue!r} is not allowed: it must be a whole number ≥ 1")
        self.engine, self.policy, self.max_queue, self.on_step = engine, policy or Policy(), max_queue, on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet handed to the engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.recent_e2e = 1.0  # smoothed seconds per request, for Retry-After
        self.policy_changes: list[PolicyChange] = []
        self.on_policy: list[Callable[[PolicyChange], None]] = []  # told of each change, on the loop's thread
        self.failure: BaseException | None = None  # what stopped the loop's thread, if anything did

    # --- callers' side -------------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self._pending + len(self.engine.waiting)

    @property
    def running(self) -> int:
        return len(self.engine.running)

    @property
    def alive(self) -> bool:
        """Whether the loop's thread is up and serving (False before `start`, after `stop` or a fatal error)."""
        return self._thread is not None and self._thread.is_alive() and self.failure is None and not self._stop.is_set()

    def _check_up(self) -> None:
        if self.failure is not None:
            raise SchedulerDown(
                f"the server's engine has stopped ({type(self.failure).__name__}: {self.failure}); restart it",
                code="engine_down",
            )

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        sink: Sink,
        options: RequestOptions | None = None,
        tokens: list[int] | None = None,
        request_id: str | None = None,
    ) -> Sequence:
        """Check and queue a request; its events go to `sink` on the loop's thread. Raises SpecwiseError for bad
        input, QueueFull when the waiting queue holds `max_queue` requests (checked before the prompt is encoded,
        and again after) and SchedulerDown once the loop has stopped. `tokens`: the prompt already encoded."""
        self.check_admission()
        seq = self.engine.prepare(prompt, params, options, request_id, tokens)
        with self._lock:  # the put is under the lock, so a dying loop either sees this request or refuses it
            self.check_admission()
            self._pending += 1
            self._inbox.put(("submit", seq, sink))
        return seq

    def check_admission(self) -> None:
        """Raise QueueFull or SchedulerDown if a request could not be queued now (cheap: callers check before they
        tokenize)."""
        self._check_up()
        if self.waiting >= self.max_queue:
            per_slot = self.recent_e2e / max(self.engine.max_batch, 1)
            raise QueueFull(
                f"the server's queue is full ({self.max_queue} requests waiting): retry later",
                retry_after=max(1.0, self.waiting * per_slot),
            )

    def set_policy(self, policy: Policy, by: str, reason: str = "") -> None:
        """Replace the load policy from the next step on (running requests carry on under it); any thread."""
        self._inbox.put(("policy", (policy, by, reason), None))

    def cancel(self, request_id: str) -> None:
        """Drop a request (its client went away): its slot is free from the next step on."""
        self._inbox.put(("cancel", request_id, None))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="specwise-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the loop --------------------------------------------------------------------------------------------

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload, sink = item
            if kind == "submit":
                self._sinks[payload.request_id] = sink
                self.engine.enqueue(payload)
                with self._lock:
                    self._pending -= 1
            elif kind == "cancel" and self.engine.cancel(payload):
                self._sinks.pop(payload, None)
            elif kind == "policy":
                self._apply_policy(*payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply_policy(self, policy: Policy, by: str, reason: str) -> None:
        old = self.policy
        policy.switches = old.switches  # /metrics counts switches as one running total
        self.policy = policy  # its k limit reaches the engine with the next step's update
        change = PolicyChange(time.time(), old.describe(), policy.describe(), by, reason)
        self.policy_changes.append(change)
        for hook in self.on_policy:
            try:
                hook(change)
            except Exception:  # a hook (log, metrics) must not stop the engine
                log.exception("policy change hook failed")

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # a fault of the loop itself: nothing more can be served, so say so to all
            log.critical("the engine loop stopped", exc_info=exc)
            with self._lock:
                self.failure = exc
            self._fail_all(exc)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            if not engine.has_work:
                self.policy.update(0)  # empty, if only for an instant: load 0 reaches any low threshold
            self._drain(block=not engine.has_work)
            if not engine.has_work:
                continue
            load = len(engine.running) + len(engine.waiting)
            engine.speculate = self.policy.update(load)
            engine.k_limit = self.policy.k_limit
            t0 = time.perf_counter()
            try:
                events = engine.step()
                self._fail_faults()
            except Exception:  # find the request at fault: it fails, every other carries on
                log.exception("engine step failed; stepping each request alone to find the one at fault")
                events = self._isolate()
            if self.on_step is not None:
                try:
                    self.on_step(
                        StepReport(
                            len(engine.running),
                            len(engine.waiting),
                            engine.speculate,
                            list(engine.last_step_rows),
                            time.perf_counter() - t0,
                            self.policy.switches,
                        )
                    )
                except Exception:  # metrics must not stop the engine
                    log.exception("step hook failed")
            for event in events:
                sink = self._sinks.get(event.request_id)
                if event.result is not None:
                    self._sinks.pop(event.request_id, None)
                    self.recent_e2e = 0.8 * self.recent_e2e + 0.2 * event.result.stats.e2e
                if sink is not None:
                    sink(event)

    def _isolate(self) -> list[StreamEvent]:
        """After a failed step: step each running request alone. One that fails alone is failed (its client gets
        the error); the others get the step they were due (the same tokens: rows do not depend on their pass)."""
        events: list[StreamEvent] = []
        for seq in list(self.engine.running):
            try:
                events += self.engine.step(only=seq.request_id)
                self._fail_faults()
            except Exception as exc:
                log.warning("request %s fails alone too (%s): failing it", seq.request_id, type(exc).__name__)
                self.engine.cancel(seq.request_id)
                self._fail(seq.request_id, exc)
        return events

    def _fail_faults(self) -> None:
        for rid, exc in self.engine.faults:
            self._fail(rid, exc)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink(exc)

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every request the loop knows of, running, waiting and still in the inbox."""
        for seq in [*self.engine.running, *self.engine.waiting]:
            self._fail(seq.request_id, exc)
        while True:
            try:
                kind, _, sink = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit" and sink is not None:
                sink(exc)
        for rid in list(self._sinks):
            self._fail(rid, exc)
