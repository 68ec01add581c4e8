"""The Grafana dashboard: the file is what its script writes, every metric a panel queries
is one a real router exports, and every metric the router exports has a panel."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import LoopCounter, LoopHistogram
from scripts import grafana_dashboard
from testbed.fake_kv_cache import FakePrefixCache
from testbed.fake_vllm import Fabric, FakeVLLM, start
from tests.conftest import serve_router, until

SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(grafana_dashboard.OUTPUT.read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL the dashboard runs: the panels' and the template variables'."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    return exprs + [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def metric_names(expr: str) -> set[str]:
    """The metrics a query selects (`name{...}`, and any pdproxy_ word), histogram series
    reduced to the histogram's name."""
    names = {name for name, _ in SELECTOR.findall(expr)} | set(re.findall(r"\bpdproxy\w*", expr))
    return {HISTOGRAM_SERIES.sub("", name) for name in names}


def touch_every_series(metrics: Any) -> None:
    """A labeled metric has no series until a label set is used: use one on each."""
    for metric in vars(metrics).values():
        if isinstance(metric, Counter | Gauge | Histogram | LoopCounter | LoopHistogram) \
                and metric._labelnames:
            metric.labels(*("x" for _ in metric._labelnames))


async def scrape_router() -> str:
    """/metrics of a router serving one request through a fake P and D, P balanced
    kv_aware with its KV events followed (so the KV index's series exist too)."""
    fabric = Fabric()
    cache = FakePrefixCache(num_blocks=16, block_size=16)
    cache.start()
    started = [await start(FakeVLLM("prefill", fabric=fabric, kv_cache=cache)),
               await start(FakeVLLM("decode", fabric=fabric))]
    try:
        (_, p_url), (_, d_url) = started
        async with serve_router(prefill=[p_url], decode=[d_url],
                                balance={"prefill": "kv_aware"}) as (url, app):
            index = app.state.router.kv_index
            await until(lambda: index.sources(p_url), "P's KV events followed")
            async with httpx.AsyncClient(base_url=url) as client:
                body = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                touch_every_series(app.state.router.metrics)
                return (await client.get("/metrics")).text
    finally:
        for runner, _ in started:
            await runner.cleanup()
        await cache.aclose()


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """The names of the metrics the router exports, histogram series reduced to the
    histogram's name (`_created` series, the time a series began, are not charted)."""
    families = list(text_string_to_metric_families(asyncio.run(scrape_router())))
    names = set()
    for family in families:
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                names.add(HISTOGRAM_SERIES.sub("", sample.name))
    empty = [f.name for f in families if not f.samples]
    assert not empty, f"metrics without a series after touching every one: {empty}"
    assert "pdproxy_requests_total" in names and "pdproxy_endpoint_healthy" in names
    return names


def test_file_is_what_the_script_writes(tmp_path: Path) -> None:
    assert load() == grafana_dashboard.dashboard()
    assert grafana_dashboard.main(["--check"]) == 0
    stale = tmp_path / "dashboard.json"
    assert grafana_dashboard.main(["--check", "--output", str(stale)]) == 1  # missing
    stale.write_text(grafana_dashboard.render().replace("Requests by status", "Requests"))
    assert grafana_dashboard.main(["--check", "--output", str(stale)]) == 1
    assert grafana_dashboard.main(["--output", str(stale)]) == 0
    assert grafana_dashboard.main(["--check", "--output", str(stale)]) == 0


def test_metric_names_finds_every_selector() -> None:
    expr = ('histogram_quantile(0.9, sum by (le, mode) (rate(pdproxy_a_seconds_bucket{job=~"$job"}'
            '[5m]))) / sum(rate(pdproxy_b_total{x="y"}[5m])) + pdproxy_bare + up{}')
    assert metric_names(expr) == {"pdproxy_a_seconds", "pdproxy_b_total", "pdproxy_bare", "up"}


def test_every_queried_metric_is_exported(exported: set[str]) -> None:
    for expr in queries(load()):
        referenced = metric_names(expr)
        assert referenced, f"no metric in {expr!r}"
        assert referenced <= exported, f"{expr!r} queries {referenced - exported}, not exported"


def test_every_exported_metric_has_a_panel(exported: set[str]) -> None:
    charted = set().union(*(metric_names(t["expr"]) for p in panels(load()) for t in p["targets"]))
    assert exported - charted == set(), "metrics no panel shows"


def test_panels_are_described_and_select_the_chosen_routers() -> None:
    dashboard = load()
    assert dashboard["schemaVersion"] == 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= variables.keys()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert all(p["title"].strip() for p in dashboard["panels"])
    for panel in panels(dashboard):
        assert panel["description"].strip() and "\n" not in panel["description"], panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            for name, matchers in SELECTOR.findall(target["expr"]):
                assert '$job' in matchers and '$instance' in matchers, (panel["title"], name)
