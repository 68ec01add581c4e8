"""The client for vLLM servers (aiohttp), and the one place where aiohttp's and asyncio's
errors become the router's `UpstreamError`s.

Two calls: `post_json` waits for a whole JSON answer (P's leg, probes), and `stream`
opens a response whose body is read chunk by chunk as it arrives (D's leg), always
inside `async with` so that the connection is released, or closed when a leg is
cancelled: closing the connection is how vLLM learns to abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import msgspec

from proxy.config import Limits, Timeouts
from proxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)

_JSON = {"Content-Type": "application/json"}


@contextlib.contextmanager
def upstream_errors(endpoint: str, cluster: str, what: str) -> Iterator[None]:
    """Map aiohttp/asyncio failures inside the block to UpstreamError, most specific first."""
    try:
        yield
    except UpstreamError:
        raise
    except TimeoutError as exc:  # asyncio.timeout and aiohttp's timeouts both end here
        raise UpstreamTimeout(
            f"{cluster} server {endpoint} did not answer {what} in time",
            endpoint=endpoint,
            cluster=cluster,
        ) from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamConnectError(
            f"cannot connect to {cluster} server {endpoint}: {exc.os_error or exc}",
            endpoint=endpoint,
            cluster=cluster,
        ) from exc
    except (aiohttp.ClientError, msgspec.DecodeError, ValueError) as exc:
        raise UpstreamProtocolError(
            f"{cluster} server {endpoint} broke off {what}: {type(exc).__name__}: {exc}",
            endpoint=endpoint,
            cluster=cluster,
        ) from exc


class StreamedResponse:
    """An open upstream response: status, headers, and its body as it arrives."""

    def __init__(
        self, response: aiohttp.ClientResponse, *, endpoint: str, cluster: str, idle: float
    ) -> None:
        self.status = response.status
        self.content_type = response.headers.get("Content-Type", "application/json")
        self._response = response
        self._endpoint = endpoint
        self._cluster = cluster
        self._idle = idle

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they come; a silence longer than `stream_idle` is a timeout."""
        content = self._response.content
        while True:
            with upstream_errors(self._endpoint, self._cluster, "the rest of its answer"):
                async with asyncio.timeout(self._idle):
                    chunk = await content.readany()
            if not chunk:
                return
            yield chunk

    async def read(self) -> bytes:
        with upstream_errors(self._endpoint, self._cluster, "its answer"):
            async with asyncio.timeout(self._idle):
                return await self._response.read()


class UpstreamClient:
    """One aiohttp session shared by every upstream; create in the app's lifespan."""

    def __init__(self, timeouts: Timeouts, limits: Limits) -> None:
        self._timeouts = timeouts
        connector = aiohttp.TCPConnector(
            limit=limits.max_connections, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=300
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect),
            json_serialize=lambda obj: msgspec.json.encode(obj).decode(),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def aclose(self) -> None:
        await self._session.close()

    async def get_json(
        self, url: str, *, endpoint: str, cluster: str, timeout: float, expect_json: bool = True
    ) -> Any:
        """GET and decode the JSON answer (or only check the status: expect_json=False)."""
        with upstream_errors(endpoint, cluster, f"GET {url}"):
            async with asyncio.timeout(timeout):
                async with self._session.get(url) as response:
                    content = await response.read()
                    _raise_for_status(response.status, content, endpoint, cluster)
                    return msgspec.json.decode(content) if expect_json else None

    async def post_json(
        self,
        url: str,
        body: dict[str, Any],
        *,
        headers: dict[str, str],
        endpoint: str,
        cluster: str,
        timeout: float,
    ) -> Any:
        """POST and decode the whole JSON answer; error statuses raise UpstreamStatusError."""
        with upstream_errors(endpoint, cluster, "its answer"):
            async with asyncio.timeout(timeout):
                async with self._session.post(
                    url, data=msgspec.json.encode(body), headers={**_JSON, **headers}
                ) as response:
                    content = await response.read()
                    _raise_for_status(response.status, content, endpoint, cluster)
                    return msgspec.json.decode(content)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        url: str,
        body: dict[str, Any],
        *,
        headers: dict[str, str],
        endpoint: str,
        cluster: str,
    ) -> AsyncIterator[StreamedResponse]:
        """POST and yield the open response once its headers are in (bounded by
        `first_token`). Error statuses raise UpstreamStatusError with the body."""
        with upstream_errors(endpoint, cluster, "with its first byte"):
            async with asyncio.timeout(self._timeouts.first_token):
                response = await self._session.post(
                    url, data=msgspec.json.encode(body), headers={**_JSON, **headers}
                )
        try:
            if response.status >= 400:
                with upstream_errors(endpoint, cluster, "its error body"):
                    async with asyncio.timeout(self._timeouts.stream_idle):
                        content = await response.read()
                _raise_for_status(response.status, content, endpoint, cluster)
            yield StreamedResponse(
                response, endpoint=endpoint, cluster=cluster, idle=self._timeouts.stream_idle
            )
        finally:
            # On any exit, cancellation included: a finished body returns the connection
            # to the pool, an unfinished one is closed so the server aborts the request.
            response.release() if response.content.at_eof() else response.close()


def _raise_for_status(status: int, content: bytes, endpoint: str, cluster: str) -> None:
    if status >= 400:
        raise UpstreamStatusError(
            f"{cluster} server {endpoint} answered {status}",
            status=status,
            content=content,
            endpoint=endpoint,
            cluster=cluster,
        )
