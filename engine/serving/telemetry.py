"""Prometheus metrics of one manager (the app's /metrics, ui/metrics.py serves them).

Recorded in the process that holds the manager (the web server): every request's outcome and timings
reach it over the worker protocol (GenerateResult, its Timings, or the error), so the figures of every
worker process are counted once, here, and nothing is shared through files. What the engines are (bucket
states, compile seconds, memory, queue depth) is read from the engines' status rows and the host's status
when the metrics are scraped, by a custom collector. Each manager has its own CollectorRegistry, so two apps (or
two tests) in one process never mix their figures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.errors import (
    BudgetExceeded,
    Cancelled,
    DeviceUnavailable,
    EngineBusy,
    InvalidRequest,
    NotAllowed,
    UnsupportedCombination,
)

__all__ = ["CONTENT_TYPE_LATEST", "Telemetry"]

GIB = 2**30
# Seconds: a warm tiny-model step is milliseconds, a cold bucket served while compiling or a real model
# on a CPU tens of seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
# Why a request was refused, by the error the engine raised (the first match wins).
REFUSALS = (
    (NotAllowed, "not_offered"),
    (BudgetExceeded, "no_room"),
    (EngineBusy, "busy"),
    (UnsupportedCombination, "unsupported"),
    (DeviceUnavailable, "device_unavailable"),
    (InvalidRequest, "invalid"),
)


def outcome_of(error: BaseException | None) -> tuple[str, str]:
    """(outcome, reason): ok, cancelled, refused with its reason, or failed (the reason is its class)."""
    if error is None:
        return "ok", ""
    if isinstance(error, Cancelled):
        return "cancelled", ""
    for cls, reason in REFUSALS:
        if isinstance(error, cls):
            return "refused", reason
    return "failed", type(error).__name__


class Telemetry:
    """The manager's metrics: `request_ended` after each request; `scrape()` the exposition text. `status`: a
row per engine (Residency.status_rows), `host_status`: the host's view (EngineManager.host_status); without
them only the counters and the web edge's refusals are exported."""

    def __init__(self, status: Callable[[], list[dict]] | None = None, host_status: Callable[[], dict] | None = None):
        self.status, self.host_status = status, host_status
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "showcase_requests", "Generate requests by engine, mode, bucket and outcome (ok, cancelled, refused, "
            "failed); reason: why refused (not_offered, no_room, busy, unsupported, device_unavailable, invalid) "
            "or the error's class when failed. engine/mode/bucket are empty when the request never got that far.",
            ["engine", "mode", "bucket", "outcome", "reason"], registry=r)
        self.queue_wait = Histogram("showcase_queue_wait_seconds", "Time a request waited in its engine's queue.",
                                    ["engine", "bucket"], buckets=LATENCY_BUCKETS, registry=r)
        self.denoise = Histogram("showcase_denoise_seconds", "Denoising loop time of a served request.",
                                 ["engine", "bucket"], buckets=LATENCY_BUCKETS, registry=r)
        self.total = Histogram("showcase_request_seconds", "Total engine time of a served request (encode, "
                               "denoise, decode).", ["engine", "bucket"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("showcase_batch_size", "Requests in the pipeline call that served a request.",
                               ["engine"], buckets=BATCH_BUCKETS, registry=r)
        self.recompiles = Counter("showcase_recompiles", "Graphs compiled while requests ran (0 at a warm bucket).",
                                  ["engine", "mode", "bucket"], registry=r)
        self.eager_fallbacks = Counter("showcase_eager_fallbacks", "Requests for a compiled mode served eagerly "
                                       "because their bucket was not warm yet.", ["engine", "mode", "bucket"],
                                       registry=r)
        # Labels come from closed sets (engines, modes, buckets, kinds): a step cache is labelled by its kind,
        # never by its parameters, which a visitor picks freely (each distinct value would add series).
        self.cache_hits = Counter("showcase_step_cache_hits", "Denoiser steps served from a step cache, by "
                                  "its kind.", ["engine", "step_cache"], registry=r)
        self.cache_misses = Counter("showcase_step_cache_misses", "Denoiser steps computed by requests that "
                                    "had a step cache, by its kind.", ["engine", "step_cache"], registry=r)
        # reason -> visitors refused at the web edge (ui/edge.py sets it: body size, uploads, per client, ...)
        self.edge_refusals: Callable[[], Mapping[str, int]] | None = None
        # kind -> the web server's unexpected failures of visitors' requests (ui/quietlog.py counts them)
        self.unexpected_errors: Callable[[], Mapping[str, int]] | None = None
        r.register(self)  # the gauges below (`collect`), read when scraped

    def request_ended(self, labels: Mapping[str, str], result=None, error: BaseException | None = None) -> None:
        """Count one request: `labels` (engine, mode, bucket) as far as it got, its result or its error."""
        outcome, reason = outcome_of(error)
        engine, mode, bucket = (str(labels.get(k) or "") for k in ("engine", "mode", "bucket"))
        if result is not None:
            engine, mode, bucket = result.engine, str(result.bucket.mode), result.bucket.shape  # a clip: size and frames
        self.requests.labels(engine, mode, bucket, outcome, reason).inc()
        if result is None:
            return
        t = result.timings
        self.queue_wait.labels(engine, bucket).observe(t.queued_ms / 1000)
        self.denoise.labels(engine, bucket).observe(t.denoise_ms / 1000)
        self.total.labels(engine, bucket).observe(t.total_ms / 1000)
        self.batch.labels(engine).observe(result.batch_size)
        if result.recompiles:
            self.recompiles.labels(engine, mode, bucket).inc(result.recompiles)
        if result.eager_fallback:
            self.eager_fallbacks.labels(engine, mode, bucket).inc()
        if result.step_cache.enabled:
            cache = str(result.step_cache.kind)
            hits = len(result.cached_steps)
            self.cache_hits.labels(engine, cache).inc(hits)
            self.cache_misses.labels(engine, cache).inc(max(0, result.steps - hits))

    def scrape(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)

    # -- a collector of its own: gauges read from the manager when scraped: what is loaded, warm and held now
    def describe(self):
        return []  # families depend on what is loaded; collected at scrape time only

    def collect(self):
        t = self
        if t.edge_refusals is not None:
            edge = CounterMetricFamily("showcase_edge_refusals", "Visitors' HTTP requests refused at the web edge "
                                       "before any handler, by reason.", labels=["reason"])
            for reason, count in sorted(dict(t.edge_refusals()).items()):
                edge.add_metric([reason], count)
            yield edge
        if t.unexpected_errors is not None:
            failed = CounterMetricFamily("showcase_unexpected_errors", "Visitors' requests the web server failed "
                                         "on unexpectedly (each logged in one line), by exception kind.",
                                         labels=["kind"])
            for kind, count in sorted(dict(t.unexpected_errors()).items()):
                failed.add_metric([kind], count)
            yield failed
        if t.status is None or t.host_status is None:
            return
        engines = GaugeMetricFamily("showcase_engines", "Engines by state (loading, ready, failed, evicted, ...).",
                                    labels=["engine", "state"])
        pending = GaugeMetricFamily("showcase_engine_queue_depth", "Requests waiting or running on an engine.",
                                    labels=["engine"])
        buckets = GaugeMetricFamily("showcase_buckets", "Resolution buckets by state (cold, queued, compiling, "
                                    "warm, failed).", labels=["engine", "mode", "state"])
        compile_s = GaugeMetricFamily("showcase_bucket_compile_seconds", "Seconds the bucket's compile took.",
                                      labels=["engine", "mode", "bucket"])
        warmup_s = GaugeMetricFamily("showcase_bucket_warmup_seconds", "Seconds the bucket's warm-up run took.",
                                     labels=["engine", "mode", "bucket"])
        engine_mem = GaugeMetricFamily("showcase_engine_memory_bytes", "Device memory one engine holds (its "
                                       "footprint: on cpu, the worker's resident memory).",
                                       labels=["engine", "device"])
        for row in t.status():
            name = row["engine"]
            engines.add_metric([name, str(row.get("state") or "")], 1)
            pending.add_metric([name], row.get("pending") or 0)
            counts: dict[tuple[str, str], int] = {}
            for b in row.get("buckets") or ():
                counts[(b["mode"], b["state"])] = counts.get((b["mode"], b["state"]), 0) + 1
                if b.get("compile_s") is not None:
                    compile_s.add_metric([name, b["mode"], b["size"]], b["compile_s"])
                if b.get("warmup_s") is not None:
                    warmup_s.add_metric([name, b["mode"], b["size"]], b["warmup_s"])
            for (mode, state), count in sorted(counts.items()):
                buckets.add_metric([name, mode, state], count)
            footprint = row.get("footprint")
            if footprint and row.get("state") != "evicted":
                engine_mem.add_metric([name, name.rsplit("@", 1)[-1].split("/", 1)[0]],
                                      footprint["device_gib"] * GIB)
        yield from (engines, pending, buckets, compile_s, warmup_s, engine_mem)
        host = t.host_status()
        budget = GaugeMetricFamily("showcase_memory_budget_bytes", "Memory the engines of a device may hold.",
                                   labels=["device"])
        used = GaugeMetricFamily("showcase_memory_used_bytes", "Memory the engines of a device hold now (the web "
                                 "server's own counted on the host device).", labels=["device"])
        for device, d in sorted(host["devices"].items()):
            if d.get("budget_gib") is not None:
                budget.add_metric([device], d["budget_gib"] * GIB)
            used.add_metric([device], d["used_gib"] * GIB)
        compiles = host["compiles"]
        scheduler = GaugeMetricFamily("showcase_compiles", "Bucket compiles on this host by state.",
                                      labels=["state"])
        scheduler.add_metric(["running"], len(compiles.get("running") or ()))
        scheduler.add_metric(["queued"], len(compiles.get("queued") or ()))
        evictions = CounterMetricFamily("showcase_evictions", "Engines unloaded to make room or when idle.")
        evictions.add_metric([], host.get("evictions") or 0)
        yield from (budget, used, scheduler, evictions)
        if host.get("cluster"):
            yield from cluster_families(host["cluster"])


def cluster_families(cluster: dict):
    """Under --ray: the cluster's alive nodes and each node's resources (GPU, neuron_cores, TPU, CPU, ...)."""
    nodes = GaugeMetricFamily("showcase_cluster_nodes", "Alive nodes of the Ray cluster the app drives.")
    nodes.add_metric([], len(cluster["nodes"]))
    resources = GaugeMetricFamily("showcase_cluster_node_resource", "A resource a node of the Ray cluster declares.",
                                  labels=["node", "resource", "chips"])
    for node in cluster["nodes"]:
        for name, amount in sorted(node["resources"].items()):
            resources.add_metric([node["name"], name, ",".join(node["chips"])], amount)
    return nodes, resources
