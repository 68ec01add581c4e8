"""A small HTTP/1.1 client for the hot path: keep-alive connections on asyncio protocols,
with httptools (the parser uvicorn uses) reading the answers.

Why not aiohttp: measured here, a bare Starlette app relaying to P then D through
aiohttp tops out near 1,000 requests/s on one core, two thirds of it in aiohttp's
request machinery. The router talks to vLLM servers only: plain HTTP/1.1, JSON bodies,
answers with Content-Length or chunked (SSE). That needs far less code than a general
client, and these rules:

- One request at a time per connection; a LIFO list of idle connections per server,
  reused only while idle less than `idle_reuse` seconds (set it below the servers' own
  keep-alive, so that a server rarely closes a connection as we send on it).
- A connection goes back for reuse only when its answer has ended *and* every byte of
  it has been handed to its reader (or its caller released it): a streamed answer whose
  reading is paused by backpressure (a slow client lets chunks pile up) is never lent
  to another request. An idle connection that
  receives any byte (nobody asked for it) or is closed by its server is closed and
  forgotten.
- `max_connections` caps a client's open connections, idle ones included. A request
  waits for room at most `pool_timeout` seconds, first come first served, then fails
  with `PoolTimeout` (our overload, not the server's fault). A connection that closes
  passes its slot straight to the first waiter, and one that goes idle while requests
  wait goes to the first of them (closed instead when that one is for another server,
  so that its slot does): nobody waits while a connection sits idle.
- Interim answers (100 Continue, 103 Early Hints) are skipped; a body without
  Content-Length or chunked encoding ends when the server closes the connection (a
  complete answer, not a lost one); status lines and headers over `max_header_bytes`
  are a broken answer (`MalformedAnswer`), and so is a whole body over its reader's
  cap (`AnswerTooLarge`, from `Response.read(limit)` or `Pool.fetch(limit=)`).
- An answer is read as it comes (`Pool.request`: a `Response`, for D's streams) or
  whole (`Pool.fetch`: a `Fetch`, for every answer wanted whole). A fetch wakes its
  caller once, when the answer has ended, and its connection is back in the pool by
  then.
- A request sent on a reused connection that its server closes before any byte of an
  answer arrived (it timed the idle connection out as we sent) is sent once more, on a
  new connection: the server closed without reading it.

Only `proxy.upstream.client` uses this module; it maps the errors raised here (`PoolTimeout`,
`ConnectFailed`, `ConnectionLost`, `MalformedAnswer`, `httptools.HttpParserError`,
TimeoutError from its own bounds) to the router's own.
"""

from proxy.upstream.http11.connection import (
    AnswerTooLarge,
    ConnectFailed,
    Connection,
    ConnectionLost,
    Fetch,
    Incoming,
    MalformedAnswer,
    PoolTimeout,
    Response,
)
from proxy.upstream.http11.pool import Client, ConnectionCounts, Deadlines, Pool, Slots

__all__ = [
    "AnswerTooLarge",
    "Client",
    "ConnectFailed",
    "Connection",
    "ConnectionCounts",
    "ConnectionLost",
    "Deadlines",
    "Fetch",
    "Incoming",
    "MalformedAnswer",
    "Pool",
    "PoolTimeout",
    "Response",
    "Slots",
]
