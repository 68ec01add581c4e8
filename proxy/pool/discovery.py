"""Kubernetes discovery: P and D servers found as pods by label selectors.

`KubernetesDiscovery` owns one task (the Router starts it and closes it). Inside, a task
group runs one `_follow` loop per cluster and a sweeper:

- A loop lists its selector's pods, `list_page_size` a page (limit and continue: the
  pages of one list are one snapshot, at the first page's resourceVersion), makes its
  cluster match them, then watches from that version: each ADDED, MODIFIED or DELETED
  event changes one pod, and every event and BOOKMARK (asked for: the API server sends
  one now and then with a newer version) moves the version the loop holds. When the API
  server ends the watch (after `watch_timeout`), the loop watches again from that
  version: no list. It lists again only when the watch answers 410 Gone (the version is
  too old: history compacted), or a list or watch call fails, after a backoff
  (`backoff_base`, doubled up to `backoff_max`, reset once a watch has brought an event
  or lasted `backoff_max`; a watch that ends at once with nothing is resumed after one
  too). Each of these is logged and counted in `pdproxy_discovery_events{cluster,kind}`.
- A pod joins its cluster when it is Running and Ready with an IP, as
  http://{podIP}:{port} (an IPv6 address in brackets), through `Membership.add`, like an
  admin call.
- Readiness has hysteresis, in time rather than in events (a pod may send one event for
  a long change): a serving pod seen not Ready is drained once it has stayed so for
  `drain_after` seconds (it takes no new request, running ones finish, and it stays
  listed and health-checked), and a drained pod seen Ready again takes requests once it
  has stayed so for `undrain_after` seconds. A flip back within the time cancels it.
  The sweeper looks every `sweep_interval` at the pods waiting for either.
- A pod deleted, terminating (deletionTimestamp), finished (Succeeded/Failed) or no longer
  matched by the selector leaves: drained at once, then removed by the sweeper once no
  request is on it (the last server of a cluster too: a cluster can be empty). Once
  removed and idle, what the router kept for it goes (`Membership.retire`: connection
  pools, credentials, metric series).

Servers it added are in `Membership.discovered`, so a watched config file's lists leave
them alone. The records live on the event loop only (no thread, no lock); the
Kubernetes client is `kubernetes_asyncio` (the `kubernetes` extra), imported only here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from typing import TYPE_CHECKING, Any, cast

import msgspec
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException

from proxy.config import EndpointConfig, KubernetesDiscoveryConfig
from proxy.metrics import RouterMetrics
from proxy.pool.endpoints import ClusterName, Endpoint
from proxy.pool.membership import Membership

if TYPE_CHECKING:
    from aiohttp import ClientResponse  # the client's, with _preload_content=False

logger = logging.getLogger("pdproxy.discovery")

DEFAULT_SWEEP_INTERVAL = 0.5  # seconds between two looks for leaving pods with no request
GONE = 410  # the API server's answer to a watch from a resourceVersion it no longer has
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


# --- the wire: the few fields of a pod that discovery reads (the rest is ignored) -------

class PodCondition(msgspec.Struct, frozen=True):
    type: str
    status: str


class PodStatus(msgspec.Struct, frozen=True):
    phase: str | None = None
    pod_ip: str | None = msgspec.field(default=None, name="podIP")
    conditions: list[PodCondition] | None = None


class PodMeta(msgspec.Struct, frozen=True):
    name: str
    uid: str
    deletion_timestamp: str | None = msgspec.field(default=None, name="deletionTimestamp")
    resource_version: str | None = msgspec.field(default=None, name="resourceVersion")


class Pod(msgspec.Struct, frozen=True):
    metadata: PodMeta
    status: PodStatus = PodStatus()

    @property
    def ready(self) -> bool:
        """Running and Ready with an IP: it may take requests."""
        s = self.status
        return (s.phase == "Running" and bool(s.pod_ip) and any(
            c.type == "Ready" and c.status == "True" for c in s.conditions or ()))

    @property
    def leaving(self) -> bool:
        """Terminating or finished: it will not serve again."""
        return self.metadata.deletion_timestamp is not None or self.status.phase in FINISHED_PHASES


class ListMeta(msgspec.Struct, frozen=True):
    resource_version: str = msgspec.field(name="resourceVersion")
    # The next page's token; empty on the last page.
    next_page: str | None = msgspec.field(default=None, name="continue")


class PodList(msgspec.Struct, frozen=True):
    metadata: ListMeta
    items: list[Pod] | None = None


# --- the records ------------------------------------------------------------------------

class PodState(enum.Enum):
    SERVING = "serving"  # Ready: takes requests
    NOT_READY = "not_ready"  # drained; back when Ready again
    LEAVING = "leaving"  # drained; removed once no request is on it


@dataclasses.dataclass
class PodMember:
    """One discovered pod and the endpoint it is (owned by its cluster's `_follow` loop
    and the sweeper, both on the event loop)."""

    uid: str
    name: str
    endpoint: Endpoint
    state: PodState = PodState.SERVING
    ready: bool = True  # as last seen
    since: float = dataclasses.field(default_factory=time.monotonic)  # seen so since then

    def seen(self, ready: bool, now: float) -> None:
        if ready != self.ready:
            self.ready, self.since = ready, now


@dataclasses.dataclass
class WatchProgress:
    """How far one cluster's loop has followed its pods."""

    version: str  # the newest resourceVersion seen: the list's, an event's, a bookmark's
    events: int = 0  # events and bookmarks the current watch brought


@dataclasses.dataclass
class PodSet:
    """One cluster's selector and the pods it found, by pod uid."""

    cluster: ClusterName
    selector: str
    members: dict[str, PodMember] = dataclasses.field(default_factory=dict)


class Backoff:
    """Delays that double from `base` up to `maximum`; `reset` starts again at `base`."""

    def __init__(self, base: float, maximum: float) -> None:
        self._base = base
        self._maximum = maximum
        self._next = base

    def next(self) -> float:
        delay = self._next
        self._next = min(delay * 2, self._maximum)
        return delay

    def reset(self) -> None:
        self._next = self._base


def pod_url(ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


async def api_client(settings: KubernetesDiscoveryConfig) -> k8s_client.ApiClient:
    """A client for the kubeconfig file, else the pod's service account (in-cluster)."""
    try:
        if settings.kubeconfig is not None:
            client: k8s_client.ApiClient = await k8s_config.new_client_from_config(
                config_file=settings.kubeconfig, persist_config=False)
            return client
        configuration = k8s_client.Configuration()
        k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration)
        return k8s_client.ApiClient(configuration=configuration)
    except (OSError, k8s_config.ConfigException) as exc:
        where = settings.kubeconfig or "the in-cluster service account"
        raise ValueError(f"discovery.kubernetes: cannot reach Kubernetes with {where}: {exc} "
                         "(set discovery.kubernetes.kubeconfig outside a cluster)") from exc


class KubernetesDiscovery:
    """`await start()` (inside the running loop; a bad kubeconfig raises ValueError),
    `await aclose()` to stop."""

    def __init__(self, settings: KubernetesDiscoveryConfig, membership: Membership,
                 metrics: RouterMetrics, *, sweep_interval: float = DEFAULT_SWEEP_INTERVAL) -> None:
        self._settings = settings
        self._membership = membership
        self._metrics = metrics
        self._sweep_interval = sweep_interval
        self.pods = [PodSet(ClusterName.PREFILL, settings.prefill_selector.strip()),
                     PodSet(ClusterName.DECODE, settings.decode_selector.strip())]
        self._api: k8s_client.ApiClient | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("Kubernetes discovery is already started")
        self._api = await api_client(self._settings)
        self._task = asyncio.create_task(self._run(), name="kubernetes-discovery")
        logger.info("Kubernetes discovery in namespace %s: prefill %r, decode %r, port %d",
                    self._settings.namespace, self.pods[0].selector, self.pods[1].selector,
                    self._settings.port)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for pods in self.pods:
                    group.create_task(self._follow(pods), name=f"discovery-{pods.cluster.value}")
                group.create_task(self._sweep(), name="discovery-sweep")
        except Exception:  # the loops catch their errors; this would be a bug
            logger.exception("Kubernetes discovery stopped")

    # --- list, then watch -----------------------------------------------------------

    async def _follow(self, pods: PodSet) -> None:
        backoff = Backoff(self._settings.backoff_base, self._settings.backoff_max)
        progress: WatchProgress | None = None  # None: list first
        while True:
            if progress is None:
                try:
                    progress = WatchProgress(await self._list(pods))
                except Exception as exc:
                    self._count(pods, "list_error")
                    delay = backoff.next()
                    logger.warning("%s pods: list failed (%s); listing again in %.1f s",
                                   pods.cluster.value, _describe(exc), delay)
                    await asyncio.sleep(delay)
                    continue
            started = time.monotonic()
            progress.events = 0
            try:
                await self._watch(pods, progress)
                kind, why = "watch_closed", "the watch ended"
            except ApiException as exc:
                kind, why = (("gone", "410 Gone (its resourceVersion is too old)")
                             if exc.status == GONE
                             else ("watch_error", f"the watch failed ({_describe(exc)})"))
            except Exception as exc:
                kind, why = "watch_error", f"the watch failed ({_describe(exc)})"
            self._count(pods, kind)
            lasted = time.monotonic() - started
            went_well = progress.events > 0 or lasted >= self._settings.backoff_max
            if went_well:
                backoff.reset()
            if kind == "watch_closed":  # resume from the version held
                delay = 0.0 if went_well else backoff.next()
                logger.info("%s pods: %s; watching again from version %s in %.1f s",
                            pods.cluster.value, why, progress.version, delay)
            else:
                progress = None
                delay = backoff.next()
                logger.log(logging.WARNING if kind == "watch_error" else logging.INFO,
                           "%s pods: %s; listing again in %.1f s", pods.cluster.value, why, delay)
            await asyncio.sleep(delay)

    async def _list(self, pods: PodSet) -> str:
        """List the selector's pods, a page at a time, and make the cluster match them;
        return the list's version."""
        assert self._api is not None  # started
        core = k8s_client.CoreV1Api(self._api)
        settings = self._settings
        items: list[Pod] = []
        version: str | None = None
        page: str | None = None
        pages = 0
        while True:
            paging: dict[str, Any] = {}
            if settings.list_page_size:
                paging["limit"] = settings.list_page_size
            if page:
                paging["_continue"] = page
            async with asyncio.timeout(settings.request_timeout):  # each page's whole call
                # The raw body, decoded here into `Pod`s: no model objects per pod.
                response = cast("ClientResponse", await core.list_namespaced_pod(
                    settings.namespace, label_selector=pods.selector, _preload_content=False,
                    **paging))
                try:
                    body = await response.read()
                finally:
                    response.release()
            if not 200 <= response.status < 300:
                raise ApiException(status=response.status, reason=response.reason)
            listed = msgspec.json.decode(body, type=PodList)
            pages += 1
            items += listed.items or []
            version = version or listed.metadata.resource_version  # the first page's
            page = listed.metadata.next_page
            if not page:
                break
        self._count(pods, "list")
        logger.debug("%s pods: listed %d in %d page(s) at version %s", pods.cluster.value,
                     len(items), pages, version)
        self._reconcile(pods, items)
        return version

    async def _watch(self, pods: PodSet, progress: WatchProgress) -> None:
        """Apply the watch's events until it ends; an ERROR event raises ApiException."""
        assert self._api is not None  # started
        core = k8s_client.CoreV1Api(self._api)
        settings = self._settings
        # Raw objects (decoded here into `Pod`), and no retry inside the client: with
        # timeout_seconds it hands every end and every 410 to this loop.
        async with k8s_watch.Watch(return_type="object") as watch:
            stream = watch.stream(
                core.list_namespaced_pod, settings.namespace, label_selector=pods.selector,
                resource_version=progress.version, timeout_seconds=settings.watch_timeout,
                allow_watch_bookmarks=True,
                # connect, then the longest silence: a quiet watch may send nothing at all
                _request_timeout=(settings.request_timeout,
                                  settings.watch_timeout + settings.request_timeout))
            async for event in stream:
                kind = event["type"]
                if kind == "BOOKMARK":  # only a newer version to resume from
                    progress.version = event["raw_object"]["metadata"]["resourceVersion"]
                    progress.events += 1
                    continue
                if kind not in ("ADDED", "MODIFIED", "DELETED"):
                    continue
                progress.events += 1
                pod = msgspec.convert(event["raw_object"], Pod)
                self._apply(pods, pod, gone=kind == "DELETED")
                progress.version = pod.metadata.resource_version or progress.version

    # --- membership -----------------------------------------------------------------

    def _reconcile(self, pods: PodSet, listed: list[Pod]) -> None:
        """Apply a full list: every pod in it, and those missing from it leave."""
        present = set()
        for pod in listed:
            present.add(pod.metadata.uid)
            self._apply(pods, pod, gone=False)
        for uid, member in list(pods.members.items()):
            if uid not in present and member.state is not PodState.LEAVING:
                self._leave(pods, member)

    def _apply(self, pods: PodSet, pod: Pod, *, gone: bool) -> None:
        member = pods.members.get(pod.metadata.uid)
        if gone or pod.leaving:
            if member is not None and member.state is not PodState.LEAVING:
                self._leave(pods, member)
            return
        if not pod.ready:
            if member is not None and member.state is not PodState.LEAVING:
                member.seen(False, time.monotonic())
                self._settle(pods, member)
            return
        assert pod.status.pod_ip  # ready
        url = pod_url(pod.status.pod_ip, self._settings.port)
        if member is not None and member.endpoint.url != url:  # a new IP: a new server
            self._remove(pods, member)
            member = None
        elif member is not None and not self._ours(pods, member):  # removed by an admin call
            self._remove(pods, member)
            member = None
        if member is None:
            self._join(pods, pod, url)
        elif member.state is not PodState.LEAVING:
            member.seen(True, time.monotonic())
            self._settle(pods, member)

    def _settle(self, pods: PodSet, member: PodMember) -> None:
        """Drain a serving pod not Ready for drain_after, take back a drained one Ready
        for undrain_after (the readiness hysteresis)."""
        held = time.monotonic() - member.since
        if member.state is PodState.SERVING and not member.ready:
            if held >= self._settings.drain_after:
                self._drain(pods, member, PodState.NOT_READY)
        elif member.state is PodState.NOT_READY and member.ready:
            if held >= self._settings.undrain_after:
                member.state = PodState.SERVING
                if self._ours(pods, member):
                    self._membership.drain(pods.cluster, member.endpoint.url, draining=False)
                self._count(pods, "undrained")
                logger.info("%s pod %s (%s) is ready again: takes requests",
                            pods.cluster.value, member.name, member.endpoint.url)

    def _join(self, pods: PodSet, pod: Pod, url: str) -> None:
        stale = next((m for m in pods.members.values() if m.endpoint.url == url), None)
        if stale is not None:  # its IP went to this pod: the old one is gone
            self._remove(pods, stale)
        if self._membership.cluster(pods.cluster).find(url) is not None:
            logger.warning("%s pod %s at %s: that server is already configured (config file "
                           "or admin API); left as it is", pods.cluster.value,
                           pod.metadata.name, url)
            return
        endpoint = self._membership.add(pods.cluster, EndpointConfig(url=url))
        self._membership.discovered.add(endpoint)
        pods.members[pod.metadata.uid] = PodMember(pod.metadata.uid, pod.metadata.name, endpoint)
        self._count(pods, "joined")
        logger.info("%s pod %s joined as %s", pods.cluster.value, pod.metadata.name, url)

    def _drain(self, pods: PodSet, member: PodMember, state: PodState) -> None:
        member.state = state
        if self._ours(pods, member) and not member.endpoint.draining:
            self._membership.drain(pods.cluster, member.endpoint.url, draining=True)
        self._count(pods, "drained" if state is PodState.NOT_READY else "left")
        logger.info("%s pod %s (%s) %s", pods.cluster.value, member.name, member.endpoint.url,
                    "is not ready: drained" if state is PodState.NOT_READY
                    else "is gone: drained, removed once idle")

    def _leave(self, pods: PodSet, member: PodMember) -> None:
        self._drain(pods, member, PodState.LEAVING)
        if member.endpoint.in_flight == 0:
            self._remove(pods, member)

    def _remove(self, pods: PodSet, member: PodMember) -> None:
        del pods.members[member.uid]
        self._membership.discovered.discard(member.endpoint)
        if self._ours(pods, member):
            self._membership.remove(pods.cluster, member.endpoint.url, allow_last=True)

    def _ours(self, pods: PodSet, member: PodMember) -> bool:
        """Still the member of its cluster (an admin call may have removed it)."""
        found = self._membership.cluster(pods.cluster).find(member.endpoint.url)
        return found is member.endpoint

    async def _sweep(self) -> None:
        """Remove leaving pods once no request is on them; drain or take back the pods
        whose readiness has held long enough."""
        while True:
            await asyncio.sleep(self._sweep_interval)
            for pods in self.pods:
                for member in list(pods.members.values()):
                    if member.state is not PodState.LEAVING:
                        self._settle(pods, member)
                    elif member.endpoint.in_flight == 0:
                        self._remove(pods, member)

    def _count(self, pods: PodSet, kind: str) -> None:
        self._metrics.child(self._metrics.discovery_events, pods.cluster.value, kind).inc()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


__all__ = ["Backoff", "KubernetesDiscovery", "Pod", "PodList", "api_client", "pod_url"]
