"""`/metrics` through `prometheus_client`, under vLLM's metric names where vLLM has one.

So the harness (and any dashboard built for vLLM) reads specwise and vLLM alike: speculative counters
`vllm:spec_decode_num_drafts_total`, `…num_draft_tokens_total`, `…num_accepted_tokens_total`,
`…num_accepted_tokens_per_pos_total{position}`, latency histograms for TTFT, inter-token latency and E2E, and gauges
for running and waiting requests; the library adds the standard process and Python metrics. specwise's own additions
are prefixed `specwise_`. Each server has a registry of its own (tests run several in one process).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from specwise.engine.scheduler import StepReport
from specwise.policy import PolicyChange

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

prometheus_client.disable_created_metrics()  # no `_created` series beside every counter, as vLLM


Gauges = Callable[[], dict[str, tuple[str, float]]]


class _ExtraGauges(Collector):
    """Gauges computed when scraped (the drift monitor's, the suffix history's), each with the model label."""

    def __init__(self, model_name: str, sources: list[Gauges]):
        self.model_name, self.sources = model_name, sources

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for source in self.sources:
            for name, (help_, value) in source().items():
                g = GaugeMetricFamily(name, help_, labels=["model_name"])
                g.add_metric([self.model_name], value)
                yield g


class Metrics:
    """Counters, gauges and histograms fed by the scheduler's step reports and the server's finished requests."""

    def __init__(self, model_name: str, extra_gauges: Gauges | None = None):
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.model_name = model_name
        self._extra = _ExtraGauges(model_name, [extra_gauges] if extra_gauges else [])
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

        def counter(name: str, help_: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, help_, [*m, *labels], registry=r)

        def gauge(name: str, help_: str) -> Gauge:
            return Gauge(name, help_, m, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to join the batch.")
        self.num_drafts = counter(
            "vllm:spec_decode_num_drafts", "Draft proposals verified (one per request per step)."
        ).labels(model_name)
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.").labels(model_name)
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(
            model_name
        )
        self.accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position.", ("position",)
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.").labels(model_name)
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.").labels(model_name)
        # vLLM's prefix-cache pair, in tokens: a prompt's start read from its slot's rows (Engine._admit) is a hit
        self.cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the cache.").labels(
            model_name
        )
        self.cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens read from the cache.").labels(model_name)
        self.finished = counter("vllm:request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", m, buckets=LATENCY_BUCKETS, registry=r
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between streamed outputs of a request.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", m, buckets=LATENCY_BUCKETS, registry=r
        ).labels(model_name)
        self.batch = gauge("specwise_batch_size", "Rows in the last engine step.")
        self.batch_hist = Histogram(
            "specwise_step_batch_size", "Rows per engine step.", m, buckets=BATCH_BUCKETS, registry=r
        ).labels(model_name)
        self.speculating = gauge("specwise_speculation_enabled", "1 while the load policy lets steps draft.")
        self.speculating.set(1)
        self.switches = counter("specwise_policy_switches", "Times the load policy turned drafting off or on.").labels(
            model_name
        )
        self.steps = counter("specwise_steps", "Engine steps, by whether any row drafted.", ("speculative",))
        for flag in ("true", "false"):
            self.steps.labels(model_name, flag)
        self._switches_seen = 0
        self.policy_changes = counter("specwise_policy_changes", "Load policy replaced at run time, by whom.", ("by",))
        for by in ("admin", "drift"):
            self.policy_changes.labels(model_name, by)
        r.register(self._extra)  # last: the drift gauges follow the engine's in the exposition

    def add_gauges(self, source: Gauges) -> None:
        """Gauges computed at each scrape: `source()` → {name: (help, value)}."""
        self._extra.sources.append(source)

    def on_step(self, report: StepReport) -> None:
        self.running.set(report.running)
        self.waiting.set(report.waiting)
        self.batch.set(len(report.rows))
        self.speculating.set(int(report.speculating))
        if report.switches > self._switches_seen:  # the scheduler reports its running total
            self.switches.inc(report.switches - self._switches_seen)
            self._switches_seen = report.switches
        if report.rows:
            self.batch_hist.observe(len(report.rows))
            self.steps.labels(self.model_name, "true" if any(d for d, _ in report.rows) else "false").inc()
        for drafted, accepted in report.rows:
            if drafted:
                self.num_drafts.inc()
                self.draft_tokens.inc(drafted)
                self.accepted_tokens.inc(accepted)
                for i in range(drafted):  # every drafted position has a series, accepted or not
                    self.accepted_per_pos.labels(self.model_name, str(i)).inc(1 if i < accepted else 0)

    def on_policy(self, change: PolicyChange) -> None:
        self.policy_changes.labels(self.model_name, change.by).inc()

    def on_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def on_request(
        self,
        ttft: float | None,
        itls: list[float],
        e2e: float,
        prompt_tokens: int,
        generation_tokens: int,
        finish_reason: str,
        cached_tokens: int = 0,
    ) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        for x in itls:
            self.itl.observe(x)
        self.e2e.observe(e2e)
        self.prompt_tokens.inc(prompt_tokens)
        self.cache_queries.inc(prompt_tokens)
        self.cache_hits.inc(cached_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.finished.labels(self.model_name, finish_reason).inc()

    def render(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()
