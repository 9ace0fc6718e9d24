"""Prometheus export of ``KVCacheManager.metrics()`` (OBS-2; names listed in docs/METRICS.md).

``register(manager)`` adds a collector to a ``prometheus_client`` registry; every scrape takes one
``metrics()`` snapshot (no host synchronisation) and exports it under vLLM-style names:
``<prefix>:<name>_total`` counters, ``..._bytes`` and ``..._perc`` gauges, with a
``selection_group``, ``pool_group`` or ``medium`` label where a figure has one.

``prometheus_client`` is an optional extra (``pip install -e .[metrics]``); nothing else in the
library imports this module.
"""
from __future__ import annotations

try:
    from prometheus_client import REGISTRY
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as exc:  # the optional extra
    raise ImportError("torch_kvcm2.metrics needs prometheus_client: pip install -e .[metrics] "
                      "(or pip install prometheus_client)") from exc

__all__ = ["KVCacheCollector", "register"]

#: (metric name without prefix or _total, its path in the snapshot, help) of the unlabelled
#: counters
_COUNTERS = (
    ("kv_flushed_bytes", ("flushed_bytes",), "Bytes written back device to host (flush)."),
    ("kv_host_direct_bytes", ("host_direct_bytes",),
     "Bytes declared written straight to host pages (record_host_write)."),
    ("admissions_refused", ("admissions_refused",), "can_fit calls that answered False."),
    ("num_preemptions", ("preemptions",), "Requests suspended (KVCache.suspend)."),
    ("num_offloads", ("offloads",),
     "Suspends that moved dense pages to the host tier (KVCache.suspend(offload))."),
    ("num_resumes", ("resumes",), "Requests resumed (KVCache.resume)."),
    ("num_aborts", ("aborts",), "Requests whose in-flight tokens were dropped (close, discard)."),
    ("allocations_failed", ("allocations_failed",),
     "Resizes or reserve top-ups the pools could not supply."),
    ("prefix_cache_queries", ("prefix", "queried_tokens"),
     "Prefix-cache queried tokens (create_cache(token_ids))."),
    ("prefix_cache_hits", ("prefix", "hit_tokens"),
     "Prefix-cache hit tokens (shared from committed pages)."),
    ("prefix_cache_requests", ("prefix", "queries"), "create_cache(token_ids) calls."),
    ("prefix_cache_evictions", ("prefix", "evicted_slots"), "Cached prefix slots evicted."),
    ("advance_refused_rows", ("advance", "refused_rows"),
     "Rows Batch.advance refused (past the write watermark)."),
    ("advance_short_rows", ("advance", "short_rows"),
     "Rows Batch.advance stopped at their allocated pages."),
    ("gpu_history_promotions", ("gpu_history", "promotions"),
     "Rows moved onto GPU history pages (their history copied in)."),
    ("gpu_history_demotions", ("gpu_history", "demotions"),
     "Rows moved off GPU history pages under pressure (nothing copied)."),
    ("gpu_history_promoted_bytes", ("gpu_history", "promoted_bytes"),
     "Bytes of history copied host to GPU pages at promotions."),
)


def _at(snapshot: dict, path: tuple):
    for key in path:
        snapshot = snapshot[key]
    return snapshot

class KVCacheCollector:
    """A ``prometheus_client`` collector of one manager (use ``register``)."""

    def __init__(self, manager, prefix: str = "torch_kvcm2"):
        self.manager, self.prefix = manager, prefix

    def _name(self, name: str) -> str:
        return f"{self.prefix}:{name}" if self.prefix else name

    def describe(self):
        return []  # names depend on the snapshot; nothing is checked at registration

    def collect(self):
        if self.manager.closed:
            return
        m = self.manager.metrics()
        name = self._name
        groups = m["selection_groups"]
        for key, help_text in (("hits", "Selected units found resident."),
                               ("misses", "Selected units fetched host to device."),
                               ("invalid", "Selected units outside the row (ignored).")):
            family = CounterMetricFamily(name(f"sparse_{key}"), help_text,
                                         labels=["selection_group"])
            for group, values in groups.items():
                family.add_metric([group], values[key])
            yield family
        family = CounterMetricFamily(name("kv_fetched_bytes"),
                                     "Bytes fetched host to device (misses x bytes per unit).",
                                     labels=["selection_group"])
        for group, values in groups.items():
            family.add_metric([group], values["fetched_bytes"])
        yield family
        for metric, path, help_text in _COUNTERS:
            yield CounterMetricFamily(name(metric), help_text, value=_at(m, path))
        yield from self._gauges(m)

    def _gauges(self, m: dict):
        name = self._name
        pools = m["pool_groups"]
        for key, help_text in (("used", "Bytes of slots referenced by a request."),
                               ("cached", "Bytes of cached prefix slots (reclaimable)."),
                               ("total", "Bytes of all slots."),
                               ("committed", "Bytes committed (host region: populated).")):
            family = GaugeMetricFamily(name(f"kv_pool_{key}_bytes"), help_text,
                                       labels=["pool_group", "medium"])
            for pool in pools:
                family.add_metric([str(pool["index"]), pool["medium"]], pool[f"{key}_bytes"])
            yield family
        usage = GaugeMetricFamily(name("kv_cache_usage_perc"),
                                  "Fraction of slots referenced by a request (0..1).",
                                  labels=["pool_group", "medium"])
        for pool in pools:
            total = pool["total_bytes"]
            usage.add_metric([str(pool["index"]), pool["medium"]],
                             pool["used_bytes"] / total if total else 0.0)
        yield usage
        for key, help_text in (("used", "Bytes of referenced slots, per medium."),
                               ("total", "Bytes of all slots, per medium."),
                               ("batch", "Bytes of the batch reserve in use, per medium.")):
            family = GaugeMetricFamily(name(f"kv_{key}_bytes"), help_text, labels=["medium"])
            for medium, values in m["media"].items():
                family.add_metric([medium], values[f"{key}_bytes"])
            yield family
        yield GaugeMetricFamily(name("prefix_cache_cached_bytes"),
                                "Bytes of committed prefix pages no request references.",
                                value=m["cached_prefix_bytes"])
        yield GaugeMetricFamily(name("num_rows_seated"), "Requests seated in an open batch.",
                                value=m["rows"]["seated"])
        yield GaugeMetricFamily(name("num_rows_suspended"),
                                "Seated requests that are suspended (no lease).",
                                value=m["rows"]["suspended"])
        yield GaugeMetricFamily(name("num_rows_gpu_history"),
                                "Seated requests whose sparse history is on GPU pages.",
                                value=m["gpu_history"]["rows"])
        yield GaugeMetricFamily(name("gpu_history_bytes"),
                                "GPU bytes the rows' GPU-resident history pages hold.",
                                value=m["gpu_history"]["bytes"])


def register(manager, registry=None, prefix: str = "torch_kvcm2") -> KVCacheCollector:
    """Register a collector of ``manager``'s ``metrics()`` with ``registry`` (default: the
    global ``prometheus_client.REGISTRY``); names start with ``prefix:`` (none when empty).
    Returns the collector (``registry.unregister(collector)`` removes it). A closed manager
    exports nothing."""
    collector = KVCacheCollector(manager, prefix)
    (REGISTRY if registry is None else registry).register(collector)
    return collector
