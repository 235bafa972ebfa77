"""The server's ``/metrics``: Prometheus text through ``prometheus-client``, named in vLLM's
manner under the ``sparse_jax:`` prefix, every series labelled with ``model_name``.

* Read from the engine at each scrape (:meth:`models.serving.engine.Engine.stats`):
  ``num_requests_running`` / ``num_requests_waiting``, ``kv_blocks_total`` /
  ``kv_blocks_free`` and ``kv_cache_usage_perc`` (the paged engine), the counters
  ``host_blocks_loaded`` (KV blocks copied from the host tier, offloaded), ``num_preemptions``
  and ``engine_steps``.
* Observed as each request ends (:meth:`Engine.add_finish_listener`): ``prompt_tokens`` and
  ``generation_tokens`` counters, ``request_success`` by ``finished_reason`` (stop, length,
  cancelled, error), and the histograms ``time_to_first_token_seconds``,
  ``inter_token_latency_seconds`` (each gap between output tokens) and
  ``e2e_request_latency_seconds`` (arrival to the end).
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from models.serving.requests import Request

PREFIX = "sparse_jax:"

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """The engine's counters as gauges and counters, read at scrape time."""

    def __init__(self, engines, model_name: str):
        self.engines, self.model_name = engines, model_name

    def collect(self):
        stats = [e.stats() for e in self.engines()]
        label = [self.model_name]

        def total(key):
            return sum(s.get(key) or 0 for s in stats)

        def gauge(name, doc, value):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        yield gauge("num_requests_running", "Requests decoding or being prefilled.", total("running"))
        yield gauge("num_requests_waiting", "Requests queued for admission.", total("waiting"))
        if any(s.get("kv_blocks_total") is not None for s in stats):
            blocks, free = total("kv_blocks_total"), total("kv_blocks_free")
            yield gauge("kv_blocks_total", "KV pages in the paged engine's pool (the null page included).", blocks)
            yield gauge("kv_blocks_free", "KV pages free in the pool.", free)
            # the null page is never handed out
            yield gauge("kv_cache_usage_perc", "Fraction of the pool's KV pages in use (0-1).",
                        (blocks - free) / max(blocks - len(stats), 1))
        yield counter("host_blocks_loaded", "KV blocks copied from the host tier (offloaded engines).",
                      total("blocks_loaded"))
        yield counter("num_preemptions", "Requests whose KV pages were taken back (recomputed later).",
                      total("preempted"))
        yield counter("engine_steps", "Decode iterations run.", total("steps"))
        yield gauge("programs_compiling", "Engine programs still compiling in the background (the server's "
                    "precompile; a request that needs one waits for it).", total("programs_compiling"))


class ServerMetrics:
    """The metrics of one server (its own registry): ``render()`` is the ``/metrics`` body.

    ``engine``: an :class:`~models.serving.engine.Engine` or anything with ``engines``
    (:class:`models.serving.replicas.Replicas`), each given a finish listener."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        engines = list(getattr(engine, "engines", None) or [engine])
        self.registry.register(_EngineCollector(lambda: engines, model_name))
        lab = ["model_name"]
        self.model_name = model_name
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the requests that ended.", lab,
                                     registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", lab,
                                         registry=self.registry)
        self.success = Counter(PREFIX + "request_success", "Requests ended, by reason.", lab + ["finished_reason"],
                               registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to the first output token.", lab,
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Gaps between output tokens.", lab,
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the request's end.", lab,
                             buckets=E2E_BUCKETS, registry=self.registry)
        # every series exists from the start, at 0
        for reason in ("stop", "length", "cancelled", "error"):
            self.success.labels(model_name, reason)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
            metric.labels(model_name)
        for e in engines:
            e.add_finish_listener(self.observe)

    def observe(self, r: Request) -> None:
        """Account for request ``r``, which just ended (called on the engine's thread)."""
        m = self.model_name
        now = time.perf_counter()
        if r.t_scheduled is not None:
            self.prompt_tokens.labels(m).inc(r.prompt_len)
        self.generation_tokens.labels(m).inc(len(r.output_ids))
        self.success.labels(m, r.finish_reason or "error").inc()
        if r.t_first is not None and r.output_ids:
            self.ttft.labels(m).observe(max(r.t_first - r.t_arrival, 0.0))
        for a, b in zip(r.token_times, r.token_times[1:]):
            self.itl.labels(m).observe(max(b - a, 0.0))
        self.e2e.labels(m).observe(max(now - r.t_arrival, 0.0))

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
