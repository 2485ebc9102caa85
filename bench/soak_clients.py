"""The soak's clients (``bench/soak.py``): API load, slow readers, bursts, hostile bodies and
dashboard viewers on websockets, each tallying what it saw for the soak's checks."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets
from websockets.asyncio.client import connect as ws_connect

MODEL = "demo"
#: A long prompt every client shares the start of: prefix-cache hits (the tails differ).
SHARED_PREFIX = " ".join(f"shared{i % 37}" for i in range(150))
#: Structured output: the engine must stop on a whole JSON value of this schema.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@dataclass
class Tally:
    """What the clients saw."""

    started: float = field(default_factory=time.monotonic)
    requests: int = 0
    tokens: int = 0
    dropped: int = 0
    slow: int = 0
    structured: int = 0
    multi: int = 0
    status: dict[int, int] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)  # 5xx but 503, streams without an end, replies without a reason
    hostile: int = 0
    hostile_bad: list[str] = field(default_factory=list)  # a hostile body not answered 4xx with a JSON error
    #: request id (``user``) -> completion tokens of every choice, for requests read to their end
    finished: dict[str, int] = field(default_factory=dict)
    probes: list[tuple[float, str]] = field(default_factory=list)

    #: a few replies of each status but 200, for whoever reads the table
    examples: dict[int, list[str]] = field(default_factory=dict)

    def saw(self, status: int, what: str = "") -> None:
        self.status[status] = self.status.get(status, 0) + 1
        if status != 200 and len(self.examples.setdefault(status, [])) < 3:
            self.examples[status].append(what[:300])
        if status >= 500 and (status != 503 or not _json_error(what)):
            self.bad.append(f"{status}: {what[:200]}")


def _json_error(body: str) -> bool:
    """Whether a reply's body is the server's JSON error (OpenAI's shape or MLC's flat one)."""
    try:
        reply = json.loads(body)
    except ValueError:
        return False
    error = reply.get("error", reply) if isinstance(reply, dict) else None
    return isinstance(error, dict) and bool(error.get("message"))


def request_body(rng: random.Random, request_id: str) -> tuple[str, dict[str, Any]]:
    """A random request: chat or completion, every sampling option in turn, structured output,
    ``n`` > 1, short prompts, long ones that share a prefix (cache hits), long unique ones."""
    chat = rng.random() < 0.5
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.choice([4, 16, 48, 96]), "stream": rng.random() < 0.6,
                            "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 1000), "user": request_id}
    extras: dict[str, Any] = rng.choice([
        {}, {"top_p": 0.9}, {"top_k": 20}, {"frequency_penalty": 0.5, "presence_penalty": 0.3},
        {"repetition_penalty": 1.2}, {"logit_bias": {"5": -100, "17": 2}}, {"stop": ["shared"]},
    ])
    body.update(extras)
    if rng.random() < 0.1:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "soak", "schema": SCHEMA}}
        body["max_tokens"] = 64
    if rng.random() < 0.1:
        body["n"] = rng.choice([2, 3])
    shape = rng.random()
    if shape < 0.4:
        prompt = " ".join(rng.choice(["soak", "tea", "load", "page"]) for _ in range(rng.randint(2, 20)))
    elif shape < 0.8:
        prompt = f"{SHARED_PREFIX} {rng.randint(0, 10**6)}"
    else:  # long and unique (700-1,400 tokens of the demo's tokenizer): a prefix-cache miss, and KV pressure
        prompt = " ".join(f"u{rng.randint(0, 999)}" for _ in range(rng.randint(150, 300)))
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


async def one_request(client: httpx.AsyncClient, tally: Tally, rng: random.Random, *, slow: bool = False) -> int:
    """Send one random request and read its reply (or drop it mid-stream, one in ten; read it
    slowly when ``slow``), tallying what came back; its HTTP status (0: no answer)."""
    tally.requests += 1
    request_id = f"soak-{tally.requests}-{rng.randint(0, 10**9)}"
    path, body = request_body(rng, request_id)
    structured = "response_format" in body
    tally.structured += structured
    tally.multi += body.get("n", 1) > 1
    phase, began = "sent", time.monotonic()
    try:
        if not body["stream"]:
            reply = await client.post(path, json=body)
            tally.saw(reply.status_code, reply.text)
            if reply.status_code == 200:
                _check_whole_reply(reply.json(), body, request_id, tally)
            return reply.status_code
        if slow:
            body["stream"] = True
            tally.slow += 1
        drop = not slow and rng.random() < 0.1
        async with client.stream("POST", path, json=body) as reply:
            if reply.status_code != 200:
                tally.saw(reply.status_code, (await reply.aread()).decode(errors="replace"))
                return reply.status_code
            tally.saw(200)
            phase = "streaming"
            await _read_stream(reply, body, request_id, tally, drop=drop, slow=slow)
            return 200
    except httpx.HTTPError as exc:
        now = time.monotonic()
        tally.bad.append(f"transport at {now - tally.started:.0f} s, {phase} {now - began:.1f} s before, {path}, "
                         f"stream {body['stream']}, n {body.get('n', 1)}: {type(exc).__name__}: {exc!r}"[:300])
        return 0


def _check_whole_reply(reply: dict[str, Any], body: dict[str, Any], request_id: str, tally: Tally) -> None:
    choices = reply["choices"]
    if len(choices) != body.get("n", 1):
        tally.bad.append(f"{request_id}: {len(choices)} choices for n={body.get('n', 1)}")
    for choice in choices:
        if not choice.get("finish_reason"):
            tally.bad.append(f"no finish reason: {json.dumps(reply)[:200]}")
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        if "response_format" in body and choice.get("finish_reason") == "stop":
            _check_json(text, request_id, tally)
    tally.tokens += reply["usage"]["completion_tokens"]
    tally.finished[request_id] = reply["usage"]["completion_tokens"]


async def _read_stream(reply: httpx.Response, body: dict[str, Any], request_id: str, tally: Tally, *,
                       drop: bool, slow: bool) -> None:
    lines: list[str] = []
    reasons: dict[int, str] = {}
    texts: dict[int, str] = {}
    chunks = 0
    async for line in reply.aiter_lines():
        if not line.startswith("data: "):
            continue
        lines.append(line[6:])
        if line[6:] == "[DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            texts[index] = texts.get(index, "") + piece
            if choice.get("finish_reason"):
                reasons[index] = choice["finish_reason"]
        chunks += 1
        tally.tokens += 1
        if drop and chunks > 2:
            tally.dropped += 1
            return  # a client gone mid-stream
        if slow:
            await asyncio.sleep(0.2)  # a reader slower than the engine writes
    # An engine that died mid-stream ends it with a 503 error object, then [DONE] (documented).
    errored = len(lines) >= 2 and '"code":503' in lines[-2].replace(" ", "")
    if lines[-1:] != ["[DONE]"] or not (len(reasons) == body.get("n", 1) or errored):
        tally.bad.append(f"{request_id}: stream ended without a finish reason per choice and [DONE]: {lines[-2:]}")
        return
    if not errored and "response_format" in body:
        for index, reason in reasons.items():
            if reason == "stop":
                _check_json(texts.get(index, ""), request_id, tally)


def _check_json(text: str, request_id: str, tally: Tally) -> None:
    """Structured output that stopped on its own is one JSON object of the schema's keys."""
    try:
        value = json.loads(text)
    except ValueError:
        tally.bad.append(f"{request_id}: structured output is not JSON: {text[:120]!r}")
        return
    if not isinstance(value, dict) or set(value) != {"name", "n"}:
        tally.bad.append(f"{request_id}: structured output does not match its schema: {text[:120]!r}")


async def load(base: str, tally: Tally, stop: asyncio.Event, clients: int, burst: int, burst_every_s: float) -> None:
    """``clients`` clients sending one request after another (one of them a slow reader), and a
    burst of ``burst`` concurrent requests every ``burst_every_s``, until ``stop``."""
    rng = random.Random(42)
    limits = httpx.Limits(max_connections=burst + clients + 8)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        async def worker(n: int) -> None:
            local = random.Random(n)
            while not stop.is_set():
                if await one_request(client, tally, local, slow=(n == 0)) == 503:
                    await asyncio.sleep(0.25)  # a client backing off while the engine restarts
        tasks = [asyncio.create_task(worker(n)) for n in range(clients)]
        next_burst = time.monotonic() + min(60.0, burst_every_s)
        while not stop.is_set():
            await asyncio.sleep(1)
            if time.monotonic() > next_burst:
                await asyncio.gather(*(one_request(client, tally, rng) for _ in range(burst)))
                next_burst = time.monotonic() + burst_every_s
        await asyncio.gather(*tasks, return_exceptions=True)


#: Bodies no server should take: each must get a 4xx with an OpenAI-shaped JSON error.
HOSTILE: list[tuple[str, bytes]] = [
    ("/v1/completions", b"{"),
    ("/v1/completions", b"[" * 20000 + b"]" * 20000),
    ("/v1/completions", b'\xff\xfe{"model": "demo"}'),
    ("/v1/completions", b'{"model": "demo", "prompt": "x", "max_tokens": -5}'),
    ("/v1/completions", b'{"model": "demo", "prompt": "x", "max_tokens": true}'),
    ("/v1/completions", b'{"model": "demo", "prompt": [999999999]}'),
    ("/v1/completions", b'{"model": "nope", "prompt": "x"}'),
    ("/v1/completions", b'{"model": "demo", "prompt": "x", "logit_bias": {"abc": 1}}'),
    ("/v1/completions", b'{"model": "demo", "prompt": "x", "temperature": "hot"}'),
    ("/v1/chat/completions", b'{"model": "demo", "messages": "hi"}'),
    ("/v1/chat/completions", b'{"model": "demo", "messages": [{"role": "wizard", "content": "hi"}]}'),
    ("/v1/chat/completions", b'{"model": "demo", "messages": [{"role": "user", "content": "x"}], '
                             b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", '
                             b'"schema": {"type": "bogus"}}}}'),
    ("/v1/completions", b'{"model": "demo", "prompt": "' + b"x " * 3000 + b'", "max_tokens": 4000}'),
    ("/debug/reset_engine", b'{"model": 5}'),
    ("/debug/save_event_trace", b'{"model": "demo", "tags": "not a list"}'),
]


async def hostile_bodies(client: httpx.AsyncClient, tally: Tally) -> None:
    """Send every hostile body; anything but a 4xx with ``{"error": {"message": ...}}`` is noted."""
    for path, raw in HOSTILE:
        tally.hostile += 1
        reply = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        if not 400 <= reply.status_code < 500 or not message:
            tally.hostile_bad.append(f"{path} {raw[:40]!r}: {reply.status_code} {reply.text[:120]}")


@dataclass
class Viewers:
    """Dashboard viewers on websockets: engine pages opened, read, closed or dropped, a live
    timeline following, one watcher kept open across the whole soak for the feed's state."""

    opened: int = 0
    messages: int = 0
    refused: int = 0  # closed by the server at connect (a database away: the session cannot be read)
    errors: list[str] = field(default_factory=list)  # ``error`` events not asked for, unexpected failures
    #: The long-lived watcher's feed events: (seconds since the soak's start, state).
    feed: list[tuple[float, str]] = field(default_factory=list)
    actions: dict[str, str] = field(default_factory=dict)  # action id -> last event type
    started: float = 0.0  # the soak's start (monotonic): feed events are in seconds since
    bad_sent: int = 0  # unreadable messages the watcher sent
    bad_answered: int = 0  # ``error`` events without an id that came back for them

    async def run(self, ws_base: str, cookie: str, origin: str, stop: asyncio.Event) -> None:
        """Viewers come and go until ``stop``; the watcher runs alongside."""
        watcher = asyncio.create_task(self.watch(ws_base, cookie, origin, stop))
        rng = random.Random(7)
        while not stop.is_set():
            await asyncio.gather(*(self.visit(ws_base, cookie, origin, rng) for _ in range(rng.randint(1, 4))))
            await asyncio.sleep(rng.uniform(0.5, 3))
        await watcher

    async def visit(self, ws_base: str, cookie: str, origin: str, rng: random.Random) -> None:
        """One viewer: an engine page or its live timeline, read for a while, then closed or dropped."""
        path = f"/ws/engines/{MODEL}/" + ("timeline/" if rng.random() < 0.3 else "")
        try:
            async with ws_connect(ws_base + path, additional_headers={"Cookie": cookie, "Origin": origin},
                                  open_timeout=30, max_size=64 * 2**20) as ws:
                self.opened += 1
                until = time.monotonic() + rng.uniform(1, 10)
                while time.monotonic() < until:
                    try:
                        message = await asyncio.wait_for(ws.recv(), timeout=max(0.05, until - time.monotonic()))
                    except asyncio.TimeoutError:
                        break
                    self.messages += 1
                    self._note(message)
                if rng.random() < 0.3:
                    ws.transport.abort()  # a tab killed: no close frame
        except websockets.ConnectionClosed as exc:
            # 4503: the server's "database away, the session cannot be read" (CLOSE_UNAVAILABLE)
            if exc.rcvd is None or exc.rcvd.code not in (1000, 1001, 1006, 4503):
                self.errors.append(f"{path}: closed {exc}"[:200])
            self.refused += 1
        except (OSError, websockets.InvalidStatus, asyncio.TimeoutError) as exc:
            self.refused += 1
            if not isinstance(exc, websockets.InvalidStatus) or exc.response.status_code not in (403, 503):
                self.errors.append(f"{path}: {type(exc).__name__}: {exc}"[:200])

    async def watch(self, ws_base: str, cookie: str, origin: str, stop: asyncio.Event) -> None:
        """One engine page open for the whole soak (reconnecting if dropped), recording every
        ``feed`` event; it also sends an unreadable message every 30 s, which must get an
        ``error`` event while the socket stays open."""
        while not stop.is_set():
            try:
                async with ws_connect(f"{ws_base}/ws/engines/{MODEL}/", open_timeout=30,
                                      additional_headers={"Cookie": cookie, "Origin": origin}) as ws:
                    self.watcher = ws
                    next_bad = time.monotonic() + 30
                    while not stop.is_set():
                        try:
                            message = await asyncio.wait_for(ws.recv(), timeout=1)
                        except asyncio.TimeoutError:
                            message = None
                        if message is not None:
                            self._note(message, watcher=True)
                        if time.monotonic() > next_bad:  # its ``error`` event comes among the snapshots
                            await ws.send('{"action": "explode", "id": 1')
                            self.bad_sent += 1
                            next_bad = time.monotonic() + 30
            except (websockets.ConnectionClosed, OSError, websockets.InvalidStatus, asyncio.TimeoutError):
                await asyncio.sleep(1)
            finally:
                self.watcher = None

    watcher: Any = None

    async def act(self, action: str, action_id: str) -> None:
        """Ask the watcher's socket for a dashboard action (``clear_trace``, ...)."""
        if self.watcher is not None:
            self.actions[action_id] = "sent"
            await self.watcher.send(json.dumps({"action": action, "id": action_id}))

    def _note(self, message: str | bytes, watcher: bool = False) -> None:
        if isinstance(message, bytes):
            return  # the timeline's binary deltas
        try:
            event = json.loads(message)
        except ValueError:
            self.errors.append(f"not JSON: {message[:80]!r}")
            return
        kind = event.get("type")
        if kind == "feed" and watcher:
            self.feed.append((time.monotonic() - self.started, str(event.get("state"))))
        elif kind in ("ack", "progress", "done", "error") and event.get("id") is not None:
            self.actions[str(event["id"])] = kind
        elif kind == "error" and watcher:
            self.bad_answered += 1
