"""The dashboard's websocket consumer: authenticate, join the engines' groups, forward snapshots,
carry out actions.

``/ws/engines/`` watches every served engine (the overview), ``/ws/engines/<name>/`` one engine.
Snapshots come from the process's samplers (``engines.dashboard.sampler``) through the channel
layer; this consumer only forwards them. Actions (``reset``, ``save_trace``, ``clear_trace``,
``profile_start``, ``profile_stop``) run as tasks of their own, so a slow one (saving a
million-event trace) never blocks the socket, and report back with ``ack``, ``progress``,
``done`` or ``error`` events carrying the request's ``id``. A message that cannot be read gets
an ``error`` event (with its ``id`` when that much could be read) and the socket stays open.

An action acknowledged is carried out even if its socket closes meanwhile (a page reloaded
right after "Save trace"): its outcome waits for that user's next socket on the engine, which
gets it as an ``earlier`` event.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import orjson
from channels.generic.websocket import AsyncWebsocketConsumer
from django.urls import reverse
from pydantic import ValidationError

from engines.dashboard.messages import SERVER_ID, ActionEvent, ActionRequest, engine_group
from engines.dashboard.sampler import hub_for
from engines.dashboard.timeline_messages import TimelineError, TimelineHello, TimelineRequest, TraceDeltaHeader
from engines.history import EmptyTraceError, TraceUnavailableError, asave_engine_trace
from engines.protocol.json_body import JSONTooDeepError, loads_bounded
from engines.registry import registry

logger = logging.getLogger(__name__)

__all__ = ["CLOSE_FORBIDDEN", "CLOSE_NOT_FOUND", "DashboardConsumer", "RefusedSocket", "TimelineConsumer"]

#: Outcomes of actions whose socket closed before they ended, per user and engine, for their
#: next socket (this server process; the newest few).
_UNDELIVERED_MAX = 20
_undelivered: dict[tuple[int, str], deque[str]] = {}
#: The engine pages open now, per user and engine: a late outcome goes to one of them at once.
_open_pages: dict[tuple[int, str], set["DashboardConsumer"]] = {}

#: Close codes (the 4000s are the application's): not a staff user; no such engine or route.
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404


class DashboardConsumer(AsyncWebsocketConsumer):
    """A staff member's view of one engine, or of all of them."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not (user.is_active and user.is_staff):
            await self._refuse(CLOSE_FORBIDDEN)
            return
        name = self.scope["url_route"]["kwargs"].get("engine")
        engines = list(registry) if name is None else [e for e in [registry.get(name)] if e is not None]
        if name is not None and not engines:
            await self._refuse(CLOSE_NOT_FOUND)
            return
        self.engine_name: str | None = name
        self.watched: list[str] = [engine.name for engine in engines]
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        hub = hub_for(registry)
        await self.accept()
        for engine_name in self.watched:
            await self.channel_layer.group_add(engine_group(engine_name), self.channel_name)
            sampler = hub.get(engine_name)
            if sampler is not None:
                sampler.watch()
                if sampler.latest_text is not None:  # the page shows something at once: charts full
                    await self.send(text_data=sampler.history_text())
                    await self.send(text_data=sampler.latest_text)
        if name is not None:  # an engine's page: what its actions asked on an earlier page came to
            _open_pages.setdefault((user.pk, name), set()).add(self)
            waiting = _undelivered.pop((user.pk, name), None)
            for text in waiting or ():
                await self.send(text_data=text)

    async def _refuse(self, code: int) -> None:
        # Accepted, then closed: a browser sees the close code (a refused handshake shows none).
        await self.accept()
        await self.close(code=code)

    async def disconnect(self, code: int) -> None:
        # The actions under way go on (they were acknowledged); their outcome waits for the next socket.
        self.closed = True
        user = self.scope.get("user")
        if getattr(self, "engine_name", None) is not None and user is not None:
            pages = _open_pages.get((user.pk, self.engine_name))
            if pages is not None:
                pages.discard(self)
                if not pages:
                    del _open_pages[(user.pk, self.engine_name)]
        hub = hub_for(registry)
        for engine_name in getattr(self, "watched", []):
            await self.channel_layer.group_discard(engine_group(engine_name), self.channel_name)
            sampler = hub.samplers.get(engine_name)
            if sampler is not None:
                sampler.unwatch()

    # ---------------------------------------------------------------- from the layer

    async def engine_snapshot(self, event: dict[str, Any]) -> None:
        # An EngineSnapshot's JSON, serialised once by the sampler that took it (any server's).
        await self.send(text_data=event["text"])

    # ---------------------------------------------------------------- from the browser

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            raw = loads_bounded(text_data if text_data is not None else bytes_data)
        except (orjson.JSONDecodeError, JSONTooDeepError):
            await self._event("error", message="not a JSON message: send an object such as "
                                               '{"action": "reset", "id": 1}')
            return
        try:
            request = ActionRequest.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "message"
            # The id, when it is a valid one, so that the page can tell which of its actions failed.
            given = raw.get("id") if isinstance(raw, dict) else None
            valid_id = given if isinstance(given, (str, int)) and not isinstance(given, bool) else None
            await self._event("error", message=f"{where}: {first['msg']}", event_id=valid_id)
            return
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

    async def _carry_out(self, request: ActionRequest, engine: Any) -> None:
        """Run one action and report how it ended; its own task."""
        from engines.runtime import EngineDeadError, ProfilerStateError

        try:
            result = await self._action(request, engine)
        except asyncio.CancelledError:
            raise
        except (EngineDeadError, TraceUnavailableError, EmptyTraceError, ProfilerStateError, ValueError) as exc:
            await self._event("error", request, engine=engine.name, message=str(exc))
        except Exception as exc:  # noqa: BLE001 - said to the user, logged for the operator
            logger.exception("dashboard action %s on %s failed", request.action, engine.name)
            await self._event("error", request, engine=engine.name, message=f"{type(exc).__name__}: {exc}")
        else:
            await self._event("done", request, engine=engine.name, result=result)
            sampler = hub_for(registry).samplers.get(engine.name)
            if sampler is not None:  # show the effect (counters at zero after a reset) at once
                await sampler.publish()

    async def _action(self, request: ActionRequest, engine: Any) -> dict[str, Any]:
        from engines.profiling import start_profile, stop_profile

        match request.action:
            case "reset":
                await engine.reset()
                return {"message": f"engine {engine.name} was reset"}
            case "clear_trace":
                if not engine.tracing_enabled:
                    raise ValueError(f"engine {engine.name} records no trace: serve it with --enable-tracing")
                await engine.dump_trace(clear=True, skip_empty=True)
                return {"message": "the trace was cleared"}
            case "save_trace":
                await self._event("progress", request, engine=engine.name, message="taking and saving the trace")
                record = await asave_engine_trace(engine, note=request.note, tags=request.tags, source="dashboard")
                return {"record_id": record.pk, "event_count": record.event_count,
                        "url": reverse("admin:engines_tracerecord_change", args=[record.pk]),
                        "message": f"saved {record.event_count} events"}
            case "profile_start":
                await start_profile(engine, max_steps=request.max_steps, stack_sampling=request.stack_sampling,
                                    source="dashboard")
                steps = f" for {request.max_steps} steps" if request.max_steps else ""
                return {"profiling": True, "message": f"profiling{steps}"}
            case "profile_stop":
                await self._event("progress", request, engine=engine.name, message="stopping and saving the profile")
                saved = await stop_profile(engine, note=request.note, source="dashboard")
                return {"profiling": False, "record_id": saved.id, "url": saved.url,
                        "message": f"profile #{saved.id} saved ({saved.steps} steps)"}
        raise AssertionError(request.action)  # ActionRequest admits no other action

    async def _event(self, kind: str, request: ActionRequest | None = None, *,
                     event_id: str | int | None = None, **fields: Any) -> None:
        event = ActionEvent(type=kind, id=request.id if request else event_id,
                            action=request.action if request else None, **fields)
        if not self.closed:
            await self._send(event.model_dump(mode="json", exclude_none=True))
        elif request is not None and kind in ("done", "error"):  # its socket closed while it ran
            user, engine = self.scope["user"].pk, fields.get("engine") or self.engine_name
            late = orjson.dumps(event.model_copy(update={"earlier": True}).model_dump(mode="json", exclude_none=True))
            page = next(iter(_open_pages.get((user, engine), ())), None)
            if page is not None:  # the user's next page on this engine is open already: it hears now
                await page.send(text_data=late.decode())
            else:
                queue = _undelivered.setdefault((user, engine), deque(maxlen=_UNDELIVERED_MAX))
                queue.append(late.decode())

    async def _send(self, message: dict[str, Any]) -> None:
        await self.send(text_data=orjson.dumps(message).decode())


def _is_staff(scope: dict[str, Any]) -> bool:
    user = scope.get("user")
    return user is not None and user.is_active and user.is_staff


class TimelineConsumer(AsyncWebsocketConsumer):
    """One engine's trace, live: the calls its recorder took since the browser's cursor.

    Each socket reads the recorder on its own (``AsyncEngine.trace_since``, answered by the
    engine's reader even mid-step, copying only what is new), a few times a second; the
    browser pairs spans by the dump's rules (``static/engines/js/timeline/model.js``).
    """

    #: It talks to no group: no channel of its own in the layer (with Redis, no receive loop).
    channel_layer_alias = "timeline-sockets-use-no-layer"
    #: Seconds between reads while nothing is pending: the view stays well under 1 s behind.
    INTERVAL_S = 0.25
    #: Seconds before trying again after the engine was down.
    RETRY_S = 1.0

    async def connect(self) -> None:
        if not _is_staff(self.scope):
            await self._refuse(CLOSE_FORBIDDEN)
            return
        self.engine = registry.get(self.scope["url_route"]["kwargs"]["engine"])
        if self.engine is None:
            await self._refuse(CLOSE_NOT_FOUND)
            return
        self.pump: asyncio.Task[None] | None = None
        await self.accept()
        hello = TimelineHello(server=SERVER_ID, engine=self.engine.name, tracing=self.engine.tracing_enabled,
                              interval_s=self.INTERVAL_S)
        await self.send(text_data=hello.model_dump_json())

    async def _refuse(self, code: int) -> None:
        await self.accept()
        await self.close(code=code)

    async def disconnect(self, code: int) -> None:
        pump = getattr(self, "pump", None)
        if pump is not None:
            pump.cancel()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            request = TimelineRequest.model_validate(loads_bounded(text_data if text_data is not None else bytes_data))
        except (orjson.JSONDecodeError, JSONTooDeepError):
            await self._error('not a JSON message: send {"action": "follow", "cursor": 0}')
            return
        except ValidationError as exc:
            first = exc.errors()[0]
            await self._error(f"{'.'.join(str(p) for p in first['loc']) or 'message'}: {first['msg']}")
            return
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
        from engines.runtime import EngineDeadError

        engine = self.engine
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
                await self.send(text_data=orjson.dumps({"type": "restarted", "engine": engine.name}).decode())
                cursor = 0
                continue
            if recorder is not None and delta.recorder != recorder:  # the engine came back with a new one
                await self.send(text_data=orjson.dumps({"type": "restarted", "engine": engine.name}).decode())
                recorder, cursor = delta.recorder, 0
                continue
            recorder, cursor = delta.recorder, delta.cursor
            header = TraceDeltaHeader(engine=engine.name, tag=tag, cursor=delta.cursor, missed=delta.missed, more=delta.more,
                                      now_us=delta.now_us, held_events=delta.held_events,
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
