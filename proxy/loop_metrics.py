"""The metrics every request updates: a labelled counter and histogram kept as plain
numbers in dicts, bumped on the event loop's thread only and turned into Prometheus
families when scraped.

prometheus_client's own `Counter` and `Histogram` take a lock and four or five Python
calls per update: a request's updates were 23 of its 474 Python calls (`scripts.bench_path
--calls`). These are compiled with the request path (`pyproject.toml`): an update is then
a C call. They are collectors in prometheus_client's sense (`describe` and `collect`,
which its registry calls by name) without subclassing its `Collector`, which a compiled
class cannot.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from time import time
from typing import cast

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class _LoopMetric:
    """What `LoopCounter` and `LoopHistogram` share: a name, labels, each label set's
    start time (its `_created` series), `labels()` in prometheus_client's way (for
    updates off the request path and for tests) and registration."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._created: dict[tuple[str, ...], float] = {}
        registry.register(cast(Collector, self))

    def labels(self, *values: str) -> _Bound:
        """The series of `values`, bound, and exposed from now on even at 0, as
        prometheus_client's."""
        bound = _Bound(self, values)
        self._expose(values)
        return bound

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def _expose(self, labels: tuple[str, ...]) -> None:
        raise NotImplementedError

    def _family(self) -> Metric:
        raise NotImplementedError


class LoopCounter(_LoopMetric):
    """A labelled counter updated only on the event loop's thread: `inc(labels)` adds to
    a float in a dict (one Python call), read at scrape time. Its exposition is
    prometheus_client's `Counter`'s (`_total` and `_created` per label set)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 registry: CollectorRegistry) -> None:
        self.values: dict[tuple[str, ...], float] = {}
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)
        if not self._labelnames:
            self.inc((), 0.0)  # exposed at 0 from the start, as prometheus_client's

    def inc(self, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        try:
            self.values[labels] += amount
        except KeyError:
            self._created[labels] = time()
            self.values[labels] = amount

    def _expose(self, labels: tuple[str, ...]) -> None:
        self.inc(labels, 0.0)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        created = _created_series()
        for labels, value in list(self.values.items()):
            family.add_metric(labels, value, created=self._created[labels] if created else None)
        yield family


class LoopHistogram(_LoopMetric):
    """A labelled histogram updated only on the event loop's thread: `observe(labels,
    value)` bumps one bucket's count and the sum in a list (one Python call and a
    bisect), made cumulative at scrape time. Its exposition is prometheus_client's
    `Histogram`'s."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self._bounds = tuple(float(b) for b in buckets)  # +Inf is the last count's
        # per label set: a count per bucket (value <= bound, the first that holds), the
        # +Inf bucket's, then the sum of the values
        self.series: dict[tuple[str, ...], list[float]] = {}
        super().__init__(name, documentation, labelnames, registry)

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        series = self.series.get(labels) or self._start(labels)
        # The first bucket whose bound is not below `value`, as `bisect.bisect_left`
        # finds it (searched here: calling it was 650 instructions an observation more,
        # callgrind, three observations a request)
        bounds = self._bounds
        low, high = 0, len(bounds)
        while low < high:
            middle = (low + high) // 2
            if bounds[middle] < value:
                low = middle + 1
            else:
                high = middle
        series[low] += 1
        series[-1] += value

    def _expose(self, labels: tuple[str, ...]) -> None:
        if labels not in self.series:
            self._start(labels)

    def _start(self, labels: tuple[str, ...]) -> list[float]:
        self._created[labels] = time()
        series = self.series[labels] = [0.0] * (len(self._bounds) + 2)
        return series

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = self._family()
        les = [floatToGoString(b) for b in self._bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        created = _created_series()
        for labels, series in list(self.series.items()):
            cumulative, buckets = 0.0, []
            for le, count in zip(les, series[:-1], strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(labels, buckets, series[-1])
            if created:
                family.add_sample(f"{self._name}_created",
                                  dict(zip(self._labelnames, labels, strict=True)),
                                  self._created[labels])
        yield family


def _created_series() -> bool:
    """Whether `_created` series are exposed: prometheus_client's own switch
    (PROMETHEUS_DISABLE_CREATED_SERIES, `disable_created_metrics()`), as its metrics do."""
    return bool(getattr(prometheus_metrics, "_use_created", True))


class _Bound:
    """One series of a `LoopCounter` or `LoopHistogram`."""

    __slots__ = ("_metric", "_labels")

    def __init__(self, metric: _LoopMetric, labels: tuple[str, ...]) -> None:
        if len(labels) != len(metric._labelnames):
            raise ValueError(f"{metric._name}: {len(metric._labelnames)} label values "
                             f"expected, got {len(labels)}")
        self._metric = metric
        self._labels = labels

    def inc(self, amount: float = 1.0) -> None:
        assert isinstance(self._metric, LoopCounter)
        self._metric.inc(self._labels, amount)

    def observe(self, value: float) -> None:
        assert isinstance(self._metric, LoopHistogram)
        self._metric.observe(self._labels, value)
