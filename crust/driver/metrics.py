"""The driver's storage metrics, read from its catalog at each scrape."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY

from crust.driver.catalog import Catalog


class PoolCollector:
    """Capacity, free bytes and volumes of each pool this controller knows
    (one per node; in distributed mode just this node's)."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def collect(self):
        capacity = GaugeMetricFamily("crust_driver_pool_capacity_bytes",
                                     "Bytes a node's pool offers for volumes and snapshots", labels=["node"])
        free = GaugeMetricFamily("crust_driver_pool_free_bytes",
                                 "Bytes of a node's pool not yet promised to a volume or snapshot", labels=["node"])
        volumes = GaugeMetricFamily("crust_driver_volumes", "Volumes whose backing file is in a node's pool",
                                    labels=["node"])
        counts: dict[str, int] = {}
        for volume in self.catalog.volumes.values():
            counts[volume.node] = counts.get(volume.node, 0) + 1
        for node, pool in sorted(self.catalog.pools().items()):
            capacity.add_metric([node], pool.capacity_bytes)
            free.add_metric([node], self.catalog.available(pool))
            volumes.add_metric([node], counts.get(node, 0))
        yield capacity
        yield free
        yield volumes


def register(catalog: Catalog) -> PoolCollector:
    collector = PoolCollector(catalog)
    REGISTRY.register(collector)
    return collector
