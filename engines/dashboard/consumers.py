"""The dashboard's websocket consumers: one engine (or all) live with its actions, and one
engine's trace live on the timeline.

Both stand on :class:`StaffSocket`: only a staff session opens one (any other is accepted and
closed with :data:`CLOSE_FORBIDDEN`, an unknown engine with :data:`CLOSE_NOT_FOUND`), every
message is JSON of bounded depth validated as the socket's request model, and a message that
cannot be read or is invalid gets an ``error`` message (``<where>: <what>``) while the socket
stays open. Every message either way is a model of ``messages`` or ``timeline_messages``.

``/ws/engines/`` watches every served engine (the overview), ``/ws/engines/<name>/`` one engine
(:class:`DashboardConsumer`). Snapshots come from the process's samplers (``sampler``) through
the channel layer; this consumer only forwards them, and says (``feed``: ``feed.FeedWatch``) when
they stop arriving, the layer (Redis) away, and when they come again. Actions (``reset``,
``save_trace``, ``clear_trace``, ``profile_start``, ``profile_stop``, ``abort_request``) run as tasks of their own, so
a slow one (saving a million-event trace) never blocks the socket, and report back with ``ack``,
``progress``, ``done`` or ``error`` events carrying the request's ``id``.

An action acknowledged is carried out even if its socket closes meanwhile (a page reloaded
right after "Save trace"): its outcome waits for that user's next socket on the engine, which
gets it as an ``earlier`` event.

``/ws/engines/<name>/timeline/`` (:class:`TimelineConsumer`) streams the engine's trace as its
recorder takes it.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

import orjson
from autobahn.exception import Disconnected  # Daphne's websocket protocol
from channels.generic.websocket import AsyncWebsocketConsumer
from pydantic import BaseModel, ValidationError

from engines.engine_actions import EXPECTED_FAILURES, ActionRequest, run_action
from engines.dashboard.feed import RETRY_S, FeedWatch, layer_reason
from engines.dashboard.messages import ActionEvent, ActionEventType, engine_group
from engines.server.server_identity import server_id
from engines.dashboard.sampler import LAYER_ERRORS, LayerUnavailableError, hub_for
from engines.dashboard.socket_auth import database_away
from engines.dashboard.timeline_messages import (TimelineError, TimelineHello, TimelineRequest, TimelineRestarted,
                                                 TraceDeltaHeader)
from engines.protocol.json_body import JSONTooDeepError, loads_bounded
from engines.registry import registry
from engines.runtime import AsyncEngine, EngineDeadError

logger = logging.getLogger(__name__)

__all__ = ["CLOSE_FORBIDDEN", "CLOSE_NOT_FOUND", "CLOSE_UNAVAILABLE", "DashboardConsumer", "RefusedSocket",
           "StaffSocket", "TimelineConsumer"]

#: Close codes (the 4000s are the application's): not a staff user; no such engine or route; the
#: database that holds the session does not answer (the page tries again).
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404
CLOSE_UNAVAILABLE = 4503

RequestT = TypeVar("RequestT", bound=BaseModel)


def sends_unless_gone(send: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    """``send`` that drops a message for a browser already gone: a tab killed without a close
    frame is noticed by the server only when it writes, and a snapshot sent between that and
    the disconnect the server then delivers raised Daphne's ``Disconnected`` out of the
    consumer, with a traceback (bench/soak.py's dropped viewers)."""
    async def send_unless_gone(message: Any) -> None:
        try:
            await send(message)
        except Disconnected:
            logger.debug("a websocket message to a browser already gone was dropped")
    return send_unless_gone


def is_staff(scope: Mapping[str, Any]) -> bool:
    """Whether the socket's session is an active staff member's."""
    user = scope.get("user")
    return user is not None and user.is_active and user.is_staff


def validation_message(exc: ValidationError) -> str:
    """A message's first problem as the sockets say it: ``<where>: <what>``."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "message"
    return f"{where}: {first['msg']}"


class StaffSocket(AsyncWebsocketConsumer, Generic[RequestT]):
    """A dashboard socket: staff only, its messages decoded with a bound on their depth and
    validated as :attr:`request_model`, a bad one answered without closing the socket.

    A subclass says what it does with a staff member's socket (:meth:`open`), with a valid
    message (:meth:`handle`) and how it tells the browser a message was not taken
    (:meth:`reject`).
    """

    #: What the browser sends on this socket.
    request_model: ClassVar[type[BaseModel]]
    #: A good message, for the error a message that is not JSON gets.
    example: ClassVar[str]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await super().__call__(scope, receive, sends_unless_gone(send))

    async def connect(self) -> None:
        away = database_away(self.scope)
        if away is not None:  # whether it is a staff member's is unknown: said, and the page tries again
            await self.refuse(CLOSE_UNAVAILABLE, f"the database does not answer ({away})")
            return
        if not is_staff(self.scope):
            await self.refuse(CLOSE_FORBIDDEN)
            return
        await self.open()

    async def refuse(self, code: int, reason: str | None = None) -> None:
        """Close the socket with ``code`` (and ``reason``) before it carries anything."""
        # Accepted, then closed: a browser sees the close code (a refused handshake shows none).
        await self.accept()
        # A close frame's reason holds 123 bytes (RFC 6455); the page shows its own words anyway.
        await self.close(code=code, reason=reason.encode()[:123].decode(errors="ignore") if reason else None)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            # Neither (not sent by Channels): b"" fails to parse as None would, as not JSON.
            raw = loads_bounded(text_data if text_data is not None else bytes_data or b"")
        except (orjson.JSONDecodeError, JSONTooDeepError):
            await self.reject(f"not a JSON message: send {self.example}", None)
            return
        try:
            request = self.request_model.model_validate(raw)
        except ValidationError as exc:
            await self.reject(validation_message(exc), raw)
            return
        await self.handle(request)  # type: ignore[arg-type]  # an instance of request_model

    async def open(self) -> None:
        """Accept (or refuse) a staff member's socket."""
        raise NotImplementedError  # each socket's own (StaffSocket is a base, never routed)

    async def handle(self, request: RequestT) -> None:
        """Act on a valid message."""
        raise NotImplementedError  # each socket's own (StaffSocket is a base, never routed)

    async def reject(self, message: str, raw: Any) -> None:
        """Tell the browser its message was not taken and why; ``raw`` is the message when it
        was JSON at least, else None."""
        raise NotImplementedError  # each socket's own (StaffSocket is a base, never routed)


#: Outcomes of actions whose socket closed before they ended, per user and engine, for their
#: next socket (this server process; the newest few).
_UNDELIVERED_MAX = 20
_undelivered: dict[tuple[int, str | None], deque[str]] = {}
#: The engine pages open now, per user and engine: a late outcome goes to one of them at once.
_open_pages: dict[tuple[int, str | None], set["DashboardConsumer"]] = {}


class DashboardConsumer(StaffSocket[ActionRequest]):
    """A staff member's view of one engine, or of all of them."""

    request_model = ActionRequest
    example = 'an object such as {"action": "reset", "id": 1}'
    #: The engine of an engine's page (None on the overview), and the engines the socket watches.
    engine_name: str | None = None
    watched: tuple[str, ...] = ()
    #: Set once the socket closed: the outcomes of its actions then wait for the user's next socket.
    closed = False
    #: Whether the snapshots arrive (None on a socket that watches no engine).
    feed: FeedWatch | None = None
    #: The last read of the socket's channel in the layer failed: the next waits :data:`RETRY_S`.
    _layer_failing = False

    async def open(self) -> None:
        user = self._user_pk()
        name = self.scope["url_route"]["kwargs"].get("engine")
        engines = list(registry) if name is None else [e for e in [registry.get(name)] if e is not None]
        if name is not None and not engines:
            await self.refuse(CLOSE_NOT_FOUND)
            return
        self.engine_name = name
        self.watched = tuple(engine.name for engine in engines)
        self.tasks: set[asyncio.Task[None]] = set()
        hub = hub_for(registry)
        await self.accept()
        for engine_name in self.watched:
            sampler = hub.get(engine_name)
            if sampler is not None:
                sampler.watch()
                # The page shows something at once, charts full: this process's sampler holds it,
                # so it comes even while the layer does not answer.
                if sampler.latest_text is not None:
                    await self.send(text_data=sampler.history_text())
                    await self.send(text_data=sampler.latest_text)
        if self.watched:  # joins the engines' groups, and says whether the feed is live
            self.feed = FeedWatch(self._send_text, self._join_groups)
            await self.feed.start()
        if name is not None:  # an engine's page: what its actions asked on an earlier page came to
            _open_pages.setdefault((user, name), set()).add(self)
            waiting = _undelivered.pop((user, name), None)
            for text in waiting or ():
                await self.send(text_data=text)

    async def disconnect(self, code: int) -> None:
        # The actions under way go on (they were acknowledged); their outcome waits for the next socket.
        self.closed = True
        if self.feed is not None:
            self.feed.stop()
        user = self.scope.get("user")
        if self.engine_name is not None and user is not None:
            pages = _open_pages.get((user.pk, self.engine_name))
            if pages is not None:
                pages.discard(self)
                if not pages:
                    del _open_pages[(user.pk, self.engine_name)]
        hub = hub_for(registry)
        for engine_name in self.watched:
            sampler = hub.samplers.get(engine_name)
            if sampler is not None:
                sampler.unwatch()
        try:
            for engine_name in self.watched:
                await self.channel_layer.group_discard(engine_group(engine_name), self.channel_name)
        except LAYER_ERRORS:
            pass  # Redis away: it forgets the membership itself (channels_redis's group expiry)

    # ---------------------------------------------------------------- from the layer

    # Channels reads the socket's channel in the layer through ``channel_receive`` (set as the
    # consumer starts), and an exception there ends the consumer: a traceback and a closed socket,
    # again at every reconnect while Redis is away. Wrapped, a failed read is a message of its own.
    @property
    def channel_receive(self) -> Callable[[], Awaitable[Any]]:
        """What Channels awaits for the layer's next message: :meth:`_receive_from_layer`."""
        return self._receive_from_layer

    @channel_receive.setter
    def channel_receive(self, receive: Callable[[], Awaitable[Any]]) -> None:
        self._read_layer = receive

    async def _receive_from_layer(self) -> Any:
        """The layer's next message for the socket, or a ``feed.layer_failed`` one when the read
        fails; after a failure the next read waits :data:`RETRY_S` (Redis fails at once)."""
        if self._layer_failing:
            await asyncio.sleep(RETRY_S)
        try:
            message = await self._read_layer()
        except LAYER_ERRORS as exc:
            self._layer_failing = True
            return {"type": "feed.layer_failed", "reason": layer_reason(exc)}
        self._layer_failing = False
        return message

    async def engine_snapshot(self, event: dict[str, Any]) -> None:
        # An EngineSnapshot's JSON, serialised once by the sampler that took it (any server's).
        await self.send(text_data=event["text"])
        if self.feed is not None:
            await self.feed.arrived()

    async def feed_layer_failed(self, event: dict[str, Any]) -> None:
        # From _receive_from_layer, never from the layer itself.
        if self.feed is not None:
            await self.feed.failed(event["reason"])

    async def _join_groups(self) -> None:
        for engine_name in self.watched:
            await self.channel_layer.group_add(engine_group(engine_name), self.channel_name)

    async def _send_text(self, text: str) -> None:
        if not self.closed:
            await self.send(text_data=text)

    # ---------------------------------------------------------------- from the browser

    async def reject(self, message: str, raw: Any) -> None:
        # The id, when it is a valid one, so that the page can tell which of its actions failed.
        given = raw.get("id") if isinstance(raw, dict) else None
        valid_id = given if isinstance(given, (str, int)) and not isinstance(given, bool) else None
        await self._event("error", message=message, event_id=valid_id)

    async def handle(self, request: ActionRequest) -> None:
        name = request.engine or self.engine_name
        engine = registry.get(name) if name is not None else None
        if engine is None or name not in self.watched:
            await self._event("error", request, message=f"no engine {name!r} on this socket" if name
                              else "name the engine: add \"engine\" to the message")
            return
        await self._event("ack", request, engine=engine.name)
        task = asyncio.get_running_loop().create_task(self._carry_out(request, engine))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _carry_out(self, request: ActionRequest, engine: AsyncEngine) -> None:
        """Run one action and report how it ended; its own task."""
        try:
            result = await run_action(request, engine, functools.partial(self._progress, request, engine),
                                      user=self._username())
        except asyncio.CancelledError:
            raise
        except EXPECTED_FAILURES as exc:
            await self._event("error", request, engine=engine.name, message=str(exc))
        except Exception as exc:  # noqa: BLE001 - said to the user, logged for the operator
            logger.exception("dashboard action %s on %s failed", request.action, engine.name)
            await self._event("error", request, engine=engine.name, message=f"{type(exc).__name__}: {exc}")
        else:
            await self._event("done", request, engine=engine.name, result=result)
            sampler = hub_for(registry).samplers.get(engine.name)
            if sampler is not None:  # show the effect (counters at zero after a reset) at once
                with contextlib.suppress(LayerUnavailableError):  # Redis away: the feed says so
                    await sampler.publish()

    async def _progress(self, request: ActionRequest, engine: AsyncEngine, message: str) -> None:
        await self._event("progress", request, engine=engine.name, message=message)

    def _username(self) -> str:
        """The name of the socket's (staff) user, as the history records who acted."""
        user = self.scope["user"]
        assert user is not None
        return str(user.get_username())

    def _user_pk(self) -> int:
        """The id of the socket's user: a staff member's (``connect`` opens no other socket)."""
        user = self.scope["user"]
        assert user is not None
        return user.pk

    async def _event(self, kind: ActionEventType, request: ActionRequest | None = None, *,
                     event_id: str | int | None = None, **fields: Any) -> None:
        event = ActionEvent(type=kind, id=request.id if request else event_id,
                            action=request.action if request else None, **fields)
        if not self.closed:
            await self.send(text_data=orjson.dumps(event.model_dump(mode="json", exclude_none=True)).decode())
        elif request is not None and kind in ("done", "error"):  # its socket closed while it ran
            user, engine = self._user_pk(), fields.get("engine") or self.engine_name
            late = orjson.dumps(event.model_copy(update={"earlier": True}).model_dump(mode="json", exclude_none=True))
            page = next(iter(_open_pages.get((user, engine), ())), None)
            if page is not None:  # the user's next page on this engine is open already: it hears now
                await page.send(text_data=late.decode())
            else:
                queue = _undelivered.setdefault((user, engine), deque(maxlen=_UNDELIVERED_MAX))
                queue.append(late.decode())


class TimelineConsumer(StaffSocket[TimelineRequest]):
    """One engine's trace, live: the calls its recorder took since the browser's cursor.

    Each socket reads the recorder on its own (``AsyncEngine.trace_since``, answered by the
    engine's reader even mid-step, copying only what is new), a few times a second; the
    browser pairs spans by the dump's rules (``static/engines/js/timeline/model.js``).
    """

    request_model = TimelineRequest
    example = '{"action": "follow", "cursor": 0}'
    #: It talks to no group: no channel of its own in the layer (with Redis, no receive loop).
    channel_layer_alias = "timeline-sockets-use-no-layer"
    #: Seconds between reads while nothing is pending: the view stays well under 1 s behind.
    INTERVAL_S = 0.25
    #: Seconds before trying again after the engine was down.
    RETRY_S = 1.0
    pump: asyncio.Task[None] | None = None
    #: The engine followed (set when the socket opens: there is none on a refused one).
    engine: AsyncEngine

    async def open(self) -> None:
        engine = registry.get(self.scope["url_route"]["kwargs"]["engine"])
        if engine is None:
            await self.refuse(CLOSE_NOT_FOUND)
            return
        self.engine = engine
        await self.accept()
        hello = TimelineHello(server=server_id(), engine=self.engine.name, tracing=self.engine.tracing_enabled,
                              interval_s=self.INTERVAL_S)
        await self.send(text_data=hello.model_dump_json())

    async def disconnect(self, code: int) -> None:
        if self.pump is not None:
            self.pump.cancel()

    async def reject(self, message: str, raw: Any) -> None:
        await self._error(message)

    async def handle(self, request: TimelineRequest) -> None:
        if not self.engine.tracing_enabled:
            await self._error(f"Engine {self.engine.name} records no trace: serve it with --enable-tracing.")
            return
        if self.pump is not None:
            self.pump.cancel()
        self.pump = asyncio.get_running_loop().create_task(self._follow(request.cursor, request.tag))
        self.pump.add_done_callback(self._pump_stopped)

    def _pump_stopped(self, pump: asyncio.Task[None]) -> None:
        if not pump.cancelled() and pump.exception() is not None:
            logger.error("timeline of %s stopped", self.engine.name, exc_info=pump.exception())

    async def _follow(self, cursor: int, tag: int) -> None:
        """Send what the recorder took since ``cursor``, then keep following it."""
        engine = self.engine
        restarted = TimelineRestarted(engine=engine.name).model_dump_json()
        recorder: str | None = None
        while True:
            try:
                delta = await engine.trace_since(cursor)
            except EngineDeadError as exc:
                await self._error(f"Engine {engine.name} is not running ({exc}); the timeline resumes when it is back.")
                await asyncio.sleep(self.RETRY_S)
                continue
            except ValueError:
                # The cursor is ahead of the recorder: the engine was restarted with a new one.
                await self.send(text_data=restarted)
                cursor = 0
                continue
            if recorder is not None and delta.recorder != recorder:  # the engine came back with a new one
                await self.send(text_data=restarted)
                recorder, cursor = delta.recorder, 0
                continue
            recorder, cursor = delta.recorder, delta.cursor
            header = TraceDeltaHeader(engine=engine.name, tag=tag, cursor=delta.cursor, missed=delta.missed,
                                      more=delta.more, now_us=delta.now_us, held_events=delta.held_events,
                                      dropped_events=delta.dropped_events)
            # The calls are spliced in as the engine serialised them: no parse and re-dump here.
            head = orjson.dumps(header.model_dump())
            await self.send(text_data=(head[:-1] + b',"calls":' + delta.calls_json + b"}").decode())
            if not delta.more:
                await asyncio.sleep(self.INTERVAL_S)

    async def _error(self, message: str) -> None:
        await self.send(text_data=TimelineError(message=message).model_dump_json())


class RefusedSocket(AsyncWebsocketConsumer):
    """Any other websocket path: refused at the handshake (403), cleanly (no 500, no traceback)."""

    async def connect(self) -> None:
        await self.close(code=CLOSE_NOT_FOUND)
