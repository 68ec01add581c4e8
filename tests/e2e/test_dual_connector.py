"""Our `NixlDualConnector` on real vLLM CPU servers: one P/D pair, pull or push per request.

Through the router: the same pair serves pull and push, chosen per request by header;
greedy tokens equal one server's; D's metrics show the prompt came over KV transfer; and
afterwards neither server holds a KV block. Then the connector's own promises, each with
both servers' KV usage back to zero afterwards: a probe holds nothing on P; a prefill no
D claims is freed at its deadline; a registration P never serves, a client that leaves
mid-push, and a P killed after D registered each end within seconds, the first and last
with an answer computed by D itself (the push fell back to recompute).

The pair's push deadlines are short (`DUAL_EXTRA_CONFIG`). The last two tests each kill
a server (P after D registered; D after it registered) and close the pair, so the second
one starts a fresh pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from connector.config import CPU_PAUSE
from testbed.pd_protocol import KV_USAGE, metric, prefill_leg, probe_body, push_decode_leg
from testbed.tiny_model import sample_text
from testbed.vllm_cpu import Pair, VllmServer
from tests.conftest import until
from tests.e2e.conftest import DUAL_EXTRA_CONFIG, PairManager, ProxyFactory, RouterProcess
from tests.e2e.vllm_client import (
    CHAT,
    COMPLETIONS,
    TIMEOUT,
    by_source,
    decode,
    external_kv_tokens,
    get_metrics,
    make_body,
    reference_tokens,
    wait_for_metric,
)

pytestmark = pytest.mark.e2e

NIXL_READS = "vllm:nixl_bytes_transferred_count"  # on D: its own READs (a push has none)
UNCLAIMED_TTL_S = float(DUAL_EXTRA_CONFIG["unclaimed_ttl"])  # type: ignore[arg-type]
REGISTRATION_TTL_S = float(DUAL_EXTRA_CONFIG["registration_ttl"])  # type: ignore[arg-type]


async def kv_usage(client: httpx.AsyncClient, url: str) -> float:
    return metric(await get_metrics(client, url), KV_USAGE)


async def assert_nothing_held(client: httpx.AsyncClient, running: Pair, within_s: float = 10) -> None:
    for name, url in (("P", running.prefill_url), ("D", running.decode_url)):
        samples = await wait_for_metric(client, url, lambda s: metric(s, KV_USAGE) == 0.0,
                                        timeout_s=within_s)
        assert metric(samples, KV_USAGE) == 0.0, f"{name} still holds KV blocks"


async def wait_until_held(client: httpx.AsyncClient, url: str, timeout_s: float = 10) -> None:
    samples = await wait_for_metric(client, url, lambda s: metric(s, KV_USAGE) > 0.0,
                                    timeout_s=timeout_s)
    assert metric(samples, KV_USAGE) > 0.0, f"{url} never allocated the request's blocks"


async def coordinates(client: httpx.AsyncClient, running: Pair) -> dict[str, Any]:
    """P's answer to a probe: its coordinates, capabilities and push side channel."""
    resp = await client.post(running.prefill_url + COMPLETIONS,
                             json={**probe_body(), "kv_transfer_params": {
                                 **probe_body()["kv_transfer_params"], "probe": True}})
    assert resp.status_code == 200, resp.text
    params: dict[str, Any] = resp.json()["kv_transfer_params"]
    return params


async def push_stats(client: httpx.AsyncClient, server: VllmServer, pattern: str,
                     timeout: float = 30.0) -> str:
    """`server`'s last "push stats:" log line, once it matches `pattern`. A stats line
    comes with an engine step, at most every `stats_interval`: each look first gives the
    server a step (a small plain request)."""
    last: list[str] = []

    async def matches() -> bool:
        plain = await client.post(server.url + COMPLETIONS,
                                  json={**make_body(COMPLETIONS), "max_tokens": 2})
        assert plain.status_code == 200, plain.text
        lines = [line for line in server.spec.log_path.read_text().splitlines()
                 if "push stats:" in line]
        last[:] = lines[-1:]
        return bool(lines) and re.search(pattern, lines[-1]) is not None

    await until(matches, f"a push stats line in {server.spec.log_path} matching {pattern!r}",
                timeout)
    return last[0]


def push_to_d(body: dict[str, Any], p_params: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """D's push leg for `body`, naming P's push side channel; and its request id."""
    request_id = f"e2e-dual-{uuid.uuid4().hex[:12]}"
    leg = push_decode_leg(body, p_params, request_id=request_id)
    leg["kv_transfer_params"].update(transfer_mode="push", push_host=p_params["push_host"],
                                     push_port=p_params["push_port"])
    return leg, request_id


# --- through the router: the same pair, both modes ------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completions", "chat"])
async def test_one_pair_serves_pull_and_push_chosen_per_request(
    dual_pair: Pair, proxy_for: ProxyFactory, path: str, stream: bool
) -> None:
    router_url = proxy_for(dual_pair, "pull")
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        for mode in ("push", "pull"):
            body = make_body(path)
            mode_seen = await client.post(
                router_url + COMPLETIONS, json={**make_body(COMPLETIONS), "max_tokens": 2},
                headers={"X-KV-Transfer-Mode": mode})
            assert mode_seen.status_code == 200, mode_seen.text
            assert mode_seen.headers["x-kv-transfer-mode"] == mode, "the router fell back"
            before = await get_metrics(client, dual_pair.decode_url)
            tokens, prompt_tokens = await decode(
                client, router_url + path, body, stream=stream,
                headers={"X-KV-Transfer-Mode": mode})
            def all_by_transfer(s: dict[Any, float], b: dict[Any, float] = before,
                                n: int = prompt_tokens) -> bool:
                return external_kv_tokens(s) - external_kv_tokens(b) >= n

            after = await wait_for_metric(client, dual_pair.decode_url, all_by_transfer)
            assert external_kv_tokens(after) - external_kv_tokens(before) == prompt_tokens, (
                f"{mode}: D did not get the whole prompt's KV by transfer")
            assert tokens == await reference_tokens(client, dual_pair.decode_url, path, body), (
                f"{mode}: tokens differ from one server's")
        await assert_nothing_held(client, dual_pair)


async def test_the_servers_logs_count_the_pushes(dual_pair: Pair, proxy_for: ProxyFactory) -> None:
    router_url = proxy_for(dual_pair, "pull")
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        resp = await client.post(router_url + COMPLETIONS, json=make_body(COMPLETIONS),
                                 headers={"X-KV-Transfer-Mode": "push"})
        assert resp.status_code == 200, resp.text
        await push_stats(client, dual_pair.prefill, r"writes done [1-9]\d* failed 0")
        await push_stats(client, dual_pair.decode, r"D registered [1-9]\d* received [1-9]")


async def test_p_answers_say_it_can_push_and_where(dual_pair: Pair) -> None:
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        params = await coordinates(client, dual_pair)
        assert params["transfer_modes"] == ["pull", "push"]
        assert params["push_host"] == "127.0.0.1"
        assert isinstance(params["push_port"], int) and 0 < params["push_port"] < 65536
        # A probe's block is freed at once (stock connectors hold it for the 30 s lease).
        await assert_nothing_held(client, dual_pair, within_s=3)


def test_the_servers_build_their_nixl_agents_with_the_event_driven_thread(
    dual_pair: Pair,
) -> None:
    """With NIXL's own progress thread as vLLM builds it each server would spin a core for
    its whole life; the connector makes it sleep until the transport has work
    (`nixl_progress_thread: "event"`). The cores an idle server uses are measured by
    `scripts.bench_idle`, not here: on a shared machine a bound on them fails for
    reasons of its own."""
    for server in (dual_pair.prefill, dual_pair.decode):
        log = server.spec.log_path.read_text()
        assert "NIXL agent built with an event-driven progress thread" in log, server.log_tail()


async def test_auto_learns_on_the_pair_and_load_aware_reads_vllms_metrics(
    dual_pair: Pair, tmp_path: Path
) -> None:
    """`auto` takes turns while it learns (both modes measured on the real connector), then
    keeps to the faster; load_aware balancing parses what real vLLM's /metrics says."""
    config = tmp_path / "router.yaml"
    config.write_text("auto: {min_samples: 2, explore: 0}\nbalance: {scrape_interval: 0.2}\n"
                      "admin_token: e2e-token\n")
    router = RouterProcess(dual_pair.prefill_url, dual_pair.decode_url, "auto",
                           ("--config", str(config), "--prefill-policy", "load_aware",
                            "--decode-policy", "load_aware"))
    auth = {"Authorization": "Bearer e2e-token"}
    try:
        router.wait_healthy()
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            for _ in range(6):
                body = make_body(COMPLETIONS)
                tokens, _ = await decode(client, router.url + COMPLETIONS, body, stream=True)
                assert tokens == await reference_tokens(client, dual_pair.decode_url,
                                                        COMPLETIONS, body)
            decisions = {
                (dict(labels)["mode"], dict(labels)["reason"]): value
                for (name, labels), value in (await get_metrics(client, router.url)).items()
                if name == "pdproxy_auto_mode_decisions_total"
            }
            assert decisions.get(("push", "auto_learning")) == 2, decisions
            assert decisions.get(("pull", "auto_learning")) == 2, decisions
            # then the faster by moving average (each new TTFT may move it: either mode)
            faster = {k: v for k, v in decisions.items() if k[1] == f"auto_faster_{k[0]}"}
            assert sum(faster.values()) == 2 and sum(decisions.values()) == 6, decisions

            learned = (await client.get(router.url + "/admin/auto", headers=auth)).json()
            measured = [row for row in learned["buckets"] if row["samples"]]
            assert {row["mode"] for row in measured} == {"pull", "push"}, learned
            assert all(row["avg_ms"] > 0 for row in measured), learned

            servers = (await client.get(router.url + "/admin/endpoints", headers=auth)).json()
            for server in servers["endpoints"]:
                load = server["load"]
                assert load is not None, f"no load scraped from {server['url']}: {server}"
                assert load["waiting"] >= 0 and load["running"] >= 0, server
                assert 0.0 <= load["kv_cache_usage"] <= 1.0 and load["age_s"] < 5, server
            await assert_nothing_held(client, dual_pair)
    finally:
        router.stop()


# --- the connector's deadlines and failure paths ----------------------------------------------


async def d_waiting_for_a_push(client: httpx.AsyncClient, running: Pair) -> asyncio.Task[Any]:
    """D's leg of a push whose P leg never comes, running; returns once D has registered
    its blocks with P and holds them, waiting for a WRITE."""
    p_params = await coordinates(client, running)
    leg, request_id = push_to_d(make_body(COMPLETIONS), p_params)
    waiting = asyncio.create_task(client.post(
        running.decode_url + COMPLETIONS, json=leg, headers={"X-Request-Id": request_id}))
    await wait_until_held(client, running.decode_url)
    return waiting


async def leave(waiting: asyncio.Task[Any]) -> None:
    """The client goes away: its connection to D is closed."""
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def push_registered_first(
    client: httpx.AsyncClient, running: Pair, body: dict[str, Any] | None = None,
    **p_extra: Any,
) -> tuple[dict[str, Any], str, dict[Any, float], tuple[list[int], int]]:
    """A push (of `body`, else a fresh one) whose D leg registers its blocks before P's
    leg is sent (with `p_extra` in P's kv_transfer_params). Returns the body, D's request
    id, D's metrics from before, and D's answer: its tokens and the prompt's length."""
    p_params = await coordinates(client, running)
    body = body or make_body(COMPLETIONS)
    leg, request_id = push_to_d(body, p_params)
    d_before = await get_metrics(client, running.decode_url)
    decoding = asyncio.create_task(decode(client, running.decode_url + COMPLETIONS, leg,
                                          stream=False, headers={"X-Request-Id": request_id}))
    await wait_until_held(client, running.decode_url)  # D registered its blocks
    resp = await client.post(running.prefill_url + COMPLETIONS, json=prefill_leg(
        body, transfer_id=request_id, transfer_mode="push", **p_extra))
    assert resp.status_code == 200, resp.text
    return body, request_id, d_before, await asyncio.wait_for(decoding, timeout=30)


async def test_d_waiting_for_a_push_pauses_its_idle_steps(dual_pair: Pair) -> None:
    """While D only waits for P's WRITE, its engine pauses between idle steps
    (`push_wait_pause`, CPU_PAUSE on CPU) instead of stepping back to back, woken early by
    its workers' socket when a push lands; a D that waits and is left frees everything.
    The cores D's engine uses meanwhile are measured by `scripts.bench_idle`, not here."""
    log = dual_pair.decode.spec.log_path.read_text()
    assert f"idle steps while waiting for pushes pause {CPU_PAUSE * 1000:.1f} ms" in log, (
        dual_pair.decode.log_tail())
    assert "no wake-up socket for the push-wait pause" not in log
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        waiting = await d_waiting_for_a_push(client, dual_pair)
        await leave(waiting)
        await assert_nothing_held(client, dual_pair)


async def test_a_prefill_no_d_claims_is_freed_at_its_deadline(dual_pair: Pair) -> None:
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        leg = prefill_leg(make_body(COMPLETIONS), transfer_id=f"e2e-unclaimed-{uuid.uuid4().hex}",
                          transfer_mode="push")
        resp = await client.post(dual_pair.prefill_url + COMPLETIONS, json=leg)
        assert resp.status_code == 200, resp.text
        finished = time.monotonic()
        assert resp.json()["kv_transfer_params"]["transfer_mode"] == "push"
        assert await kv_usage(client, dual_pair.prefill_url) > 0, "P did not keep the KV for D"
        await assert_nothing_held(client, dual_pair, within_s=UNCLAIMED_TTL_S + 5)
        assert time.monotonic() - finished >= UNCLAIMED_TTL_S - 1, "freed before its deadline"


async def test_a_push_whose_decode_fails_is_abandoned_and_p_frees_at_once(dual_pair: Pair) -> None:
    """Through the router (in this process): the real P computes the prompt and keeps it
    for D, but D (a fake that answers 500 after P is done) fails before it registers. The
    router abandons the transfer on P's push port, and P frees the prompt's blocks at
    once, well before `unclaimed_ttl`."""
    from testbed.fake_vllm import FakeVLLM, start
    from tests.conftest import serve_router

    broken_d = FakeVLLM("decode", model="tiny")
    broken_d.behavior.delay, broken_d.behavior.fail_status = 2.0, 500
    runner, d_url = await start(broken_d)
    try:
        config = {"prefill": [dual_pair.prefill_url], "decode": [d_url], "mode": "push",
                  "push_recovery": "error", "timeouts": {"health": 10.0, "probe": 60.0}}
        async with serve_router(**config) as (url, _app), \
                httpx.AsyncClient(timeout=TIMEOUT) as client:
            started = time.monotonic()
            r = await client.post(url + COMPLETIONS, json=make_body(COMPLETIONS))
            assert r.status_code == 500, r.text
            metrics = (await client.get(url + "/metrics")).text
            assert 'pdproxy_push_abandons_total{result="sent"} 1.0' in metrics
            # P answered its leg (so it kept the prompt for D) before D failed:
            assert 'pdproxy_prefill_latency_seconds_count{mode="push"} 1.0' in metrics
            await assert_nothing_held(client, dual_pair, within_s=UNCLAIMED_TTL_S)
            assert time.monotonic() - started < UNCLAIMED_TTL_S - 2, "freed only by the deadline"
    finally:
        await runner.cleanup()


async def test_a_registration_p_never_serves_falls_back_to_recompute(dual_pair: Pair) -> None:
    """D registers; P is alive but never gets the prompt: at the registration deadline P
    says so, and D computes the prompt itself. The answer is still right."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        p_params = await coordinates(client, dual_pair)
        body = make_body(COMPLETIONS)
        leg, request_id = push_to_d(body, p_params)
        started = time.monotonic()
        tokens, _ = await decode(client, dual_pair.decode_url + COMPLETIONS, leg, stream=False,
                                 headers={"X-Request-Id": request_id})
        waited = time.monotonic() - started
        assert REGISTRATION_TTL_S - 1 <= waited <= REGISTRATION_TTL_S + 10, waited
        assert tokens == await reference_tokens(client, dual_pair.decode_url, COMPLETIONS, body)
        await assert_nothing_held(client, dual_pair)


async def test_a_client_that_leaves_mid_push_frees_ds_blocks(dual_pair: Pair) -> None:
    """D registered and waits for P's WRITE; the client leaves: D tells P, P confirms
    nothing will be written, and D frees the blocks, well before any deadline."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        waiting = await d_waiting_for_a_push(client, dual_pair)
        left = time.monotonic()
        await leave(waiting)
        await assert_nothing_held(client, dual_pair, within_s=10)
        assert time.monotonic() - left < REGISTRATION_TTL_S - 2, "freed only by the deadline"


async def test_a_failed_write_is_read_by_d_instead(dual_pair: Pair) -> None:
    """P's WRITE fails (on purpose: `fail_write`). P keeps the prompt's blocks and offers
    them; D READs them, as in a pull, instead of computing the prompt. The tokens are one
    server's, D's own NIXL counters show the READ, and both servers end empty long
    before the fallback's lease would free P's blocks."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        body, request_id, d_before, (tokens, prompt_tokens) = await push_registered_first(
            client, dual_pair, fail_write=True)
        done = time.monotonic()
        d_after = await wait_for_metric(
            client, dual_pair.decode_url,
            lambda s: metric(s, NIXL_READS) > metric(d_before, NIXL_READS))
        assert metric(d_after, NIXL_READS) > metric(d_before, NIXL_READS), "D did not READ"
        assert external_kv_tokens(d_after) - external_kv_tokens(d_before) == prompt_tokens
        assert tokens == await reference_tokens(client, dual_pair.decode_url, COMPLETIONS, body)
        await assert_nothing_held(client, dual_pair, within_s=10)
        assert time.monotonic() - done < 15, "P's blocks waited for the fallback's lease"
    p_log = dual_pair.prefill.spec.log_path.read_text()
    d_log = dual_pair.decode.spec.log_path.read_text()
    assert re.search(rf"push {re.escape(request_id)}: WRITE failed: WRITE failed on purpose",
                     p_log), "P did not log the failed WRITE"
    assert re.search(rf"push {re.escape(request_id)} for request \S+ failed; reading P's "
                     r"blocks instead", d_log), "D did not log its READ instead"


@pytest.mark.parametrize("by_layer", [False, True], ids=["whole", "by-layer"])
async def test_a_push_d_registered_first_is_written_right_after_the_prompt(
    dual_pair: Pair, by_layer: bool,
) -> None:
    """D registers before P schedules the prompt, as when P has a queue: P WRITEs right
    after the forward pass that completes the prompt (an early WRITE, which P's stats
    count); or, asked by layer (`push_layers`), each layer's KV from vLLM's per-layer hook
    while the forward pass runs, and the last layer's, with D's notification, once the
    others are done (P's stats count it by layer). The rest is as with any push: one
    server's tokens (a layer missing or misplaced would change them), the whole prompt by
    transfer with no READ by D, and nothing held afterwards."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        body, _, d_before, (tokens, prompt_tokens) = await push_registered_first(
            client, dual_pair, push_layers=by_layer)
        d_after = await wait_for_metric(
            client, dual_pair.decode_url,
            lambda s: external_kv_tokens(s) - external_kv_tokens(d_before) >= prompt_tokens)
        assert external_kv_tokens(d_after) - external_kv_tokens(d_before) == prompt_tokens
        assert metric(d_after, NIXL_READS) == metric(d_before, NIXL_READS), "D READ instead"
        assert tokens == await reference_tokens(client, dual_pair.decode_url, COMPLETIONS, body)
        await assert_nothing_held(client, dual_pair)
        await push_stats(client, dual_pair.prefill,
                         r"by layer [1-9]" if by_layer else r"early [1-9]")


async def test_a_push_by_layer_on_a_prefix_hit_writes_only_ds_tail(dual_pair: Pair) -> None:
    """D already holds the start of the prompt (a later turn of a conversation): it
    registers only its uncached blocks, and P's layered WRITE, planned by vLLM's push
    code, sends only that tail, layer by layer; one server's tokens."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        first = make_body(COMPLETIONS)
        warm, _ = await decode(client, dual_pair.decode_url + COMPLETIONS, first, stream=False)
        assert warm, "D served the first turn"
        body = {**first, "prompt": first["prompt"] + " " + sample_text(7, lines=4)}
        before = by_source(await get_metrics(client, dual_pair.decode_url))
        _, _, _, (tokens, prompt_tokens) = await push_registered_first(
            client, dual_pair, body, push_layers=True)

        def counted(samples: dict[Any, float]) -> bool:
            now = by_source(samples)
            return sum(now[s] - before[s] for s in now) >= prompt_tokens

        after = by_source(await wait_for_metric(client, dual_pair.decode_url, counted))
        delta = {s: after[s] - before[s] for s in after}
        assert delta["local_cache_hit"] > 0, f"D had no prefix hit: {delta}"
        assert delta["external_kv_transfer"] == prompt_tokens - delta["local_cache_hit"], delta
        assert tokens == await reference_tokens(client, dual_pair.decode_url, COMPLETIONS, body)
        await assert_nothing_held(client, dual_pair)


async def test_a_layered_push_whose_write_fails_is_read_by_d_instead(dual_pair: Pair) -> None:
    """A push asked by layer whose WRITE fails takes the whole push's failure path: P
    keeps the blocks, D READs them, the tokens are one server's and nothing stays held."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        body, request_id, d_before, (tokens, _) = await push_registered_first(
            client, dual_pair, push_layers=True, fail_write=True)
        d_after = await wait_for_metric(
            client, dual_pair.decode_url,
            lambda s: metric(s, NIXL_READS) > metric(d_before, NIXL_READS))
        assert metric(d_after, NIXL_READS) > metric(d_before, NIXL_READS), "D did not READ"
        assert tokens == await reference_tokens(client, dual_pair.decode_url, COMPLETIONS, body)
        await assert_nothing_held(client, dual_pair, within_s=10)
    p_log = dual_pair.prefill.spec.log_path.read_text()
    assert re.search(rf"push {re.escape(request_id)}: WRITE failed: WRITE failed on purpose",
                     p_log), "P did not log the failed WRITE"


@pytest.mark.parametrize("layers", ["on", "off"])
async def test_through_the_router_a_push_by_layer_or_whole_gives_one_servers_tokens(
    dual_pair: Pair, proxy_for: ProxyFactory, layers: str,
) -> None:
    """The client's X-KV-Push-Layers reaches P: by layer when D registered in time (else
    whole), or whole; either way one server's tokens, the whole prompt by transfer."""
    router_url = proxy_for(dual_pair, "pull")
    body = {**make_body(COMPLETIONS), "prompt": f"{layers}: layer by layer " * 20}
    headers = {"X-KV-Transfer-Mode": "push", "X-KV-Push-Layers": layers}
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        before = await get_metrics(client, dual_pair.decode_url)
        tokens, prompt_tokens = await decode(client, router_url + COMPLETIONS, body,
                                             stream=False, headers=headers)
        after = await wait_for_metric(
            client, dual_pair.decode_url,
            lambda s: external_kv_tokens(s) - external_kv_tokens(before) >= prompt_tokens)
        assert external_kv_tokens(after) - external_kv_tokens(before) == prompt_tokens
        assert tokens == await reference_tokens(client, dual_pair.decode_url, COMPLETIONS, body)
        await assert_nothing_held(client, dual_pair)


@pytest.mark.closes_pair
async def test_p_killed_after_d_registered_ends_ds_wait_within_seconds(
    dual_pair: Pair, pair_manager: PairManager
) -> None:
    """Runs last among the dual pair's tests: it kills P, then closes the pair."""
    try:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            p_params = await coordinates(client, dual_pair)
            body = make_body(COMPLETIONS)
            expected = await reference_tokens(client, dual_pair.decode_url, COMPLETIONS, body)
            leg, request_id = push_to_d(body, p_params)
            waiting = asyncio.create_task(decode(
                client, dual_pair.decode_url + COMPLETIONS, leg, stream=False,
                headers={"X-Request-Id": request_id}))
            await wait_until_held(client, dual_pair.decode_url)
            dual_pair.prefill.stop(timeout_s=5)
            killed = time.monotonic()
            tokens, _ = await asyncio.wait_for(waiting, timeout=30)
            assert time.monotonic() - killed < 10, "D waited on a dead P for too long"
            assert tokens == expected, "D's own computation differs from one server's"
            samples = await wait_for_metric(client, dual_pair.decode_url,
                                            lambda s: metric(s, KV_USAGE) == 0.0)
            assert metric(samples, KV_USAGE) == 0.0, "D still holds KV blocks"
    finally:
        pair_manager.close()


@pytest.mark.closes_pair
async def test_d_killed_after_registering_leaves_nothing_held_on_p(
    dual_pair: Pair, pair_manager: PairManager
) -> None:
    """On a fresh pair (the test above closed the last one): D registers, then dies. P's
    prefill then matches the registration and its WRITE cannot reach D, or D's write
    lease has lapsed by then and P has ended the transfer; either way P frees the
    prompt's blocks at once (not at a deadline) and logs why. Closes the pair."""
    try:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            p_params = await coordinates(client, dual_pair)
            body = make_body(COMPLETIONS)
            leg, request_id = push_to_d(body, p_params)
            waiting = asyncio.create_task(client.post(
                dual_pair.decode_url + COMPLETIONS, json=leg, headers={"X-Request-Id": request_id}))
            await wait_until_held(client, dual_pair.decode_url)
            os.killpg(dual_pair.decode.pid or 0, signal.SIGKILL)
            with contextlib.suppress(httpx.HTTPError):
                await asyncio.wait_for(waiting, timeout=10)
            resp = await client.post(dual_pair.prefill_url + COMPLETIONS, json=prefill_leg(
                body, transfer_id=request_id, transfer_mode="push"))
            assert resp.status_code == 200, resp.text
            answered = time.monotonic()
            samples = await wait_for_metric(client, dual_pair.prefill_url,
                                            lambda s: metric(s, KV_USAGE) == 0.0, timeout_s=15)
            assert metric(samples, KV_USAGE) == 0.0, "P still holds the prompt's blocks"
            assert time.monotonic() - answered < UNCLAIMED_TTL_S, "freed only by a deadline"
        log = dual_pair.prefill.spec.log_path.read_text()
        tid = re.escape(request_id)
        assert re.search(rf"push {tid}: WRITE failed|push {tid} ended: expired "
                         r"\(lease_expired\)", log), "P did not log why it let go"
    finally:
        pair_manager.close()
