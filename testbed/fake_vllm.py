"""A fake vLLM server for fast tests, fault injection and proxy-overhead benchmarks.

It speaks the P/D contract the router relies on (see the router's `protocol.py`):
- as P, it answers a `do_remote_decode` request with one token and kv_transfer_params
  naming its engine, blocks and side channel;
- as D, it answers pull requests that carry P's params, and push requests that carry P's
  coordinates, waiting (when P and D share a `Fabric`, i.e. run in one process) until
  "P" has finished the prompt with that transfer id, like a real push D waits for the
  WRITE.
Knobs (`Behavior`) add delays and faults, and set the load that `GET /metrics` reports
(vLLM's waiting, running and KV cache gauges); every request is logged (`Seen`) so tests can
check what reached each server, when, and whether it was cancelled. `fault_rate` injects
one random fault (of `fault_kinds`) into that share of inference requests, each fault for
its request only, and `Seen.fault` names it (a soak test: `python -m scripts.soak`).

Data-parallel mode (`dp_size` N > 1), as vLLM started with `--data-parallel-size N` and
our connector: N engines behind the one port, engine ids `<engine_id>_dp{rank}`, side
channel and push ports offset by the rank, answers telling `dp_rank` and `dp_size`
(`Behavior.tell_dp_size` off: no `dp_size`, as a dense model's engines). A request runs
on the rank its `X-data-parallel-rank` header names (out of range: vLLM's 400; not a
number: ignored, as vLLM does), else on the ranks in turn; `Seen.rank` records it, and
`restart_rank` gives one rank a new engine id. With a `Fabric`, a push D checks that the
engine it was told of is the one that ran the prompt, and fails the push otherwise.

Run one alone: `python -m testbed.fake_vllm --role decode --port 8200`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from testbed.fake_kv_cache import FakePrefixCache, fake_chat_tokens, fake_tokenize

MODEL = "fake-model"
# What `Behavior.fault_kinds` may name; cut_stream applies to a streamed D answer only.
FAULT_KINDS = ("status_500", "drop_connection", "garbage", "cut_stream", "slow")


@dataclasses.dataclass
class Behavior:
    """Knobs a test may turn at any time."""

    delay: float = 0.0  # before answering (P: the prompt's compute; D: before 1st token)
    token_delay: float = 0.0  # between streamed tokens
    tokens: int = 4  # tokens D generates when max_tokens does not say fewer
    fail_status: int | None = None  # answer every inference request with this status
    drop_connection: bool = False  # close the connection without an answer
    hang: bool = False  # never answer
    omit_kv_params: bool = False  # P: answer without kv_transfer_params
    garbage: bool = False  # answer with bytes that are not JSON
    cut_stream_after: int | None = None  # D: close the stream after this many chunks
    transfer_modes: list[str] = dataclasses.field(default_factory=lambda: ["pull", "push"])
    push_wait_timeout: float = 30.0  # D: how long a push waits for P (a stock lease)
    push_delay: float = 0.0  # D: extra wait on a push after P's "WRITE" (a slow transfer)
    # D: that wait for a push whose P leg asked for layers (None: push_delay)
    layered_push_delay: float | None = None
    health_status: int = 200  # what GET /health answers
    waiting: int = 0  # /metrics: requests "queued" on the server (vllm:num_requests_waiting)
    kv_cache_usage: float = 0.0  # /metrics: 0..1, vllm:kv_cache_usage_perc
    # Random faults, one request at a time: this share of inference requests meets one
    # fault, drawn from `fault_kinds` (those that apply to the request): status_500,
    # drop_connection, garbage and cut_stream as the knobs above, for that request only;
    # slow answers fine but `fault_slow_s` late.
    fault_rate: float = 0.0
    fault_kinds: list[str] = dataclasses.field(default_factory=lambda: list(FAULT_KINDS))
    fault_slow_s: float = 0.5
    tell_dp_size: bool = True  # data-parallel P: answers say dp_size (off: a dense model's)
    down_ranks: list[int] = dataclasses.field(default_factory=list)  # these ranks answer 500
    # With a `kv_cache`: seconds per prompt token computed (not a cache hit), charged
    # before P's answer or a local D's first token, as an emulated GPU's prefill; one
    # prompt at a time per server.
    prefill_token_s: float = 0.0


@dataclasses.dataclass
class Seen:
    """One inference request as the fake saw it."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    arrived: float  # time.perf_counter()
    finished: float | None = None
    outcome: str = "running"  # running, ok, cancelled, failed
    fault: str | None = None  # the random fault injected into this request (fault_rate)
    rank: int | None = None  # the data-parallel rank that ran it (data-parallel mode)
    prompt_tokens: int | None = None  # with a `kv_cache`: the prompt's tokens
    cached_tokens: int | None = None  # with a `kv_cache`: those that hit its prefix cache


class Fabric:
    """What P and D share in one process: which transfers P has finished (the 'WRITE')."""

    def __init__(self) -> None:
        self.written: dict[str, asyncio.Event] = {}
        self.writers: dict[str, str] = {}  # transfer id -> engine id of a data-parallel P
        self.layered: set[str] = set()  # transfer ids whose P leg asked for layers


    def event(self, transfer_id: str) -> asyncio.Event:
        return self.written.setdefault(transfer_id, asyncio.Event())


class FakeVLLM:
    def __init__(
        self,
        role: str,
        *,
        engine_id: str = "engine-0",
        side_channel_port: int = 5600,
        fabric: Fabric | None = None,
        model: str = MODEL,
        seed: int | None = None,
        dp_size: int = 1,
        push_port: int | None = None,
        kv_cache: FakePrefixCache | None = None,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        if dp_size < 1:
            raise ValueError(f"dp_size must be at least 1, got {dp_size}")
        self.role = role
        self.engine_id = engine_id
        self.side_channel_port = side_channel_port
        self.push_port = push_port  # our connector's push side channel (rank 0's), if any
        self.dp_size = dp_size
        # Each rank's engine id, with vLLM's `_dp{rank}` suffix (data-parallel mode only:
        # otherwise `engine_id`, which a test may change).
        self.rank_engine_ids = [f"{engine_id}_dp{r}" for r in range(dp_size)]
        self._restarts = 0
        self._next_rank = 0  # the rank an unpinned request runs on
        self.fabric = fabric
        # A prefix cache that publishes vLLM's KV events (testbed.fake_kv_cache), if any.
        self.kv_cache = kv_cache
        self._compute_free_at = 0.0  # loop time when its emulated prefills are all done
        self.model = model  # the one model it serves; a request for another gets 404
        self.behavior = Behavior()
        # As vLLM's --api-key: every /v1 route needs "Authorization: Bearer <key>" (401).
        self.api_key: str | None = None
        self.refused_keys = 0  # /v1 calls answered 401
        self.random = random.Random(seed)  # draws the random faults (fault_rate)
        self.record = True  # keep a `Seen` per request (off for long benchmarks)
        self.seen: list[Seen] = []
        self.tokenized = 0  # POST /tokenize calls answered
        self._changed = asyncio.Event()  # set (and replaced) whenever `seen` changes
        self.app = web.Application(middlewares=[self._check_api_key])
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_post("/v1/completions", self._infer)
        self.app.router.add_post("/v1/chat/completions", self._infer)
        self.app.router.add_post("/tokenize", self._tokenize)
        self.app.router.add_get("/kv_event_sources", self._kv_event_sources)

    async def until(self, predicate: Callable[[list[Seen]], bool], timeout: float = 5.0) -> None:
        """Wait until `predicate(self.seen)` holds (checked at each change), bounded."""
        async with asyncio.timeout(timeout):
            while not predicate(self.seen):
                await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def restart_rank(self, rank: int) -> str:
        """Rank `rank` restarts: a new engine id (returned), same ports."""
        self._restarts += 1
        self.rank_engine_ids[rank] = f"{self.engine_id}-r{self._restarts}_dp{rank}"
        return self.rank_engine_ids[rank]

    def _engine_of(self, rank: int) -> str:
        return self.rank_engine_ids[rank] if self.dp_size > 1 else self.engine_id

    def _rank_of(self, request: web.Request) -> int | web.Response:
        """The data-parallel rank a request runs on, or vLLM's answer to a bad one."""
        value = request.headers.get("X-data-parallel-rank")
        try:
            pinned = int(value) if value is not None else None
        except ValueError:
            pinned = None  # vLLM ignores a header that is not a number
        if pinned is None:
            rank = self._next_rank
            self._next_rank = (rank + 1) % self.dp_size
            return rank
        if not 0 <= pinned < self.dp_size:  # vLLM's VLLMValidationError, as it answers it
            message = f"data_parallel_rank {pinned} is out of range [0, {self.dp_size})."
            return web.json_response({"error": {"message": message, "type": "BadRequestError",
                                                "param": None, "code": 400}}, status=400)
        return pinned

    @property
    def active(self) -> int:
        return sum(1 for s in self.seen if s.outcome == "running")

    @web.middleware
    async def _check_api_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_key is not None and request.path.startswith("/v1"):
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                self.refused_keys += 1
                return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="", status=self.behavior.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        """vLLM's load gauges in Prometheus text format: waiting and KV cache usage as the
        knobs say, running as the requests this fake is answering now (0 when it does
        not record them)."""
        labels = f'{{engine="0",model_name="{self.model}"}}'
        gauges = [
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             self.behavior.waiting),
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             self.active),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             self.behavior.kv_cache_usage),
        ]  # fmt: skip
        lines: list[str] = []
        for name, help_text, value in gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                      f"{name}{labels} {float(value)}"]  # fmt: skip
        if self.kv_cache is not None:  # vLLM's info gauge of its cache config
            lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                      "# TYPE vllm:cache_config_info gauge",
                      f'vllm:cache_config_info{{block_size="{self.kv_cache.block_size}",'
                      f'engine="0",num_gpu_blocks="{self.kv_cache.num_blocks}"}} 1.0']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /tokenize with this fake's tokenizer (`fake_tokenize`)."""
        body = msgspec.json.decode(await request.read())
        tokens = prompt_tokens(body)
        if tokens is None:
            return web.json_response({"error": {"message": "no prompt or messages"}}, status=400)
        self.tokenized += 1
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": 1 << 20})

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        """vLLM's publishers per rank: none without a `kv_cache` (events off)."""
        return web.json_response(self.kv_cache.sources() if self.kv_cache is not None else {})

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        headers = {k.lower(): v for k, v in request.headers.items()}
        seen = Seen(request.path, body, headers, time.perf_counter())
        if self.record:
            self.seen.append(seen)
            self._notify()
        try:
            response = await self._answer(request, body, seen)
            seen.outcome = "ok" if seen.outcome == "running" else seen.outcome
            return response
        except asyncio.CancelledError:
            seen.outcome = "cancelled"
            raise
        except (ConnectionResetError, OSError):
            seen.outcome = "cancelled"
            raise
        finally:
            seen.finished = time.perf_counter()
            self._notify()

    async def _answer(self, request: web.Request, body: dict[str, Any], seen: Seen) -> web.StreamResponse:
        b = self._request_behavior(body, seen)
        if b.hang:
            await asyncio.sleep(3600)
        if b.delay:
            await asyncio.sleep(b.delay)
        if b.drop_connection:
            seen.outcome = "failed"
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)
        if b.fail_status is not None:
            seen.outcome = "failed"
            return web.json_response(
                {"error": {"message": "injected failure", "type": "fake", "code": b.fail_status}},
                status=b.fail_status,
            )
        if b.garbage:
            seen.outcome = "failed"
            return web.Response(body=b"\x00not json{", content_type="application/json")
        if body.get("model") != self.model:  # as vLLM answers
            seen.outcome = "failed"
            return web.json_response({"error": {
                "message": f"The model `{body.get('model')}` does not exist.",
                "type": "NotFoundError", "param": "model", "code": 404}}, status=404)
        rank = self._rank_of(request)
        if isinstance(rank, web.Response):
            seen.outcome = "failed"
            return rank
        seen.rank = rank
        if rank in b.down_ranks:
            seen.outcome = "failed"
            return web.json_response({"error": {"message": f"rank {rank} is down"}}, status=500)
        params = body.get("kv_transfer_params") or {}
        if self.kv_cache is not None:
            await self._through_cache(body, params, seen, b)
        if self.role == "prefill":
            return self._prefill_answer(request, params, b, rank, seen)
        return await self._decode_answer(request, body, params, seen, b)

    async def _through_cache(self, body: dict[str, Any], params: dict[str, Any], seen: Seen,
                             b: Behavior) -> None:
        """The prompt goes through the prefix cache (D caches what it was sent, too); the
        tokens it computes (P, or a D with no P params) cost `prefill_token_s` each."""
        assert self.kv_cache is not None
        tokens = prompt_tokens(body) or []
        seen.prompt_tokens = len(tokens)
        seen.cached_tokens = self.kv_cache.serve(tokens)
        computes = self.role == "prefill" or not params
        if computes and b.prefill_token_s:
            # One accelerator: prompts are computed one after another, so a queue builds
            # up behind a long one, as it would on a real server.
            now = asyncio.get_running_loop().time()
            start = max(now, self._compute_free_at)
            self._compute_free_at = start + b.prefill_token_s * (len(tokens) - seen.cached_tokens)
            await asyncio.sleep(self._compute_free_at - now)

    def _request_behavior(self, body: dict[str, Any], seen: Seen) -> Behavior:
        """The knobs for this request: `behavior`, or with probability `fault_rate` a copy
        with one fault turned on (named in `seen.fault`)."""
        b = self.behavior
        if not b.fault_rate or self.random.random() >= b.fault_rate:
            return b
        streamed_decode = self.role == "decode" and bool(body.get("stream"))
        kinds = [k for k in b.fault_kinds if k != "cut_stream" or streamed_decode]
        if not kinds:
            return b
        seen.fault = self.random.choice(kinds)
        return _with_fault(b, seen.fault, self._tokens(b, body), self.random)

    @staticmethod
    def _tokens(b: Behavior, body: dict[str, Any]) -> int:
        """How many tokens D generates for this body."""
        return min(b.tokens, int(body.get("max_tokens") or b.tokens))

    def _prefill_answer(self, request: web.Request, params: dict[str, Any], b: Behavior,
                        rank: int, seen: Seen) -> web.Response:
        rid = request.headers.get("X-Request-Id", "none")
        prefix = "chatcmpl-" if request.path.endswith("chat/completions") else "cmpl-"
        answer: dict[str, Any] = _completion(request.path, ["p"], rid, self.model)
        if seen.prompt_tokens is not None:  # as vLLM with --enable-prompt-tokens-details
            answer["usage"] = {
                "prompt_tokens": seen.prompt_tokens, "completion_tokens": 1,
                "total_tokens": seen.prompt_tokens + 1,
                "prompt_tokens_details": {"cached_tokens": seen.cached_tokens}}
        if not b.omit_kv_params and params.get("do_remote_decode"):
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": self._engine_of(rank),
                "remote_request_id": f"{prefix}{rid}-0a1b",
                "remote_host": "127.0.0.1",
                "remote_port": self.side_channel_port + rank,
                "tp_size": 1,
                "transfer_modes": list(b.transfer_modes),
            }
            kv = answer["kv_transfer_params"]
            if self.push_port is not None:
                kv["push_host"], kv["push_port"] = "127.0.0.1", self.push_port + rank
            if self.dp_size > 1:
                kv["dp_rank"] = rank
                if b.tell_dp_size:
                    kv["dp_size"] = self.dp_size
        transfer_id = params.get("transfer_id")
        if transfer_id and self.fabric is not None:
            if self.dp_size > 1:
                self.fabric.writers[transfer_id] = self._engine_of(rank)
            if params.get("push_layers"):
                self.fabric.layered.add(transfer_id)
            self.fabric.event(transfer_id).set()  # the prompt is done: "WRITE" the KV to D
        return web.json_response(answer)

    async def _decode_answer(
        self, request: web.Request, body: dict[str, Any], params: dict[str, Any], seen: Seen,
        b: Behavior,
    ) -> web.StreamResponse:
        if params.get("transfer_id"):
            missing = [
                k
                for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size", "remote_request_id")
                if params.get(k) in (None, "")
            ]
            if missing:  # a stock vLLM 0.32 D dies here; the fake refuses loudly
                seen.outcome = "failed"
                return web.json_response({"error": {"message": f"push params miss {missing}"}}, status=500)
            if self.fabric is not None:
                event = self.fabric.event(params["transfer_id"])
                await asyncio.wait_for(event.wait(), b.push_wait_timeout)
                writer = self.fabric.writers.get(params["transfer_id"])
                if writer is not None and writer != params["remote_engine_id"]:
                    # A real D would wait for a WRITE from the engine it was told of.
                    seen.outcome = "failed"
                    message = (f"push told of engine {params['remote_engine_id']}, "
                               f"but {writer} ran the prompt")
                    return web.json_response({"error": {"message": message}}, status=500)
                layered = params["transfer_id"] in self.fabric.layered
                self.fabric.layered.discard(params["transfer_id"])
                delay = b.push_delay
                if layered and b.layered_push_delay is not None:
                    delay = b.layered_push_delay
                if delay:
                    await asyncio.sleep(delay)
        tokens = self._tokens(b, body)
        words = [f"t{i}" for i in range(tokens)]
        rid = request.headers.get("X-Request-Id", "none")
        if not body.get("stream"):
            return web.json_response(_completion(request.path, words, rid, self.model))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, word in enumerate(words):
            if b.cut_stream_after is not None and i >= b.cut_stream_after:
                seen.outcome = "failed"
                assert request.transport is not None
                request.transport.close()
                return response
            if i and b.token_delay:
                await asyncio.sleep(b.token_delay)
            chunk = _completion(request.path, [word], rid, self.model, chunk=True)
            await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _with_fault(b: Behavior, kind: str, tokens: int, rng: random.Random) -> Behavior:
    """A copy of `b` that answers one request with the fault `kind`."""
    if kind == "status_500":
        return dataclasses.replace(b, fail_status=500)
    if kind == "drop_connection":
        return dataclasses.replace(b, drop_connection=True)
    if kind == "garbage":
        return dataclasses.replace(b, garbage=True)
    if kind == "cut_stream":  # after 0..tokens-1 chunks: before or within the answer
        return dataclasses.replace(b, cut_stream_after=rng.randrange(max(1, tokens)))
    if kind == "slow":
        return dataclasses.replace(b, delay=b.delay + b.fault_slow_s)
    raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")


def _completion(path: str, words: list[str], rid: str, model: str, *,
                chunk: bool = False) -> dict[str, Any]:
    text = " ".join(words)
    if path.endswith("chat/completions"):
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": text}, "finish_reason": None}
            if chunk
            else {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        )
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": f"chatcmpl-{rid}", "object": kind, "model": model, "choices": [choice]}
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": None if chunk else "length"}],
    }


def prompt_tokens(body: dict[str, Any]) -> list[int] | None:
    """A request's (or a /tokenize body's) prompt as this fake's token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    if isinstance(prompt, str):
        return fake_tokenize(prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        return fake_chat_tokens(messages)
    return None


async def start(fake: FakeVLLM, port: int = 0, host: str = "127.0.0.1") -> tuple[web.AppRunner, str]:
    """Serve `fake` on host:port (0 = any free port); returns the runner and base URL."""
    runner = web.AppRunner(fake.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]  # the port the OS chose when port is 0
    return runner, f"http://{host}:{bound}"


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake vLLM P or D server (no model).")
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--tokens", type=int, default=4, help="tokens D generates")
    parser.add_argument("--fault-rate", type=float, default=0.0,
                        help="share of inference requests that meet one random fault (0..1)")
    parser.add_argument("--fault-kinds", nargs="+", choices=FAULT_KINDS, default=list(FAULT_KINDS),
                        help="the faults to draw from (default: all)")
    parser.add_argument("--seed", type=int, help="seed of the random faults (default: random)")
    args = parser.parse_args()
    fake = FakeVLLM(args.role, seed=args.seed)
    fake.behavior.tokens = args.tokens
    fake.behavior.fault_rate = args.fault_rate
    fake.behavior.fault_kinds = args.fault_kinds
    fake.record = False
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(fake.app, host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
