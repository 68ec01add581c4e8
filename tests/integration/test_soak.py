"""The soak test (`scripts/soak.py`) in small: a few hundred requests through the router
while the fakes inject faults; no bad answer, no hang, no unexplained error, no leak. Also
the fakes' random faults themselves, and that the soak does fail when it should."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.metrics import RouterMetrics
from proxy.pool.endpoints import Endpoint
from proxy.upstream.http11 import ConnectionCounts
from scripts.soak import LoopLag, Outcome, SoakOptions, classify, connection_leaks, run_soak
from testbed.fake_vllm import FAULT_KINDS, MODEL, FakeVLLM, start


def small(tmp_path: Path, **options: Any) -> SoakOptions:
    values: dict[str, Any] = {"requests": 400, "concurrency": 16, "fault_rate": 0.1, "seed": 11,
                              "fault_slow_s": 0.2, "progress": 0, "out": tmp_path / "soak.json",
                              **options}  # fmt: skip
    return SoakOptions(**values)


async def test_soak_with_faults_has_no_bad_answer_hang_or_leak(tmp_path: Path) -> None:
    report = await run_soak(small(tmp_path, fault_kinds=list(FAULT_KINDS)))
    outcomes = report["outcomes"]
    assert sum(outcomes.values()) == 400
    assert outcomes["hang"] == 0, report["examples"]["hang"]
    assert outcomes["bad"] == 0, report["examples"]["bad"]
    assert report["unexplained"] == 0, report["examples"]["unexplained"]
    assert report["leaks"] == {}
    assert report["faulted_requests"] > 0 and sum(report["faults_injected"].values()) > 0
    assert outcomes["clean_error"] > 0  # the faults really reached clients
    assert report["passed"] and (tmp_path / "soak.json").exists()


async def test_soak_garbage_from_decode_is_a_clean_error(tmp_path: Path) -> None:
    report = await run_soak(small(tmp_path, requests=200, fault_rate=0.3, fault_kinds=["garbage"]))
    assert report["faults_injected"].get("decode:garbage", 0) > 0
    assert report["outcomes"]["bad"] == 0, report["examples"]["bad"]


async def test_soak_reports_a_leaked_in_flight_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A lease taken on every server as the router starts, and never given back (the
    # legs themselves are compiled code: their `with` calls no attribute a test can patch)
    watch = RouterMetrics.watch_endpoints

    def leak_a_lease(metrics: RouterMetrics, endpoints: Callable[[], Iterable[Endpoint]]) -> None:
        for endpoint in endpoints():
            endpoint.in_flight += 1
        watch(metrics, endpoints)

    monkeypatch.setattr(RouterMetrics, "watch_endpoints", leak_a_lease)
    report = await run_soak(small(tmp_path, requests=20, fault_rate=0.0, settle=0.3))
    assert report["outcomes"]["ok"] == 20
    assert report["leaks"]["in_flight"] and not report["passed"]


async def test_soak_counts_a_request_past_its_deadline_as_a_hang(tmp_path: Path) -> None:
    report = await run_soak(small(tmp_path, requests=10, fault_rate=0.0, deadline=1e-4))
    assert report["outcomes"]["hang"] == 10
    assert report["unexplained"] == 10 and not report["passed"]
    assert report["leaks"] == {}  # the router let go of every abandoned request


@pytest.mark.parametrize(
    ("status", "content_type", "body", "stream", "expected"),
    [
        (200, "application/json", b'{"choices": [{"text": "a"}]}', False, "ok"),
        (502, "application/json", b'{"error": {"message": "P broke off"}}', False, "clean_error"),
        (502, "text/plain", b"Bad Gateway", False, "bad"),
        (200, "application/json", b'{"id": "x"}', False, "bad"),
        (200, "text/event-stream", b'data: {"choices": []}\n\n', True, "bad"),
        (200, "text/event-stream", b'data: {"choices": [{}]}\n\ndata: [DONE]\n\n', True, "ok"),
        (200, "text/event-stream",
         b'data: {"choices": [{}]}\n\ndata: {"error": {"message": "cut"}}\n\ndata: [DONE]\n\n',
         True, "clean_error"),
        (200, "text/event-stream", b'data: {"choices": [{}]}\n\ndata: [DO', True, "bad"),
        (200, "application/json", b'{"choices": [{}]}', True, "bad"),
    ],
)  # fmt: skip
def test_classify(status: int, content_type: str, body: bytes, stream: bool, expected: str) -> None:
    assert classify(status, content_type, body, stream)[0] == expected


def test_only_a_stall_the_machine_caused_excuses_a_request_in_flight() -> None:
    lag = LoopLag()
    lag.stalls = [(10.0, 15.0, 0.1), (30.0, 35.0, 4.9)]  # descheduled; then busy in-process

    def sent(at: float, seconds: float) -> Outcome:
        return Outcome("r", "/v1/completions", False, "pull", sent_at=at, seconds=seconds)
    assert lag.descheduled(sent(9.0, 6.0)) and lag.descheduled(sent(14.0, 2.0))
    assert not lag.descheduled(sent(5.0, 4.0)) and not lag.descheduled(sent(16.0, 1.0))
    assert not lag.descheduled(sent(29.0, 6.0))  # code blocked the loop: maybe the router's


async def _send(url: str, n: int, *, stream: bool = False) -> list[int | None]:
    """n requests; the status of each (None: no answer, the connection dropped)."""
    statuses: list[int | None] = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            body = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 4, "stream": stream}
            try:
                async with session.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()
                    statuses.append(r.status)
            except aiohttp.ClientError:
                statuses.append(None)
    return statuses


async def test_fake_without_fault_rate_injects_nothing() -> None:
    fake = FakeVLLM("decode", seed=1)
    runner, url = await start(fake)
    try:
        assert await _send(url, 30) == [200] * 30
    finally:
        await runner.cleanup()
    assert len(fake.seen) == 30 and all(s.fault is None and s.outcome == "ok" for s in fake.seen)


async def test_fake_with_fault_rate_one_injects_into_every_request() -> None:
    fake = FakeVLLM("prefill", seed=1)
    fake.behavior.fault_rate = 1.0
    fake.behavior.fault_slow_s = 0.01
    runner, url = await start(fake)
    try:
        await _send(url, 40)
    finally:
        await runner.cleanup()
    faults = [s.fault for s in fake.seen]
    assert len(faults) == 40 and all(f in FAULT_KINDS and f != "cut_stream" for f in faults)
    assert set(faults) == set(FAULT_KINDS) - {"cut_stream"}  # cut_stream: a D stream only


async def test_fake_faults_are_one_kind_per_request_and_seeded() -> None:
    runs = []
    for _ in range(2):
        fake = FakeVLLM("decode", seed=5)
        fake.behavior.fault_rate = 0.5
        fake.behavior.fault_kinds = ["status_500", "cut_stream"]
        runner, url = await start(fake)
        try:
            statuses = await _send(url, 30, stream=True)
        finally:
            await runner.cleanup()
        runs.append([s.fault for s in fake.seen])
        for seen, status in zip(fake.seen, statuses, strict=True):
            assert (status == 500) == (seen.fault == "status_500")  # and only that request
            assert (seen.outcome == "ok") == (seen.fault is None)
    assert runs[0] == runs[1] and None in runs[0] and len(set(runs[0])) == 3


def test_the_leak_check_names_each_way_a_connection_can_be_left() -> None:
    assert connection_leaks(ConnectionCounts(open=3, idle=3, slots=3), at_the_fakes=3) == {
        "upstream_connections_in_use": 0, "upstream_slots_without_connection": 0,
        "upstream_connections_unknown_to_the_router": 0}
    # one held by a request that ended, a slot kept after its connection closed, and two
    # connections the fakes hold that no pool knows
    assert connection_leaks(ConnectionCounts(open=3, idle=2, slots=4), at_the_fakes=5) == {
        "upstream_connections_in_use": 1, "upstream_slots_without_connection": 1,
        "upstream_connections_unknown_to_the_router": 2}
