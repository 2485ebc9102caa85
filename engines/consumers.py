"""The dashboard's websocket consumer: authenticate, join the engines' groups, forward snapshots,
carry out actions.

``/ws/engines/`` watches every served engine (the overview), ``/ws/engines/<name>/`` one engine.
Snapshots come from the process's samplers (``engines.dashboard.sampler``) through the channel
layer; this consumer only forwards them. Actions (``reset``, ``save_trace``, ``clear_trace``,
``profile_start``, ``profile_stop``) run as tasks of their own, so a slow one (saving a
million-event trace) never blocks the socket, and report back with ``ack``, ``progress``,
``done`` or ``error`` events carrying the request's ``id``. A message that cannot be read gets
an ``error`` event and the socket stays open.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from channels.generic.websocket import AsyncWebsocketConsumer
from django.urls import reverse
from pydantic import ValidationError

from engines.dashboard.messages import ActionEvent, ActionRequest, engine_group
from engines.dashboard.sampler import hub_for
from engines.history import TraceUnavailableError, asave_engine_trace
from engines.protocol.json_body import JSONTooDeepError, loads_bounded
from engines.registry import registry

logger = logging.getLogger(__name__)

__all__ = ["CLOSE_FORBIDDEN", "CLOSE_NOT_FOUND", "DashboardConsumer", "RefusedSocket"]

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
        hub = hub_for(registry)
        await self.accept()
        for engine_name in self.watched:
            await self.channel_layer.group_add(engine_group(engine_name), self.channel_name)
            sampler = hub.get(engine_name)
            if sampler is not None:
                sampler.watch()
                if sampler.latest is not None:  # the page shows something at once
                    await self._send({"type": "snapshot", **sampler.latest.model_dump(mode="json")})

    async def _refuse(self, code: int) -> None:
        # Accepted, then closed: a browser sees the close code (a refused handshake shows none).
        await self.accept()
        await self.close(code=code)

    async def disconnect(self, code: int) -> None:
        hub = hub_for(registry)
        for engine_name in getattr(self, "watched", []):
            await self.channel_layer.group_discard(engine_group(engine_name), self.channel_name)
            sampler = hub.samplers.get(engine_name)
            if sampler is not None:
                sampler.unwatch()
        for task in getattr(self, "tasks", ()):
            task.cancel()

    # ---------------------------------------------------------------- from the layer

    async def engine_snapshot(self, event: dict[str, Any]) -> None:
        await self._send(event["snapshot"])

    # ---------------------------------------------------------------- from the browser

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            request = ActionRequest.model_validate(loads_bounded(text_data if text_data is not None else bytes_data))
        except (orjson.JSONDecodeError, JSONTooDeepError):
            await self._event("error", message="not a JSON message: send an object such as "
                                               '{"action": "reset", "id": 1}')
            return
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "message"
            await self._event("error", message=f"{where}: {first['msg']}")
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
        from engines.runtime import EngineDeadError

        try:
            result = await self._action(request, engine)
        except asyncio.CancelledError:
            raise
        except (EngineDeadError, TraceUnavailableError, ValueError) as exc:
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
            case "profile_start" | "profile_stop":
                if engine.backend_name != "cuda":
                    raise ValueError(f"The CUDA profiler is unavailable: engine {engine.name} runs on the "
                                     f"{engine.backend_name} backend. Serve it with --backend cuda on a machine "
                                     "with an NVIDIA GPU.")
                start = request.action == "profile_start"
                await engine.cuda_profiler(start)
                return {"profiling": start, "message": "profiling" if start else "profiling stopped"}
        raise AssertionError(request.action)  # ActionRequest admits no other action

    async def _event(self, kind: str, request: ActionRequest | None = None, **fields: Any) -> None:
        event = ActionEvent(type=kind, id=request.id if request else None,
                            action=request.action if request else None, **fields)
        await self._send(event.model_dump(mode="json", exclude_none=True))

    async def _send(self, message: dict[str, Any]) -> None:
        await self.send(text_data=orjson.dumps(message).decode())


class RefusedSocket(AsyncWebsocketConsumer):
    """Any other websocket path: refused at the handshake (403), cleanly (no 500, no traceback)."""

    async def connect(self) -> None:
        await self.close(code=CLOSE_NOT_FOUND)
