"""Property-based fuzzing of the inference routes (hypothesis).

The router and a healthy fake P and D run ONCE for the module, in a background thread's
event loop (hypothesis drives synchronous tests; each request is handed to that loop).
Bodies are mostly near-valid (a valid request with a few fields mutated: wrong types,
nulls, huge or negative numbers, junk, unicode with escaped lone surrogates, deep lists,
unknown fields), else raw bytes (invalid, truncated or non-UTF-8 JSON, JSON scalars and
arrays, oversized), with fuzzed X-KV-Transfer-Mode, X-Request-Id and Content-Type.

Properties, for every request:
- the router answers within REQUEST_TIMEOUT_S (it never hangs);
- never 5xx: the fakes are healthy, so a 5xx is a router bug;
- a non-2xx answer is OpenAI-shaped JSON whose `code` is the status, and reached no
  upstream; a 2xx answer carries X-KV-Transfer-Mode (pull or push, as asked) and
  X-Request-Id (the client's own when it sent a valid one), and a complete body;
- afterwards nothing is left in flight on P or D.
And valid requests interleaved with (and concurrent to) fuzz, some abandoned by their
client mid-way, keep succeeding.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import re
import threading
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from testbed.fake_vllm import MODEL, Fabric, FakeVLLM, start
from tests.conftest import serve_router

T = TypeVar("T")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_BODY_BYTES = 64 * 1024
REQUEST_TIMEOUT_S = 15.0
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")  # what the router accepts
FUZZ_SETTINGS = settings(
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


# --- the router and fakes, once, in a background event loop ---------------------------


class Harness:
    """A fake P and D and the router, served in one event loop on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.stack = contextlib.AsyncExitStack()

    def run(self, coro: Awaitable[T], timeout: float = REQUEST_TIMEOUT_S + 5) -> T:
        """Run `coro` in the router's loop and return its result, bounded."""
        future = asyncio.run_coroutine_threadsafe(_as_coroutine(coro), self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise AssertionError(f"no result within {timeout} s: the router hangs") from None

    def next_id(self) -> str:
        return "harness-" + next(_ids)

    def __enter__(self) -> Harness:
        self.thread.start()
        self.run(self._up(), timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self.stack.aclose(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    async def _up(self) -> None:
        fabric = Fabric()
        self.prefill = FakeVLLM("prefill", engine_id="engine-p0", side_channel_port=5601, fabric=fabric)
        self.decode = FakeVLLM("decode", engine_id="engine-d0", fabric=fabric)
        urls = []
        for fake in (self.prefill, self.decode):
            runner, fake_url = await start(fake)
            self.stack.push_async_callback(runner.cleanup)
            urls.append(fake_url)
        url, self.app = await self.stack.enter_async_context(
            serve_router(prefill=urls[:1], decode=urls[1:], limits={"max_body_bytes": MAX_BODY_BYTES},
                         auto={"learn": False})  # auto: push, whatever was measured
        )
        self.client = httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S)
        self.stack.push_async_callback(self.client.aclose)

    async def send(self, req: Req, *, abandon_after: float | None = None) -> httpx.Response | None:
        """POST one request; None when the client abandoned it after `abandon_after` s."""
        call = self.client.post(req.path, content=req.body, headers=req.headers)
        if abandon_after is not None:
            try:
                return await asyncio.wait_for(call, abandon_after)
            except TimeoutError:
                return None
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                return await call
        except TimeoutError:
            raise AssertionError(f"no answer within {REQUEST_TIMEOUT_S} s to {req}") from None

    async def quiet(self, timeout: float = 5.0) -> None:
        """Wait until no request is in flight on P or D (leases are given back just
        after the last byte goes out, so allow a moment)."""
        router = self.app.state.router
        try:
            async with asyncio.timeout(timeout):
                while router.prefill.in_flight() or router.decode.in_flight():
                    await asyncio.sleep(0.002)
        except TimeoutError:
            raise AssertionError(
                f"left in flight: prefill={router.prefill.in_flight()} "
                f"decode={router.decode.in_flight()}"
            ) from None

    def seen_ids(self) -> set[str]:
        """X-Request-Ids of every request either fake has received."""
        return {s.headers.get("x-request-id", "") for s in self.prefill.seen + self.decode.seen}

    def upstream_failures(self) -> list[Any]:
        """Requests a fake failed, or raised on (none, with healthy fakes)."""
        return [
            s for s in self.prefill.seen + self.decode.seen
            if s.outcome == "failed" or (s.outcome == "running" and s.finished is not None)
        ]


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    with Harness() as h:
        yield h


# --- requests -------------------------------------------------------------------------


@dataclasses.dataclass
class Req:
    path: str
    body: bytes
    headers: list[tuple[bytes, bytes]]
    request_id: str | None  # the X-Request-Id we sent, when we sent one valid id
    unique_id: bool  # request_id is used by this request alone (so the fakes' logs tell)
    mode: str | None  # the mode asked in a valid X-KV-Transfer-Mode header, if any
    stream: bool = False
    known_good: bool = False  # a valid request: must be served (200)

    def __repr__(self) -> str:
        return f"Req({self.path} body={self.body[:300]!r} headers={self.headers!r})"


_ids = (str(i) for i in itertools.count())  # unique request ids, across shrinking too


def base_body(path: str) -> dict[str, Any]:
    if path == COMPLETIONS:
        return {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


DEEP = "\x00deep:"  # a placeholder string, replaced by n nested lists once serialized
LONG_INT = "\x00long-int:"  # ... or by an integer literal of n digits (past int limits)


def _expand_placeholders(text: str) -> str:
    def deep(m: re.Match[str]) -> str:
        n = int(m.group(1))
        return "[" * n + "]" * n

    text = re.sub(r'"\\u0000deep:(\d+)"', deep, text)
    return re.sub(r'"\\u0000long-int:(\d+)"', lambda m: "9" * int(m.group(1)), text)


surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
texts = st.text(st.one_of(st.characters(), surrogates), max_size=12)
huge_ints = st.one_of(
    st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]),
    st.integers(min_value=-(2**100), max_value=2**100),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    huge_ints,
    st.floats(),  # NaN and +-inf serialize as invalid JSON (NaN, Infinity)
    texts,
    st.sampled_from(["", MODEL, "pull", "push", "null", "0", "[]"]),
)
junk = st.recursive(
    scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(texts, kids, max_size=3)),
    max_leaves=8,
)
# Depths around the router's limit (200) and the interpreter's recursion limit (~1000).
deep_lists = st.one_of(st.integers(1, 64), st.integers(190, 210), st.integers(900, 1100)).map(
    lambda n: f"{DEEP}{n}"
)
long_ints = st.sampled_from([19, 20, 40, 400, 4301, 5000]).map(lambda n: f"{LONG_INT}{n}")
wild = st.one_of(junk, deep_lists, long_ints)

small_counts = st.integers(1, 5)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just(MODEL), st.sampled_from(["", "gpt-17", MODEL.upper(), MODEL + " "]), texts, wild),
    "prompt": st.one_of(
        st.sampled_from(["hi", ["hi"], [1, 2, 3], ["a", "b"], [[1], [2]], "", [], [True], [1, "a"]]),
        texts,
        st.lists(st.integers(-5, 2**40), max_size=4),
        wild,
    ),
    "messages": st.one_of(
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": texts}),
                 min_size=1, max_size=3),
        st.sampled_from([[], [{}], [{"content": "x"}], [{"role": 1}], [{"role": None}], ["user"]]),
        st.lists(st.dictionaries(st.sampled_from(["role", "content", "name"]), wild, max_size=3), max_size=3),
        wild,
    ),
    "stream": st.one_of(st.booleans(), st.none(), wild),
    "max_tokens": st.one_of(small_counts, st.sampled_from([0, -1, 2.0, "5", True]), huge_ints, wild),
    "max_completion_tokens": st.one_of(small_counts, st.sampled_from([0, -1, 1.5]), huge_ints, wild),
    "n": st.one_of(st.sampled_from([1, 2, 0, -1, 1.0, True, None]), huge_ints, wild),
    "best_of": st.one_of(st.sampled_from([1, 3, 0, -2, "1", False, None]), huge_ints, wild),
    "temperature": st.one_of(st.floats(), huge_ints, wild),
    "top_p": wild,
    "stop": st.one_of(st.lists(texts, max_size=3), wild),
    "stream_options": st.one_of(st.just({"include_usage": True}), wild),
    "min_tokens": wild,
    "kv_transfer_params": wild,
}


@st.composite
def json_bodies(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    """A near-valid body: a valid one with 0-4 fields set, replaced or removed."""
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    body = base_body(path)
    mutations = draw(st.integers(0, 4))
    for _ in range(mutations):
        key = draw(st.one_of(st.sampled_from(sorted(FIELDS)), texts))
        if draw(st.integers(0, 5)) == 0:
            body.pop(key, None)
        else:
            body[key] = draw(FIELDS.get(key, wild))
    text = json.dumps(body, ensure_ascii=draw(st.booleans()), allow_nan=True)
    raw = _expand_placeholders(text).encode("utf-8", "surrogatepass")  # lone surrogates: not UTF-8
    return path, raw, mutations == 0


@st.composite
def raw_bodies(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    valid = json.dumps(base_body(path)).encode()
    kind = draw(st.sampled_from(["truncated", "corrupted", "scalar", "fixed", "binary", "huge"]))
    if kind == "truncated":
        raw = valid[: draw(st.integers(0, len(valid) - 1))]
    elif kind == "corrupted":  # bytes spliced in: often non-UTF-8, sometimes inside a string
        at = draw(st.integers(0, len(valid)))
        cut = draw(st.integers(0, 2))
        raw = valid[:at] + draw(st.binary(min_size=1, max_size=4)) + valid[at + cut :]
    elif kind == "scalar":
        value = draw(st.one_of(scalars, st.lists(junk, max_size=3)))
        raw = json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")
    elif kind == "fixed":
        raw = draw(st.sampled_from([
            b"", b" ", b"\n", b"null", b"{}", b"[]", b'""', b"0", b"{", b"}", b"[" * 3000,
            b"\xef\xbb\xbf" + valid, valid + b"\x00", valid + b" {}", valid.decode().encode("utf-16"),
            b'{"model": "fake-model", "prompt": "\\ud800"}', b'{"model": "fake-model", "prompt": "\\udc00\\ud800"}',
            b'{"model": "fake-model", "prompt": "\xff"}', b'{"model": "fake-model", "prompt": "\xed\xa0\x80"}',
            b'{"model": "fake-model", "prompt": "hi", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}",
            b'{"model": "fake-model", "prompt": "hi", "x": ' + b'{"a":' * 1500 + b"0" + b"}" * 1500 + b"}",
            b'{"model": "fake-model", "prompt": "hi", "model": 5}', b'{"model": "fake-model", "prompt": "hi",}',
            b"{'model': 'fake-model', 'prompt': 'hi'}",
        ]))
    elif kind == "binary":
        raw = draw(st.binary(max_size=64))
    else:  # over limits.max_body_bytes
        raw = json.dumps({**base_body(path), "prompt": "x" * (MAX_BODY_BYTES + draw(st.integers(0, 100)))}).encode()
    return path, raw, False


# Header values: visible ASCII and obs-text (0x80-0xff), inner spaces. Control bytes are
# left out: uvicorn's HTTP parser refuses them with a plain-text 400 before the router
# sees the request (test_control_bytes_in_a_header_are_refused_by_the_server).
_header_byte = st.sampled_from([bytes([b]) for b in range(0x21, 0x100) if not 0x7F <= b < 0x80])
header_junk = st.lists(st.one_of(_header_byte, st.just(b" ")), max_size=20).map(
    lambda parts: b"".join(parts).strip(b" ")
)
header_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cc", "Cs"]), max_size=20).map(
    lambda s: s.encode("utf-8").strip()
)
fuzzed_header = st.one_of(header_junk, header_text)
MODES = [b"pull", b"push", b"auto", b"PUSH", b"Pull", b"aUtO"]
CONTENT_TYPES = [
    b"application/json", b"application/json; charset=utf-8", b"application/json; charset=latin-1",
    b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x",
    b"application/octet-stream", b"*/*",
]


@st.composite
def fuzz_requests(draw: st.DrawFn) -> Req:
    path, body, known_good = draw(st.one_of(json_bodies(), json_bodies(), json_bodies(), raw_bodies()))
    headers: list[tuple[bytes, bytes]] = []

    mode_choice = draw(st.sampled_from(["none", "valid", "fuzz"]))
    mode: str | None = None
    if mode_choice == "valid":
        value = draw(st.sampled_from(MODES))
        mode = value.decode().lower()
        headers.append((b"X-KV-Transfer-Mode", value))
    elif mode_choice == "fuzz":
        value = draw(fuzzed_header)
        headers.append((b"X-KV-Transfer-Mode", value))
        mode = value.decode("latin-1").strip().lower() if value else None  # as the router reads it
        if mode not in (None, "pull", "push", "auto"):
            mode, known_good = None, False

    request_id: str | None = None
    unique_id = False
    id_choice = draw(st.sampled_from(["ours", "ours", "none", "fuzz", "pattern", "long"]))
    if id_choice == "ours":
        request_id, unique_id = "fuzz-" + next(_ids), True
    elif id_choice == "fuzz":
        value = draw(fuzzed_header)
        headers.append((b"X-Request-Id", value))
        text = value.decode("latin-1")
        if text and not REQUEST_ID_RE.match(text):
            known_good = False
    elif id_choice == "pattern":
        request_id = draw(st.from_regex(REQUEST_ID_RE, fullmatch=True))
    elif id_choice == "long":
        headers.append((b"X-Request-Id", b"a" * draw(st.integers(129, 300))))
        known_good = False
    if request_id is not None:
        headers.append((b"X-Request-Id", request_id.encode()))

    ct_choice = draw(st.sampled_from(["none", "listed", "fuzz"]))
    if ct_choice == "listed":
        headers.append((b"Content-Type", draw(st.sampled_from(CONTENT_TYPES))))
    elif ct_choice == "fuzz":
        headers.append((b"Content-Type", draw(fuzzed_header)))
    if draw(st.integers(0, 9)) == 0:  # an unknown X- header too
        headers.append((b"X-" + draw(st.sampled_from([b"Foo", b"Kv-Transfer", b"Request"])), draw(fuzzed_header)))

    stream = False
    if known_good:
        stream = json.loads(body).get("stream") is True
    return Req(path, body, headers, request_id, unique_id, mode, stream, known_good)


@st.composite
def valid_requests(draw: st.DrawFn) -> Req:
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    body = base_body(path)
    stream = draw(st.booleans())
    body["stream"] = stream
    body["max_tokens"] = draw(st.integers(1, 4))
    mode = draw(st.sampled_from([None, "pull", "push", "auto"]))
    request_id = "valid-" + next(_ids)
    headers = [(b"X-Request-Id", request_id.encode()), (b"Content-Type", b"application/json")]
    if mode is not None:
        headers.append((b"X-KV-Transfer-Mode", mode.encode()))
    return Req(path, json.dumps(body).encode(), headers, request_id, True, mode, stream, known_good=True)


# --- the properties -------------------------------------------------------------------


def check_answer(h: Harness, req: Req, r: httpx.Response) -> None:
    """Every property one answer must have."""
    status = r.status_code
    assert status < 500, f"{status} from healthy fakes: {r.text[:500]!r} for {req!r}"
    if req.known_good:
        assert status == 200, f"a valid request got {status}: {r.text[:500]!r} for {req!r}"
    if not 200 <= status < 300:
        try:
            payload = r.json()
        except ValueError:
            raise AssertionError(f"{status} answer is not JSON: {r.content[:300]!r} for {req!r}") from None
        assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), payload
        error = payload["error"]
        assert isinstance(error.get("message"), str) and error["message"], payload
        assert isinstance(error.get("type"), str) and error["type"], payload
        assert type(error.get("code")) is int and error["code"] == status, payload
        assert r.headers.get("content-type", "").startswith("application/json"), r.headers
        if req.unique_id:  # refused at the edge: no upstream saw it
            assert req.request_id not in h.seen_ids(), f"refused request reached an upstream: {req!r}"
        return
    mode = r.headers.get("x-kv-transfer-mode")
    assert mode in ("pull", "push"), r.headers
    if req.mode is not None:  # both fakes can do both modes: no fallback
        assert mode == ("pull" if req.mode == "pull" else "push"), (mode, req)
    rid = r.headers.get("x-request-id")
    assert rid, r.headers
    if req.request_id is not None:
        assert rid == req.request_id, (rid, req)
    if req.unique_id:
        assert rid in h.seen_ids(), f"served without reaching the fakes? {req!r}"
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text
        for event in events[:-1]:
            assert "error" not in json.loads(event), r.text
    else:
        assert not req.stream, f"asked a stream, got {r.headers.get('content-type')}"
        answer = r.json()
        assert isinstance(answer, dict) and answer.get("choices"), answer


def _regression(body: bytes, mode: bytes = b"pull") -> Req:
    rid = "regression-" + next(_ids)
    return Req(COMPLETIONS, body, [(b"X-Request-Id", rid.encode()), (b"X-KV-Transfer-Mode", mode)],
               rid, True, mode.decode())


@settings(FUZZ_SETTINGS, max_examples=180)
@given(req=fuzz_requests())
# Were 500s: bytes that are not UTF-8 inside a JSON string (UnicodeDecodeError) ...
@example(req=_regression(b'{"\x80model": "fake-model", "prompt": "hello", "max_tokens": 2}'))
@example(req=_regression(b'{"model": "fake-model", "prompt": "\xed\xa0\x80"}'))
# ... lists nested so deep that decoding them at the edge failed (RecursionError) ...
@example(req=_regression(b'{"model": "fake-model", "prompt": "hi", "x": ' + b"[" * 990 + b"]" * 990 + b"}"))
# ... or worked, but encoding P's leg a few frames deeper did not (a plain-text 500).
@example(req=_regression(b'{"model": "fake-model", "prompt": "hi", "x": ' + b"[" * 985 + b"]" * 985 + b"}"))
def test_fuzzed_request_gets_a_well_formed_answer(harness: Harness, req: Req) -> None:
    r = harness.run(harness.send(req))
    assert r is not None
    event(f"status {r.status_code}")
    check_answer(harness, req, r)
    harness.run(harness.quiet())


@settings(FUZZ_SETTINGS, max_examples=60)
@given(
    steps=st.lists(
        st.tuples(
            fuzz_requests(),
            valid_requests(),
            st.booleans(),  # send the two at once, or one after the other
            st.one_of(st.none(), st.tuples(valid_requests(), st.floats(0.0, 0.02))),  # abandoned
        ),
        min_size=1,
        max_size=4,
    )
)
def test_valid_requests_keep_succeeding_among_fuzz(
    harness: Harness, steps: list[tuple[Req, Req, bool, tuple[Req, float] | None]]
) -> None:
    for fuzz, valid, together, abandoned in steps:

        async def step(
            fuzz: Req = fuzz, valid: Req = valid, together: bool = together,
            abandoned: tuple[Req, float] | None = abandoned,
        ) -> list[httpx.Response | None]:
            sends = [harness.send(fuzz), harness.send(valid)]
            if abandoned is not None:  # its client leaves after a moment, maybe mid-answer
                sends.append(harness.send(abandoned[0], abandon_after=abandoned[1]))
            if together:
                return list(await asyncio.gather(*sends))
            return [await s for s in sends]

        answers = harness.run(step())
        assert answers[0] is not None and answers[1] is not None
        check_answer(harness, fuzz, answers[0])
        check_answer(harness, valid, answers[1])
        if abandoned is not None and answers[2] is not None:  # answered before its client left
            check_answer(harness, abandoned[0], answers[2])
        harness.run(harness.quiet())
    assert harness.upstream_failures() == []


def test_router_still_serves_after_the_fuzz(harness: Harness) -> None:
    """Runs last: the router serves a valid request in each mode, nothing is in flight,
    and no fake ever failed a request (all 5xx would have been the router's)."""
    for path in (COMPLETIONS, CHAT):
        for mode in ("pull", "push"):
            rid = harness.next_id()
            req = Req(path, json.dumps(base_body(path)).encode(),
                      [(b"X-Request-Id", rid.encode()), (b"X-KV-Transfer-Mode", mode.encode())],
                      rid, True, mode, known_good=True)
            r = harness.run(harness.send(req))
            assert r is not None and r.status_code == 200, r
            check_answer(harness, req, r)
    harness.run(harness.quiet())
    router = harness.app.state.router
    assert router.prefill.in_flight() == 0 and router.decode.in_flight() == 0
    assert harness.upstream_failures() == []


def test_control_bytes_in_a_header_are_refused_by_the_server(harness: Harness) -> None:
    """Not the router's doing: uvicorn's parser (httptools) refuses a header value with a
    control byte, with a plain-text 400, before the app runs. Pinned so that a change
    (say, to an OpenAI-shaped body) is noticed; the router keeps serving."""
    for header in (b"X-Request-Id", b"X-KV-Transfer-Mode", b"X-Foo"):
        rid = harness.next_id()
        req = Req(COMPLETIONS, json.dumps(base_body(COMPLETIONS)).encode(),
                  [(header, b"a\x1fb"), (b"X-Request-Id", rid.encode())], rid, True, None)
        r = harness.run(harness.send(req))
        assert r is not None and r.status_code == 400, r
        assert rid not in harness.seen_ids()
    rid = harness.next_id()
    good = Req(COMPLETIONS, json.dumps(base_body(COMPLETIONS)).encode(),
               [(b"X-Request-Id", rid.encode())], rid, True, None, known_good=True)
    r = harness.run(harness.send(good))
    assert r is not None
    check_answer(harness, good, r)
