"""Prometheus text exposition for `/metrics`, under vLLM's metric names where vLLM has one.

So the harness (and any dashboard built for vLLM) reads specwise and vLLM alike: speculative counters
`vllm:spec_decode_num_drafts_total`, `…num_draft_tokens_total`, `…num_accepted_tokens_total`,
`…num_accepted_tokens_per_pos_total{position}`, latency histograms for TTFT, inter-token latency and E2E, and gauges
for running and waiting requests. specwise's own additions are prefixed `specwise_`.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

from specwise.engine.scheduler import StepReport

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for b, c in zip(self.buckets, self.counts, strict=True):
            running += c
            out.append(f'{name}_bucket{{{labels},le="{b}"}} {running}')
        out += [f'{name}_bucket{{{labels},le="+Inf"}} {self.count}', f"{name}_sum{{{labels}}} {self.sum}",
                f"{name}_count{{{labels}}} {self.count}"]
        return out


class Metrics:
    """Counters, gauges and histograms fed by the scheduler's step reports and the server's finished requests."""

    def __init__(self, model_name: str, extra_gauges: Callable[[], dict[str, tuple[str, float]]] | None = None):
        self.labels = f'model_name="{_escape(model_name)}"'
        self._lock = threading.Lock()
        self.num_drafts = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        self.running = self.waiting = self.batch = 0
        self.speculating = 1
        self.switches = 0
        self.steps = {"true": 0, "false": 0}
        self.prompt_tokens = self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft, self.itl, self.e2e = (Histogram(LATENCY_BUCKETS) for _ in range(3))
        self.batch_hist = Histogram(BATCH_BUCKETS)
        self.extra_gauges = extra_gauges

    def on_step(self, report: StepReport) -> None:
        with self._lock:
            self.running, self.waiting, self.batch = report.running, report.waiting, len(report.rows)
            self.switches = report.switches
            self.speculating = int(report.speculating)
            if report.rows:
                self.batch_hist.observe(len(report.rows))
                self.steps["true" if any(d for d, _ in report.rows) else "false"] += 1
            for drafted, accepted in report.rows:
                if drafted:
                    self.num_drafts += 1
                    self.draft_tokens += drafted
                    self.accepted_tokens += accepted
                    self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
                    for i in range(accepted):
                        self.accepted_per_pos[i] += 1

    def on_queue(self, running: int, waiting: int) -> None:
        with self._lock:
            self.running, self.waiting = running, waiting

    def on_request(self, ttft: float | None, itls: list[float], e2e: float, prompt_tokens: int,
                   generation_tokens: int, finish_reason: str) -> None:
        with self._lock:
            if ttft is not None:
                self.ttft.observe(ttft)
            for x in itls:
                self.itl.observe(x)
            self.e2e.observe(e2e)
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1

    def render(self) -> str:
        L = self.labels
        with self._lock:
            out: list[str] = []

            def metric(name: str, kind: str, help_: str, lines: list[str]) -> None:
                out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines])

            metric("vllm:num_requests_running", "gauge", "Requests in the running batch.",
                   [f"vllm:num_requests_running{{{L}}} {self.running}"])
            metric("vllm:num_requests_waiting", "gauge", "Requests waiting to join the batch.",
                   [f"vllm:num_requests_waiting{{{L}}} {self.waiting}"])
            metric("vllm:spec_decode_num_drafts", "counter", "Draft proposals verified (one per request per step).",
                   [f"vllm:spec_decode_num_drafts_total{{{L}}} {self.num_drafts}"])
            metric("vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens proposed.",
                   [f"vllm:spec_decode_num_draft_tokens_total{{{L}}} {self.draft_tokens}"])
            metric("vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.",
                   [f"vllm:spec_decode_num_accepted_tokens_total{{{L}}} {self.accepted_tokens}"])
            metric("vllm:spec_decode_num_accepted_tokens_per_pos", "counter", "Draft tokens accepted at each position.",
                   [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{L},position="{i}"}} {n}'
                    for i, n in enumerate(self.accepted_per_pos)])
            metric("vllm:prompt_tokens", "counter", "Prompt tokens processed.",
                   [f"vllm:prompt_tokens_total{{{L}}} {self.prompt_tokens}"])
            metric("vllm:generation_tokens", "counter", "Tokens generated.",
                   [f"vllm:generation_tokens_total{{{L}}} {self.generation_tokens}"])
            metric("vllm:request_success", "counter", "Finished requests by finish reason.",
                   [f'vllm:request_success_total{{{L},finished_reason="{r}"}} {n}' for r, n in self.finished.items()])
            metric("vllm:time_to_first_token_seconds", "histogram", "Time to first token.",
                   self.ttft.lines("vllm:time_to_first_token_seconds", L))
            metric("vllm:inter_token_latency_seconds", "histogram", "Time between streamed outputs of a request.",
                   self.itl.lines("vllm:inter_token_latency_seconds", L))
            metric("vllm:e2e_request_latency_seconds", "histogram", "End-to-end request latency.",
                   self.e2e.lines("vllm:e2e_request_latency_seconds", L))
            metric("specwise_batch_size", "gauge", "Rows in the last engine step.",
                   [f"specwise_batch_size{{{L}}} {self.batch}"])
            metric("specwise_step_batch_size", "histogram", "Rows per engine step.",
                   self.batch_hist.lines("specwise_step_batch_size", L))
            metric("specwise_speculation_enabled", "gauge", "1 while the load policy lets steps draft.",
                   [f"specwise_speculation_enabled{{{L}}} {self.speculating}"])
            metric("specwise_policy_switches", "counter", "Times the load policy turned drafting off or on.",
                   [f"specwise_policy_switches_total{{{L}}} {self.switches}"])
            metric("specwise_steps", "counter", "Engine steps, by whether any row drafted.",
                   [f'specwise_steps_total{{{L},speculative="{k}"}} {v}' for k, v in self.steps.items()])
        for name, (help_, value) in (self.extra_gauges() if self.extra_gauges else {}).items():
            metric(name, "gauge", help_, [f"{name}{{{L}}} {'NaN' if value != value else value}"])
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
