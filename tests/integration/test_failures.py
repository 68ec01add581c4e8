"""The failure rules: a failed leg cancels the other, a client that leaves cancels both,
P without kv_transfer_params is never a silent recompute, and nothing stays in flight."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from testbed.fake_vllm import FakeVLLM, start
from tests.conftest import serve_router, until
from tests.integration.conftest import Pair

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 3}
PREFILL_COORDS = {"engine_id": "engine-p0", "side_channel_host": "127.0.0.1", "side_channel_port": 5601}


def push_config(pair: Pair, **extra: Any) -> dict[str, Any]:
    """Push mode with P's coordinates configured (no probe request to get in the way);
    P's failures reach the client unless `push_recovery` is given."""
    return {"prefill": [{"url": pair.p_url, **PREFILL_COORDS}], "decode": [pair.d_url],
            "mode": "push", "push_recovery": "error", **extra}


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_nothing_in_flight(app: Any) -> None:
    router = app.state.router
    assert router.prefill.in_flight() == 0 and router.decode.in_flight() == 0


async def test_push_prefill_error_cancels_decode_at_once(pair: Pair) -> None:
    pair.prefill.behavior.delay = 0.2
    pair.prefill.behavior.fail_status = 500
    async with serve_router(**push_config(pair)) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            started = time.perf_counter()
            r = await client.post("/v1/completions", json=BODY)
            elapsed = time.perf_counter() - started
        await pair.decode.until(lambda seen: bool(seen) and seen[0].outcome == "cancelled")
        assert_nothing_in_flight(app)
    assert r.status_code == 500  # P's own status and body are relayed
    assert r.json()["error"]["message"] == "injected failure"
    assert elapsed < 5, "D must not be waited out (its push wait would be 30 s)"


async def test_push_prefill_connection_drop_gives_502_and_cancels_decode(pair: Pair) -> None:
    pair.prefill.behavior.drop_connection = True
    async with serve_router(**push_config(pair)) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json={**BODY, "stream": True})
        await pair.decode.until(lambda seen: bool(seen) and seen[0].outcome == "cancelled")
        assert_nothing_in_flight(app)
    assert_openai_error(r, 502)


async def test_push_decode_error_cancels_prefill(pair: Pair) -> None:
    pair.prefill.behavior.delay = 10  # P still computing when D fails
    pair.decode.behavior.fail_status = 503
    async with serve_router(**push_config(pair)) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
        await pair.prefill.until(lambda seen: bool(seen) and seen[0].outcome == "cancelled")
        assert_nothing_in_flight(app)
    assert r.status_code == 503


async def test_pull_prefill_failure_never_reaches_decode(pair: Pair) -> None:
    pair.prefill.behavior.fail_status = 400
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
        assert_nothing_in_flight(app)
    assert r.status_code == 400
    assert pair.decode.seen == []


async def test_prefill_timeout_gives_504(pair: Pair) -> None:
    pair.prefill.behavior.hang = True
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url], timeouts={"prefill": 0.5}) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
        await pair.prefill.until(lambda seen: seen[0].outcome == "cancelled")
        assert_nothing_in_flight(app)
    assert assert_openai_error(r, 504)["type"] == "timeout"


async def test_missing_kv_params_is_an_error_by_default(pair: Pair) -> None:
    pair.prefill.behavior.omit_kv_params = True
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
            metrics = (await client.get("/metrics")).text
    assert "kv_transfer_params" in assert_openai_error(r, 502)["message"]
    assert pair.decode.seen == []
    assert 'pdproxy_missing_kv_transfer_params_total{action="error"} 1.0' in metrics


async def test_missing_kv_params_recompute_is_counted(pair: Pair) -> None:
    pair.prefill.behavior.omit_kv_params = True
    config = {"prefill": [pair.p_url], "decode": [pair.d_url], "missing_kv_params": "recompute"}
    async with serve_router(**config) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
            metrics = (await client.get("/metrics")).text
    assert r.status_code == 200
    assert "kv_transfer_params" not in pair.decode.seen[0].body
    assert 'pdproxy_missing_kv_transfer_params_total{action="recompute"} 1.0' in metrics


async def test_garbage_from_prefill_gives_502(pair: Pair) -> None:
    pair.prefill.behavior.garbage = True
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
    assert_openai_error(r, 502)


async def test_stream_cut_by_decode_ends_with_an_sse_error(pair: Pair) -> None:
    pair.decode.behavior.tokens = 6
    pair.decode.behavior.cut_stream_after = 2
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json={**BODY, "max_tokens": 6, "stream": True})
        assert_nothing_in_flight(app)
    assert r.status_code == 200  # the head went out with the first token
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 4  # two tokens, the error, [DONE]
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"


async def test_decode_unreachable_gives_502(pair: Pair) -> None:
    async with serve_router(prefill=[pair.p_url], decode=["http://127.0.0.1:9"]) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
            metrics = (await client.get("/metrics")).text
        assert_nothing_in_flight(app)
    assert_openai_error(r, 502)
    assert 'pdproxy_upstream_errors_total{cluster="decode",endpoint="http://127.0.0.1:9",kind="connect"} 1.0' in metrics


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_client_leaving_during_prefill_cancels_the_legs(pair: Pair, mode: str) -> None:
    pair.prefill.behavior.delay = 30
    async with serve_router(**push_config(pair, mode=mode)) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            call = asyncio.create_task(client.post("/v1/completions", json=BODY))
            await pair.prefill.until(lambda seen: len(seen) == 1)
            if mode == "push":
                await pair.decode.until(lambda seen: len(seen) == 1)
            call.cancel()  # the client goes away
            await asyncio.gather(call, return_exceptions=True)
        await pair.prefill.until(lambda seen: seen[0].outcome == "cancelled")
        if mode == "push":
            await pair.decode.until(lambda seen: seen[0].outcome == "cancelled")
        else:
            assert pair.decode.seen == []
        # the router's response task accounts for the exchange once it has run
        await until(lambda: not (app.state.router.prefill.in_flight()
                                 or app.state.router.decode.in_flight()), "nothing in flight")
        assert_nothing_in_flight(app)


async def test_client_leaving_mid_stream_cancels_decode(pair: Pair) -> None:
    pair.decode.behavior.tokens = 50
    pair.decode.behavior.token_delay = 0.2
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 50, "stream": True}) as r:
                async for _ in r.aiter_bytes():
                    break  # first token in: leave
        await pair.decode.until(lambda seen: seen[0].outcome == "cancelled")
        assert_nothing_in_flight(app)


@pytest.mark.parametrize("cluster", ["prefill", "decode"])
async def test_unreachable_server_is_replaced_before_any_byte(pair: Pair, cluster: str) -> None:
    dead = "http://127.0.0.1:9"  # nothing listens: the connection is refused
    config = {
        "prefill": [dead, pair.p_url] if cluster == "prefill" else [pair.p_url],
        "decode": [dead, pair.d_url] if cluster == "decode" else [pair.d_url],
    }
    async with serve_router(**config) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            rs = [await client.post("/v1/completions", json={**BODY, "stream": s}) for s in (False, True) * 2]
            metrics = (await client.get("/metrics")).text
        assert_nothing_in_flight(app)
    assert [r.status_code for r in rs] == [200] * 4
    alive = pair.prefill if cluster == "prefill" else pair.decode
    assert len(alive.seen) == 4
    # The dead server was tried (and replaced) at least once; ties are taken in turn.
    assert f'pdproxy_retries_total{{cluster="{cluster}",reason="connect"}}' in metrics


async def test_a_retried_request_leaves_no_exception_behind(pair: Pair) -> None:
    """A leg retried on another server runs its second try inside the handler of the
    first's failure. Compiled, that handler's exception would stay the thread's while the
    request waits, and after it (see `proxy.task_scope`): every later error raised outside
    a handler, in any task or callback, would take it as its cause. Nothing is left."""
    loop = asyncio.get_running_loop()
    seen: list[BaseException | None] = []

    async def exception_seen_by_a_callback() -> BaseException | None:
        read: asyncio.Future[BaseException | None] = loop.create_future()
        loop.call_soon(lambda: read.set_result(sys.exc_info()[1]))
        return await read

    async def request(client: httpx.AsyncClient, stream: bool) -> None:
        before = len(pair.decode.seen)
        pending = asyncio.ensure_future(
            client.post("/v1/completions", json={**BODY, "stream": stream}))
        # while the request is under way (its second leg waits on D) ...
        await pair.decode.until(lambda calls: len(calls) > before)
        seen.append(await exception_seen_by_a_callback())
        assert (await pending).status_code == 200
        seen.append(await exception_seen_by_a_callback())  # ... and after it

    dead = "http://127.0.0.1:9"  # nothing listens: the connection is refused
    async with serve_router(prefill=[pair.p_url], decode=[dead, pair.d_url]) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            for stream in (False, True):
                await request(client, stream)
            metrics = (await client.get("/metrics")).text
    assert 'pdproxy_retries_total{cluster="decode",reason="connect"}' in metrics, "no retry"
    assert seen == [None] * 4


# --- push recovery: P fails before D's first byte, the client still gets its answer ----


@contextlib.asynccontextmanager
async def failing_prefill_and_another(pair: Pair, **config: Any) -> AsyncIterator[
        tuple[FakeVLLM, dict[str, Any]]]:
    """The pair's P answers 500; a second P of the same fabric is up: (the second P, the
    router's config for a push mode that recovers by pull, both P round robin)."""
    fabric_p = FakeVLLM("prefill", engine_id="engine-p1", side_channel_port=5602,
                        fabric=pair.prefill.fabric)
    runner, other_url = await start(fabric_p)
    try:
        pair.prefill.behavior.fail_status = 500
        yield fabric_p, push_config(
            pair, push_recovery="pull", balance={"prefill": "round_robin"},
            prefill=[{"url": pair.p_url, **PREFILL_COORDS},
                     {"url": other_url, **PREFILL_COORDS, "engine_id": "engine-p1",
                      "side_channel_port": 5602}], **config)
    finally:
        await runner.cleanup()


async def test_a_push_whose_prefill_fails_is_redone_as_a_pull_on_another_prefill(pair: Pair) -> None:
    async with failing_prefill_and_another(pair) as (fabric_p, config):
        async with serve_router(**config) as (url, app):
            async with httpx.AsyncClient(base_url=url) as client:
                r = await client.post("/v1/completions", json=BODY)
                metrics = (await client.get("/metrics")).text
            assert_nothing_in_flight(app)
    assert r.status_code == 200, r.text
    assert r.headers["x-kv-transfer-recovery"] == "pull"
    # it ran as a pull: the header, the request count and the log say so, not push
    assert r.headers["x-kv-transfer-mode"] == "pull"
    assert 'pdproxy_requests_total{mode="pull",route="/v1/completions",status="200"} 1.0' \
        in metrics
    assert [s.outcome for s in pair.prefill.seen] == ["failed"]
    assert [s.outcome for s in fabric_p.seen] == ["ok"], "the pull went to the other P"
    assert [s.outcome for s in pair.decode.seen] == ["cancelled", "ok"]
    assert pair.decode.seen[1].body["kv_transfer_params"]["do_remote_prefill"] is True
    assert 'pdproxy_push_recoveries_total{how="pull"} 1.0' in metrics


async def test_a_learned_push_redone_as_a_pull_does_not_say_it_went_by_layer(pair: Pair) -> None:
    """auto.push_layers: learn chose for the push (its first turn: whole); the push ran
    as a pull, so the answer names pull and carries no X-KV-Push-Layers."""
    async with failing_prefill_and_another(pair, auto={"push_layers": "learn"}) as (_, config):
        async with serve_router(**config) as (url, app):
            async with httpx.AsyncClient(base_url=url) as client:
                r = await client.post("/v1/completions", json={**BODY, "stream": True})
            assert_nothing_in_flight(app)
    assert r.status_code == 200, r.text
    assert r.headers["x-kv-transfer-recovery"] == "pull"
    assert r.headers["x-kv-transfer-mode"] == "pull"
    assert "x-kv-push-layers" not in r.headers
    assert pair.prefill.seen[0].body["kv_transfer_params"]["push_layers"] is False


async def test_a_push_whose_only_prefill_drops_is_computed_by_decode(pair: Pair) -> None:
    """No other P: D gets the plain request and computes the prompt itself (streamed)."""
    pair.prefill.behavior.drop_connection = True
    async with serve_router(**push_config(pair, push_recovery="pull")) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json={**BODY, "stream": True})
            metrics = (await client.get("/metrics")).text
        assert_nothing_in_flight(app)
    assert r.status_code == 200, r.text
    assert r.text.rstrip().endswith("data: [DONE]")
    assert r.headers["x-kv-transfer-recovery"] == "recompute"
    assert r.headers["x-kv-transfer-mode"] == "local"  # D computed the prompt
    assert 'pdproxy_requests_total{mode="local",route="/v1/completions",status="200"} 1.0' \
        in metrics
    assert [s.outcome for s in pair.decode.seen] == ["cancelled", "ok"]
    assert "kv_transfer_params" not in pair.decode.seen[1].body
    assert 'pdproxy_push_recoveries_total{how="recompute"} 1.0' in metrics


async def test_a_prefill_refusing_the_request_is_not_worked_around(pair: Pair) -> None:
    """A 4xx from P is the request's own fault: the client gets it, D is not asked again."""
    pair.prefill.behavior.fail_status = 400
    async with serve_router(**push_config(pair, push_recovery="recompute")) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
        await pair.decode.until(lambda seen: bool(seen) and seen[0].outcome == "cancelled")
    assert r.status_code == 400
    assert "x-kv-transfer-recovery" not in r.headers
    assert len(pair.decode.seen) == 1


async def test_lost_connections_count_against_a_servers_health(pair: Pair) -> None:
    """P's connection drops mid-answer twice in a row: P is out, as after two failed
    health checks (a refused connection takes it out at once; a lost one is counted)."""
    pair.prefill.behavior.drop_connection = True
    config = {"prefill": [pair.p_url], "decode": [pair.d_url],
              "health": {"interval": 60, "unhealthy_threshold": 2}}
    async with serve_router(**config) as (url, app):
        endpoint = app.state.router.prefill.endpoints[0]
        async with httpx.AsyncClient(base_url=url) as client:
            assert_openai_error(await client.post("/v1/completions", json=BODY), 502)
            assert endpoint.healthy, "one lost connection is one failure, not an outage"
            assert_openai_error(await client.post("/v1/completions", json=BODY), 502)
            assert not endpoint.healthy
            r = await client.post("/v1/completions", json=BODY)
    assert_openai_error(r, 503)


async def test_a_push_whose_decode_fails_is_abandoned_on_ps_side_channel(pair: Pair) -> None:
    """D answers 500 after P finished: the router tells P's push port (a ROUTER socket
    here, as our connector binds) to abandon that transfer, so P frees its blocks."""
    import zmq
    import zmq.asyncio

    from connector.protocol.side_channel import Abandon, decode

    context = zmq.asyncio.Context()
    side_channel = context.socket(zmq.ROUTER)
    try:
        port = side_channel.bind_to_random_port("tcp://127.0.0.1")
        pair.decode.behavior.fail_status = 500
        config = push_config(pair, prefill=[{"url": pair.p_url, **PREFILL_COORDS, "push_port": port}])
        async with serve_router(**config) as (url, _app):
            async with httpx.AsyncClient(base_url=url) as client:
                r = await client.post("/v1/completions", json=BODY)
                async with asyncio.timeout(5):
                    _peer, payload = await side_channel.recv_multipart()
                metrics = (await client.get("/metrics")).text
    finally:
        side_channel.close(linger=0)
        context.term()
    assert r.status_code == 500
    message = decode(payload)
    assert isinstance(message, Abandon)
    assert message.transfer_id == pair.prefill.seen[0].body["kv_transfer_params"]["transfer_id"]
    assert 'pdproxy_push_abandons_total{result="sent"} 1.0' in metrics
