"""An emulation of the Kubernetes API server's pod list and watch, for discovery tests.

It answers what a real client sends for pods in a namespace:
- `GET /api/v1/namespaces/{ns}/pods?labelSelector=...`: a PodList whose
  metadata.resourceVersion is the emulator's current version; with `limit=N`, N pods a
  page, metadata.continue naming the next (the pages are one snapshot, taken at the
  first page, and carry its version; remainingItemCount says how many are left);
- the same with `watch=true&resourceVersion=V` (and timeoutSeconds): a chunked stream of
  newline-delimited watch events (ADDED, MODIFIED, DELETED) after version V, as the API
  server filters them for a label selector (a pod that stops matching is DELETED for that
  watch, one that starts matching is ADDED). A version older than the last `expire` gets
  an ERROR event with a 410 Status, as a real server answers "too old resource version".
  With allowWatchBookmarks, `bookmark` sends a BOOKMARK event with the current version.

Knobs: `put_pod` and `delete_pod` change the pods (with `notify=False` no watch hears of
it, as if the event was lost: only a new list shows it); `drop_watches` ends every open
watch, cleanly or by cutting the connection; `expire` sends open watches a 410 ERROR
(with `notify=False` only later watches from an older version get it: history
compacted); `fail_lists` answers that many lists with 500, `expire_pages` that many
continue tokens with 410; a socket bound but not listening stands for a server that is
down (`bind`, then `listen`). Every request is recorded in `requests`. Equality
selectors only (`a=b`, `a==b`, `a!=b`), which is all discovery sends.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import socket
import time
import uuid
from typing import Any

from aiohttp import web

GONE_STATUS = {
    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
    "reason": "Expired", "code": 410,
}


@dataclasses.dataclass
class SeenRequest:
    path: str
    query: dict[str, str]
    authorization: str | None
    at: float  # time.monotonic()

    @property
    def watch(self) -> bool:
        return self.query.get("watch", "").lower() in ("true", "1")


@dataclasses.dataclass
class Change:
    version: int
    old: dict[str, Any] | None  # the pod before (None: it was created)
    new: dict[str, Any] | None  # the pod after (None: it was deleted)


def matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = (part.strip() for part in term.split("!=", 1))
            if labels.get(key) == value:
                return False
            continue
        key, _, value = term.replace("==", "=").partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


class _Watch:
    def __init__(self, namespace: str, selector: str, bookmarks: bool) -> None:
        self.namespace = namespace
        self.selector = selector
        self.bookmarks = bookmarks
        self.inbox: asyncio.Queue[Change | str] = asyncio.Queue()

    def sees(self, pod: dict[str, Any] | None) -> bool:
        return (pod is not None and pod["metadata"]["namespace"] == self.namespace
                and matches(self.selector, pod["metadata"].get("labels", {})))

    def event(self, change: Change) -> dict[str, Any] | None:
        """The event this watch gets for a change, as the API server filters it."""
        before, after = self.sees(change.old), self.sees(change.new)
        if after and change.new is not None:
            return {"type": "MODIFIED" if before else "ADDED", "object": change.new}
        if before and change.old is not None:  # deleted, or no longer matched
            gone = copy.deepcopy(change.new or change.old)
            gone["metadata"]["resourceVersion"] = str(change.version)
            return {"type": "DELETED", "object": gone}
        return None


class ApiServerEmulator:
    def __init__(self, *, token: str) -> None:
        self.token = token
        self.version = 100
        self.expired_before = 0  # watches from an older version get 410
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: list[Change] = []
        self.requests: list[SeenRequest] = []
        self.fail_lists = 0  # answer this many next lists with 500
        self.expire_pages = 0  # answer this many next continue tokens with 410
        self._snapshots: dict[str, tuple[str, list[dict[str, Any]]]] = {}  # token -> list
        self._watches: set[_Watch] = set()
        self._changed = asyncio.Event()
        self._sock: socket.socket | None = None
        self._runner: web.AppRunner | None = None
        self.app = web.Application()
        self.app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)

    # --- serving --------------------------------------------------------------------

    def bind(self) -> str:
        """Bind 127.0.0.1 on a free port without listening (connections are refused
        until `listen`); return the base URL."""
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    async def listen(self) -> None:
        assert self._sock is not None, "bind first"
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    async def aclose(self) -> None:
        self.drop_watches(clean=True)
        if self._runner is not None:
            await self._runner.cleanup()
        elif self._sock is not None:
            self._sock.close()

    def kubeconfig(self, url: str, namespace: str) -> str:
        """A kubeconfig (YAML is a superset of JSON) that points a client at `url`."""
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": url}}],
            "users": [{"name": "router", "user": {"token": self.token}}],
            "contexts": [{"name": "emulator", "context": {
                "cluster": "emulator", "user": "router", "namespace": namespace}}],
        })

    # --- changing the pods ----------------------------------------------------------

    def put_pod(self, name: str, *, labels: dict[str, str], namespace: str = "llm",
                phase: str = "Running", ip: str | None = None, ready: bool = False,
                deleting: bool = False, notify: bool = True) -> dict[str, Any]:
        """Create or replace a pod (its uid kept); `ready` sets its Ready condition."""
        old = self.pods.get((namespace, name))
        self.version += 1
        status: dict[str, Any] = {"phase": phase, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "ContainersReady", "status": "True" if ready else "False"}]}
        if ip is not None:
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
        metadata: dict[str, Any] = {
            "name": name, "namespace": namespace, "labels": dict(labels),
            "uid": old["metadata"]["uid"] if old else str(uuid.uuid4()),
            "resourceVersion": str(self.version),
            "creationTimestamp": "2026-01-01T00:00:00Z",
        }
        if deleting:
            metadata["deletionTimestamp"] = "2026-01-01T00:10:00Z"
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status}
        self.pods[(namespace, name)] = pod
        self._record(Change(self.version, old, pod), notify=notify)
        return pod

    def delete_pod(self, name: str, *, namespace: str = "llm", notify: bool = True) -> None:
        old = self.pods.pop((namespace, name))
        self.version += 1
        self._record(Change(self.version, old, None), notify=notify)

    def drop_watches(self, *, clean: bool) -> None:
        """End every open watch: cleanly (the stream's last chunk), or by cutting the
        connection mid-stream."""
        for watch in self._watches:
            watch.inbox.put_nowait("end" if clean else "cut")

    def expire(self, *, notify: bool = True) -> None:
        """Forget the history so far: a watch from an older version gets a 410 ERROR
        event, and so do open watches (they end) unless `notify` is False."""
        self.expired_before = self.version
        if notify:
            for watch in self._watches:
                watch.inbox.put_nowait("gone")

    def bookmark(self) -> None:
        """Send every open watch that allows bookmarks a BOOKMARK at the current version."""
        for watch in self._watches:
            if watch.bookmarks:
                watch.inbox.put_nowait("bookmark")

    def _record(self, change: Change, *, notify: bool) -> None:
        if not notify:
            return  # lost: no watch hears of it, and a watch from before does not replay it
        self.history.append(change)
        for watch in self._watches:
            watch.inbox.put_nowait(change)

    # --- what was asked -------------------------------------------------------------

    def lists(self) -> list[SeenRequest]:
        return [r for r in self.requests if not r.watch]

    def watches(self) -> list[SeenRequest]:
        return [r for r in self.requests if r.watch]

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    # --- the API --------------------------------------------------------------------

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        seen = SeenRequest(request.path, dict(request.query),
                           request.headers.get("Authorization"), time.monotonic())
        self.requests.append(seen)
        if seen.authorization != f"Bearer {self.token}":
            return web.json_response(_status(401, "Unauthorized", "no valid token"), status=401)
        namespace = request.match_info["namespace"]
        selector = request.query.get("labelSelector", "")
        if seen.watch:
            return await self._watch(request, namespace, selector)
        if self.fail_lists > 0:
            self.fail_lists -= 1
            return web.json_response(_status(500, "InternalError", "emulated failure"), status=500)
        token = request.query.get("continue")
        if token:
            if self.expire_pages > 0 or token not in self._snapshots:
                self.expire_pages = max(0, self.expire_pages - 1)
                return web.json_response(_status(410, "Expired", "continue token too old"),
                                         status=410)
            version, items = self._snapshots.pop(token)
        else:
            version = str(self.version)
            items = [copy.deepcopy(pod) for (ns, _), pod in sorted(self.pods.items())
                     if ns == namespace and matches(selector, pod["metadata"].get("labels", {}))]
        metadata: dict[str, Any] = {"resourceVersion": version}
        limit = int(request.query.get("limit") or 0)
        if limit and len(items) > limit:
            items, rest = items[:limit], items[limit:]
            metadata["continue"] = next_token = uuid.uuid4().hex
            metadata["remainingItemCount"] = len(rest)
            self._snapshots[next_token] = version, rest
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": metadata,
                                  "items": items})

    async def _watch(self, request: web.Request, namespace: str,
                     selector: str) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or self.version)
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if since < self.expired_before:
            await _send(response, _gone(since, self.version))
            await response.write_eof()
            return response
        watch = _Watch(namespace, selector,
                       request.query.get("allowWatchBookmarks", "").lower() in ("true", "1"))
        for change in self.history:  # what happened since the client's version
            if change.version > since:
                watch.inbox.put_nowait(change)
        self._watches.add(watch)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    item = await watch.inbox.get()
                    if item == "end":
                        break
                    if item == "cut":
                        assert request.transport is not None
                        request.transport.abort()  # no last chunk: the client sees a broken body
                        return response
                    if item == "gone":
                        await _send(response, _gone(since, self.version))
                        break
                    if item == "bookmark":
                        await _send(response, {"type": "BOOKMARK", "object": {
                            "kind": "Pod", "apiVersion": "v1",
                            "metadata": {"resourceVersion": str(self.version)}}})
                        continue
                    assert isinstance(item, Change)
                    event = watch.event(item)
                    if event is not None:
                        await _send(response, event)
        except TimeoutError:
            pass  # timeoutSeconds: the server ends the watch cleanly
        finally:
            self._watches.discard(watch)
        await response.write_eof()
        return response


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(json.dumps(event).encode() + b"\n")


def _gone(since: int, now: int) -> dict[str, Any]:
    status = dict(GONE_STATUS, message=f"too old resource version: {since} ({now})")
    return {"type": "ERROR", "object": status}


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}
