"""The router's state and its one entry point for inference requests.

`Router` owns everything that lives as long as the server: the upstream client, the two
clusters, the prober, the health checker, the model catalog and the metrics. For each
request it picks a P and a D, decides the mode, and hands an `Exchange` to the pull,
push or local flow inside a `FlowResponse`. A local request (D computes the prompt
itself) picks no P at all, so it is served while every P is down.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING

from connector.protocol import http_params as wire
from proxy.config import ConfigSource, Mode, Policy, RouterConfig, resolve_secret
from proxy.errors import InvalidRequest, NoHealthyEndpoint
from proxy.flow.context import FlowContext
from proxy.flow.exchange import MODE_HEADER, PUSH_LAYERS_HEADER, Exchange
from proxy.flow.learn import LocalBudget, ModeLearner
from proxy.flow.local import ItlWatchedResponse, run_local
from proxy.flow.modes import ModeDecision, decide_mode
from proxy.flow.pull import run_pull
from proxy.flow.push import run_push
from proxy.flow.relay import Downstream, FlowResponse
from proxy.metrics import RouterMetrics
from proxy.pool.balance import Balancer
from proxy.pool.endpoints import Cluster, ClusterName, Endpoint
from proxy.pool.health import HealthChecker
from proxy.pool.kv.blocks import PromptBlocks
from proxy.pool.kv.index import KvIndex
from proxy.pool.kv.score import Calibration, KvContext
from proxy.pool.kv.tokens import PromptTokenizer
from proxy.pool.membership import ConfigWatcher, Membership
from proxy.pool.models import ModelCatalog
from proxy.pool.probe import CoordinateProber
from proxy.pool.retry import RetryBudget
from proxy.pool.scrape import LoadScraper
from proxy.protocol import ClientRequest, PrefillCoordinates, prefix_key, prompt_chars
from proxy.task_scope import own_exception_state
from proxy.tracing import Tracing
from proxy.upstream.client import UpstreamClient
from proxy.upstream.sidechannel import SideChannel

if TYPE_CHECKING:
    from proxy.pool.discovery import KubernetesDiscovery

logger = logging.getLogger("pdproxy.router")

REQUEST_ID_HEADER = b"x-request-id"
MODE_REASON_HEADER = b"x-kv-transfer-mode-reason"  # only when the asked mode was impossible


def cluster_api_key(configured: str | None, cluster: str) -> str | None:
    """A cluster's bearer token: configured (maybe "env:NAME"), else the environment's
    PDPROXY_<CLUSTER>_API_KEY, else none."""
    return resolve_secret(configured) or os.environ.get(f"PDPROXY_{cluster}_API_KEY") or None


class Router:
    """Create inside a running event loop (the app's lifespan); close with `aclose`."""

    @property
    def serves_without_prefill(self) -> bool:
        """Requests are served with every P down: local mode, or auto that may go local."""
        auto = self.config.auto
        return self.config.mode is Mode.LOCAL or (
            self.config.mode is Mode.AUTO and auto.local and auto.learn)

    def __init__(self, config: RouterConfig, source: ConfigSource | None = None) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        # OpenTelemetry traces of requests (tracing.enabled), else None
        self.tracing = Tracing.of(config.tracing)
        self.retry_budget = RetryBudget(config.retry_budget.ratio, config.retry_budget.min_per_window,
                                        config.retry_budget.window_s)
        self.client = UpstreamClient(config.timeouts, config.limits,
                                     show_urls=config.show_upstream_urls)
        channel = config.push_channel
        self.push_channel = SideChannel(
            secret_key_file=channel.curve_secret_key_file,
            server_key_file=channel.curve_server_key_file,
        ) if channel.abandon else None
        self.learner = ModeLearner(config.auto) if config.auto.learn else None
        # A local prompt is computed on D between its other streams' tokens, and slows
        # them: wherever a request may go local (auto.local, `mode: local`, or a client
        # allowed to ask for it), each D's inter-token latency is measured, and a D over
        # its budget (auto.local_itl_budget) takes no local request.
        self.local_budget: LocalBudget | None = (
            self.learner.local_budget if self.learner and self.learner.local_budget
            else LocalBudget(config.auto)
            if config.mode is Mode.LOCAL or Mode.LOCAL in config.client_modes else None)
        balance = config.balance
        self._needs_prefix = Policy.PREFIX_AFFINITY in balance.uses
        # kv_aware: an index of every server's prefix cache, fed by its vLLM KV events
        self.kv_index: KvIndex | None = None
        self.kv_events: KvEventSubscriber | None = None
        self.tokenizer: PromptTokenizer | None = None
        kv_clusters = [name for name, policy in ((ClusterName.PREFILL, balance.prefill),
                                                  (ClusterName.DECODE, balance.decode))
                       if policy is Policy.KV_AWARE]
        self.kv_calibration: Calibration | None = None
        if kv_clusters:
            self.kv_index = KvIndex(max_blocks=balance.kv_aware.max_blocks_per_server)
            self.kv_calibration = Calibration(balance.kv_aware)
        def credentials(endpoint: Endpoint) -> None:  # every call to it carries its key
            self.client.set_api_key(endpoint.url, endpoint.api_key)
            self.client.set_name(endpoint.url, endpoint.name)  # what errors call it

        auth = config.auth
        self.prefill = Cluster(ClusterName.PREFILL, config.prefill,
                               Balancer(balance.prefill, balance,
                                        kv=self._kv_context(ClusterName.PREFILL)),
                               config.ejection,
                               api_key=cluster_api_key(auth.prefill_api_key, "PREFILL"),
                               on_add=credentials)
        self.decode = Cluster(ClusterName.DECODE, config.decode,
                              Balancer(balance.decode, balance,
                                       kv=self._kv_context(ClusterName.DECODE)),
                              config.ejection,
                              api_key=cluster_api_key(auth.decode_api_key, "DECODE"),
                              on_add=credentials)
        self.metrics.watch_endpoints(self.all_endpoints)
        self.prober = CoordinateProber(
            self.client,
            self.metrics,
            timeout=config.timeouts.probe,
            retry_interval=config.probe_retry_interval,
            max_ranks=config.limits.max_dp_ranks,
        )
        self.health = HealthChecker(
            self.all_endpoints,
            self.client,
            self.prober,
            config.health,
            timeout=config.timeouts.health,
        )
        self.catalog = ModelCatalog(
            config.models,
            lambda: self.decode.endpoints + self.prefill.endpoints,
            self.client,
            timeout=config.timeouts.health,
        )
        # load_aware balancing reads each server's /metrics, scraped in the background
        self.load = LoadScraper(
            self.all_endpoints, self.client,
            interval=balance.scrape_interval
            if balance.uses & {Policy.LOAD_AWARE, Policy.KV_AWARE} else 0,
            timeout=config.timeouts.health,
        )
        if self.kv_index is not None:
            from proxy.pool.kv.subscriber import KvEventSubscriber  # needs pyzmq
            index = self.kv_index
            self.metrics.watch_kv_index(index.all_sources)
            self.kv_events = KvEventSubscriber(
                index,
                lambda: [e for name in kv_clusters for e in self.context.cluster(name).endpoints],
                self.client, self.metrics, balance.kv_aware, timeout=config.timeouts.health)
            self.tokenizer = PromptTokenizer(
                self.client, lambda: self.decode.endpoints + self.prefill.endpoints,
                timeout=balance.kv_aware.tokenize_timeout, metrics=self.metrics,
                lora_names=index.lora_names,
                cache_tokens=balance.kv_aware.tokenize_cache_tokens)
        self._warmup: asyncio.Task[None] | None = None
        self.context = FlowContext(
            config=config, prefill=self.prefill, decode=self.decode, client=self.client,
            metrics=self.metrics, retry_budget=self.retry_budget, prober=self.prober,
            health=self.health, learner=self.learner, push_channel=self.push_channel,
        )
        self.membership = Membership(self.prefill, self.decode, self.prober,
                                     forget=self._forget_server)
        self.discovery: KubernetesDiscovery | None = None
        if config.discovery.kubernetes is not None:  # the client library only when asked for
            from proxy.pool.discovery import KubernetesDiscovery
            self.discovery = KubernetesDiscovery(config.discovery.kubernetes, self.membership,
                                                 self.metrics)
        self.watcher = None  # polls only with config_watch_interval; reloads on SIGHUP
        if source is not None:
            self.watcher = ConfigWatcher(source.path, source.load, self.membership, config,
                                         interval=config.config_watch_interval)

    def _forget_server(self, url: str) -> None:
        """A server left every cluster and has no request left: drop its connection
        pools, credentials and metric series (kv_aware's index drops its own)."""
        self.client.forget(url)
        self.metrics.forget_endpoint(url)

    def _kv_context(self, cluster: ClusterName) -> KvContext | None:
        """What kv_aware scores a cluster with, when it balances by it (None otherwise)."""
        balance = self.config.balance
        policy = balance.prefill if cluster is ClusterName.PREFILL else balance.decode
        if self.kv_index is None or policy is not Policy.KV_AWARE:
            return None
        prefill = cluster is ClusterName.PREFILL
        assert self.kv_calibration is not None
        return KvContext(self.kv_index, balance.kv_aware, cluster.value,
                         token_weight=1.0 if prefill else balance.kv_aware.decode_token_weight,
                         tracks_work=prefill, calibration=self.kv_calibration,
                         metrics=self.metrics)

    def all_endpoints(self) -> list[Endpoint]:
        return self.prefill.endpoints + self.decode.endpoints

    async def start(self) -> None:
        if self.discovery is not None:  # first: a bad kubeconfig fails the start, nothing to undo
            await self.discovery.start()
        self.membership.start()
        self.health.start()
        self.load.start()
        if self.kv_events is not None:
            self.kv_events.start()
        if self.watcher is not None:
            self.watcher.start()
        if self.config.mode in (Mode.PUSH, Mode.AUTO):
            # Learn P coordinates ahead of the first push request, in the background.
            self._warmup = asyncio.create_task(own_exception_state(self._probe_all()),
                                               name="probe-prefills")

    async def aclose(self) -> None:
        if self.discovery is not None:
            await self.discovery.aclose()
        if self.watcher is not None:
            await self.watcher.aclose()
        await self.membership.aclose()
        if self._warmup is not None:
            self._warmup.cancel()
            await asyncio.gather(self._warmup, return_exceptions=True)
        await self.health.aclose()
        await self.load.aclose()
        if self.kv_events is not None:
            await self.kv_events.aclose()
        await self.prober.aclose()
        await self.catalog.aclose()
        await self.client.aclose()
        if self.push_channel is not None:
            await self.push_channel.aclose()
        if self.tracing is not None:  # export the last spans (the exporter's time limits)
            await asyncio.to_thread(self.tracing.shutdown)

    async def _probe_all(self) -> None:
        names = await self.catalog.names()
        if not names:
            logger.warning("no model listed by any upstream yet; P probes wait for a request")
            return
        await asyncio.gather(*(own_exception_state(self.prober.coordinates(p, names[0]))
                               for p in self.prefill.endpoints))

    async def handle(self, request: ClientRequest) -> FlowResponse:
        """Choose P, D and the mode for a validated request, and return its response."""
        requested = self._requested_mode(request)
        if not self.catalog.serves(request.model):  # (a coroutine only when it must ask)
            await self.catalog.require(request.model)
        self.retry_budget.request()
        key = prefix_key(request, self.config.balance.prefix_chars) if self._needs_prefix else None
        # kv_aware: the prompt's token ids, from the request or a server's /tokenize
        prompt = await self.tokenizer.blocks(request) if self.tokenizer is not None else None
        # auto learns from streamed requests' time to first token, per prompt length
        learner = self.learner
        bucket = (learner.bucket(prompt_chars(request)) if learner and (
            requested is Mode.AUTO or request.stream or learner.layers is not None) else None)
        budget = learner.local_budget if learner else None  # auto may go local: auto.local
        if requested is Mode.LOCAL:  # no P: D computes the prompt
            return self._local(request, bucket, key, prompt)
        # Prefer a P and a D that can do the mode asked (auto: push), so fewer requests
        # fall back; only servers of the request's model.
        wanted = Mode.PULL if requested is Mode.PULL else Mode.PUSH
        decode: Endpoint | None = None
        if requested is Mode.AUTO and budget is not None and prompt is not None \
                and self.config.auto.local_cached_tokens > 0:
            # auto.local by cache: D first; if it holds nearly all the prompt, no P at all
            decode = self.decode.pick(key=key, mode=wanted, model=request.model, prompt=prompt)
            if self._local_by_cache(prompt, decode, budget):
                decision = ModeDecision(requested=requested, used=Mode.LOCAL,
                                        reason="auto_local_cached")
                self.metrics.auto_decisions.inc(("local", decision.reason))
                return self._respond(request, None, decode, decision, bucket, key, prompt)
        try:
            prefill = self.prefill.pick(key=key, mode=wanted, model=request.model,
                                        prompt=prompt)
        except NoHealthyEndpoint:
            if requested is not Mode.AUTO or budget is None:
                raise
            # auto may go local: with no P to be had, D computes the prompt
            decode = decode or self.decode.pick(key=key, model=request.model, prompt=prompt)
            decision = ModeDecision(requested=requested, used=Mode.LOCAL, reason="auto_no_prefill")
            self.metrics.auto_decisions.inc(("local", decision.reason))
            return self._respond(request, None, decode, decision, bucket, key, prompt)
        if decode is None:
            decode = self.decode.pick(key=key, mode=wanted, model=request.model, prompt=prompt)
        coordinates = prefill.coordinates
        if requested is not Mode.PULL and coordinates is None:
            coordinates = await self.prober.coordinates(prefill, request.model)
        decision = decide_mode(
            requested, coordinates, decode_can_push=decode.can(Mode.PUSH),
            learned=(lambda candidates: learner.choose(
                bucket, measured=request.stream, candidates=candidates,
                local_within_budget=budget is None or budget.allows(decode)))
            if learner and bucket is not None else None,
            auto_local=budget is not None,
        )
        if requested is Mode.AUTO:
            self.metrics.auto_decisions.inc((decision.used.value, decision.reason))
        return self._respond(request, prefill, decode, decision, bucket, key, prompt,
                             coordinates)

    def _requested_mode(self, request: ClientRequest) -> Mode:
        """The mode a request asks for: its X-KV-Transfer-Mode where `client_modes` allows
        it (or it names the router's own mode), else the router's `mode`."""
        asked, mode = request.mode_override, self.config.mode
        if asked is None or asked is mode:
            return mode
        if asked not in self.config.client_modes:
            allowed = ", ".join(m.value for m in self.config.client_modes) or "no mode"
            raise InvalidRequest(
                f"{wire.TRANSFER_MODE_HEADER}: {asked.value} is not allowed on this router: "
                f"a client may ask for {allowed} (client_modes), or send no "
                f"{wire.TRANSFER_MODE_HEADER} to get the router's mode ({mode.value})",
                param=wire.TRANSFER_MODE_HEADER)
        return asked

    def _local(self, request: ClientRequest, bucket: int | None, key: str | None,
               prompt: PromptBlocks | None) -> FlowResponse:
        """A request asked to be local (by its client or `mode: local`): D alone computes
        the prompt, unless that D is over its ITL budget; then it runs as a pull
        (`itl_budget`), when a P is to be had."""
        decode = self.decode.pick(key=key, model=request.model, prompt=prompt)
        if self.local_budget is not None and self.local_budget.over(decode):
            try:
                prefill = self.prefill.pick(key=key, mode=Mode.PULL, model=request.model,
                                            prompt=prompt)
            except NoHealthyEndpoint:
                pass  # no P to be had: D computes the prompt after all
            else:
                if not decode.can(Mode.PULL):
                    decode = self.decode.pick(key=key, mode=Mode.PULL, model=request.model,
                                              prompt=prompt)
                decision = ModeDecision(requested=Mode.LOCAL, used=Mode.PULL, reason="itl_budget")
                return self._respond(request, prefill, decode, decision, bucket, key, prompt)
        return self._respond(request, None, decode, decide_mode(Mode.LOCAL, None), bucket, key,
                             prompt)

    def _local_by_cache(self, prompt: PromptBlocks, decode: Endpoint, budget: LocalBudget) -> bool:
        """D holds all but `auto.local_cached_tokens` of the prompt (kv_aware's prediction)
        and is not over its ITL budget."""
        held = prompt.predicted.get(ClusterName.DECODE.value)
        return (held is not None and len(prompt) - held <= self.config.auto.local_cached_tokens
                and not budget.over(decode))

    def _respond(
        self, request: ClientRequest, prefill: Endpoint | None, decode: Endpoint,
        decision: ModeDecision, bucket: int | None, key: str | None,
        prompt: PromptBlocks | None, coordinates: PrefillCoordinates | None = None,
    ) -> FlowResponse:
        """The response that runs the decided flow. A local exchange has no P (D computes
        the prompt): no P leg is ever run or leased."""
        exchange = Exchange(self.context, request, prefill=prefill, decode=decode,
                            decision=decision, bucket=bucket, prefix=key, prompt=prompt)
        if self.tracing is not None:
            exchange.traced(self.tracing.adopt())
        fallback = decision.is_fallback
        if fallback:
            self.metrics.mode_fallbacks.labels(
                decision.requested.value, decision.used.value, decision.reason
            ).inc()
            exchange.remark(f"mode_fallback:{decision.reason}")

        # The decided flow, run with the client's Downstream (a partial: no frame of its own)
        flow: Callable[[Downstream], Awaitable[None]]
        if decision.used is Mode.PUSH:
            assert coordinates is not None  # decide_mode pushes only with coordinates
            flow = partial(run_push, exchange, coordinates=coordinates)
        elif decision.used is Mode.LOCAL:
            flow = partial(run_local, exchange)
        else:
            flow = partial(run_pull, exchange)

        headers = [
            (MODE_HEADER, exchange.mode.encode()),
            (REQUEST_ID_HEADER, request.request_id.encode()),
        ]
        if fallback:
            headers.append((MODE_REASON_HEADER, decision.reason.encode()))
        layers = self.learner.layers if self.learner else None
        if (layers is not None and decision.used is Mode.PUSH and bucket is not None
                and request.push_layers is None):
            exchange.push_layers, why = layers.choose(bucket, measured=request.stream)
            said = {True: "on", False: "off", None: "connector"}[exchange.push_layers]
            self.metrics.push_layers_decisions.inc((said, why))
            exchange.remark(f"push_layers:{said}:{why}")
            if exchange.push_layers is not None:
                headers.append((PUSH_LAYERS_HEADER, said.encode()))
        budget = self.local_budget
        local = decision.used is Mode.LOCAL
        if budget is not None and (request.stream or local):
            # D's inter-token latency is measured, and its local prompts marked
            return ItlWatchedResponse(flow, streaming=request.stream, headers=headers,
                                      done=exchange.finish, exchange=exchange, budget=budget,
                                      local=local)
        return FlowResponse(flow, streaming=request.stream, headers=headers, done=exchange.finish)
