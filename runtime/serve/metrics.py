"""Prometheus metrics, one registry per app (so several apps can live in one process, as in the
tests), and the middleware that counts every HTTP request by endpoint and final status."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from .pool import Result, WorkerPool

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _PoolCollector:
    """Reads the pool's own counts at scrape time, so the pool needs no metrics code."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def collect(self):
        p = self.pool
        yield GaugeMetricFamily("eagle2_queue_depth", "requests waiting for a worker", value=p.waiting)
        yield GaugeMetricFamily("eagle2_workers_busy", "workers running a generation", value=p.busy)
        yield GaugeMetricFamily("eagle2_workers", "workers (Generators) in this process", value=len(p.generators))
        if p.scheduler is not None:
            decoding, waiting = p.scheduler.load
            yield GaugeMetricFamily("eagle2_batch_sequences", "generations decoding side by side", value=decoding)
            yield GaugeMetricFamily("eagle2_batch_waiting", "generations waiting for a sequence slot", value=waiting)
            yield GaugeMetricFamily("eagle2_kv_cache_positions", "positions each sequence slot's KV cache holds now",
                                    value=p.scheduler.engine.base.capacity)
            yield CounterMetricFamily("eagle2_batch_steps", "base steps run by the scheduler", value=p.scheduler.steps)
        caches = [g.prefix_cache.stats() for g in {id(g): g for g in p.generators}.values() if g.prefix_cache]
        if caches:
            total = {k: sum(c[k] for c in caches) for k in ("hit_tokens", "prompt_tokens", "lookups", "hits", "bytes",
                                                            "budget_bytes", "blocks", "evicted")}
            yield CounterMetricFamily("eagle2_prefix_cache_hit_tokens", "prompt tokens whose caches were reused",
                                      value=total["hit_tokens"])
            yield CounterMetricFamily("eagle2_prefix_cache_prompt_tokens", "prompt tokens looked up in the prefix cache",
                                      value=total["prompt_tokens"])
            yield GaugeMetricFamily("eagle2_prefix_cache_hit_rate", "reused prompt tokens / prompt tokens looked up",
                                    value=total["hit_tokens"] / max(total["prompt_tokens"], 1))
            yield CounterMetricFamily("eagle2_prefix_cache_hits", "prompts that reused a stored prefix",
                                      value=total["hits"])
            yield GaugeMetricFamily("eagle2_prefix_cache_bytes", "host memory the stored prefixes take",
                                    value=total["bytes"])
            yield GaugeMetricFamily("eagle2_prefix_cache_budget_bytes", "the prefix cache's budget",
                                    value=total["budget_bytes"])
            yield GaugeMetricFamily("eagle2_prefix_cache_blocks", "stored blocks", value=total["blocks"])
            yield CounterMetricFamily("eagle2_prefix_cache_evicted_blocks", "blocks evicted to stay within budget",
                                      value=total["evicted"])
        yield CounterMetricFamily("eagle2_cancelled_generations",
                                  "generations cancelled: the client left, or the drain timed out", value=p.cancelled)


class Metrics:
    def __init__(self, pool: WorkerPool):
        r = self.registry = CollectorRegistry()
        r.register(_PoolCollector(pool))
        self.requests = Counter("eagle2_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("eagle2_prompt_tokens", "prompt tokens of completed requests", registry=r)
        self.generated_tokens = Counter("eagle2_generated_tokens", "tokens generated", registry=r)
        self.tokens_per_s = Histogram("eagle2_tokens_per_second", "decode speed per request after its first token",
                                      buckets=(5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000), registry=r)
        self.tau = Histogram("eagle2_acceptance_length", "mean tokens per verify cycle (tau) per request",
                             buckets=(1, 1.25, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8), registry=r)
        self.ttft = Histogram("eagle2_time_to_first_token_seconds", "request arrival to first text sent",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("eagle2_request_latency_seconds", "request arrival to last byte of a generation",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)

    def record(self, endpoint: str, prompt_tokens: int, result: Result, elapsed: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(result.completion_tokens)
        self.latency.labels(endpoint).observe(elapsed)
        # Both are 0 for an answer that ended on the prefill's token (no verify cycle, nothing to time).
        if result.eagle["tau"]:
            self.tau.observe(result.eagle["tau"])
        if result.eagle["tokens_per_s"]:
            self.tokens_per_s.observe(result.eagle["tokens_per_s"])

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CountRequests:
    """Counts every HTTP request by endpoint and final status. Plain ASGI so that it sees the status a
    streamed response really sent, and the mark the app leaves in the scope when the client left
    (counted as 499)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else "other"
            code = 499 if scope.get("state", {}).get("client_gone") else status["code"]
            self.metrics.requests.labels(endpoint, str(code)).inc()
