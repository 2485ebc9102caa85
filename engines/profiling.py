"""The server's side of the built-in profiler: start, stop and save, one profile per engine.

A profile runs in the engine (``AsyncEngine.profile_start``); this module remembers, per engine
and per server process, the one it started, watches it (a profile that stops by itself after
``max_steps`` or its time limit is saved without anyone asking), and saves each finished profile
as a :class:`~engines.models.ProfileRecord`. Stop and save never block the event loop: the engine
answers between two steps and the record is written on a worker thread.
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

from django.urls import reverse
from pydantic import BaseModel

from engines.history.capture import acheck_database
from engines.history.outage import HistoryUnavailableError
from engines.history.profiles import asave_profile, aset_profile_note
from engines.protocol.limits import DEFAULT_MAX_SECONDS
from engines.runtime import AsyncEngine, ProfilerStateError, ProfileStatus, ProfileTrigger

__all__ = ["ProfileSaved", "ProfileState", "profile_state", "start_profile", "stop_profile"]

logger = logging.getLogger("engines.profiling")

#: Seconds between two looks at a running profile (has it stopped by itself?).
WATCH_INTERVAL_S = 0.5
#: Seconds between asks while the database is away and a profile that stopped by itself waits for it.
DATABASE_RETRY_S = 5.0


@dataclass(frozen=True)
class ProfileSaved:
    """A saved profile: its record id and page."""

    id: int
    url: str
    steps: int
    kernel_calls: int
    #: The per-kernel table (``ProfileRecord.kernels``): what a replay's report compares.
    kernels: list[dict[str, Any]] = field(default_factory=list)


class ProfileState(BaseModel):
    """The built-in profiler of one engine as this server process knows it (the dashboard's
    snapshots carry it)."""

    running: bool = False
    steps: int = 0                 # profiled so far (while running)
    max_steps: int | None = None
    armed: bool = False            # waiting for its trigger
    trigger: str = ""              # the trigger (armed, or the running profile's when it started itself)
    last_id: int | None = None     # the newest profile this process saved for the engine
    last_url: str | None = None    # its page (/dashboard/profiles/<id>/)


@dataclass
class _EngineProfiles:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    watcher: asyncio.Task[None] | None = None
    status: ProfileStatus = ProfileStatus(running=False)
    last: ProfileSaved | None = None
    source: str = "api"


# Per engine object (a restarted server, or a test's fresh engine, starts with nothing).
_engines: weakref.WeakKeyDictionary[AsyncEngine, _EngineProfiles] = weakref.WeakKeyDictionary()


def _of(engine: AsyncEngine) -> _EngineProfiles:
    state = _engines.get(engine)
    if state is None:
        state = _engines[engine] = _EngineProfiles()
    return state


def profile_state(engine: AsyncEngine) -> ProfileState:
    """What the dashboard shows of ``engine``'s profiler (no call to the engine)."""
    state = _engines.get(engine)
    if state is None:
        return ProfileState()
    last = state.last
    watching = state.watcher is not None and not state.watcher.done()
    armed = watching and state.status.armed
    return ProfileState(running=watching and not armed, steps=state.status.steps, max_steps=state.status.max_steps,
                        armed=armed, trigger=state.status.trigger if watching else "",
                        last_id=last.id if last else None, last_url=last.url if last else None)


async def start_profile(engine: AsyncEngine, *, max_steps: int | None = None,
                        max_seconds: float = DEFAULT_MAX_SECONDS, stack_sampling: bool = False,
                        source: str = "api", trigger: ProfileTrigger | None = None) -> ProfileStatus:
    """Start profiling ``engine``, or with a ``trigger`` arm a profile that starts itself (saved,
    as one that stops by itself is, when it ends); raises ``ProfilerStateError`` when a profile
    runs or is armed already."""
    state = _of(engine)
    async with state.lock:
        status = await engine.profile_start(max_steps, max_seconds, stack_sampling, trigger)
        state.status, state.source = status, source
        state.watcher = asyncio.get_running_loop().create_task(_watch(engine, state))
    return status


async def stop_profile(engine: AsyncEngine, *, note: str = "", source: str | None = None) -> ProfileSaved:
    """Stop ``engine``'s profile and save it. If it had stopped by itself and was saved
    already, that record is the answer; with no profile at all, ``ProfilerStateError``."""
    state = _of(engine)
    async with state.lock:
        watcher = state.watcher
        if watcher is None or watcher.done():
            if state.last is not None and watcher is not None and state.status.finished:
                state.watcher = None
                if note:  # it ended by itself and was saved meanwhile: the note goes on that record
                    await aset_profile_note(state.last.id, note)
                return state.last
            raise ProfilerStateError("no profile is running: start one first")
        await acheck_database()  # a 503 leaves the profile running, to be stopped once the database is back
        watcher.cancel()
        state.watcher = None
        return await _save(engine, state, note=note, source=source or state.source)


async def _watch(engine: AsyncEngine, state: _EngineProfiles) -> None:
    """Follow a running profile; save it when it stops by itself."""
    while True:
        await asyncio.sleep(WATCH_INTERVAL_S)
        try:
            state.status = await engine.profile_status()
        except Exception:  # noqa: BLE001 - the engine died: the profile died with it
            logger.warning("engine %s: its profile ended with the engine", engine.name)
            state.status = ProfileStatus(running=False)
            return
        if state.status.finished or not (state.status.running or state.status.armed):
            break
    await _database_back(engine)
    async with state.lock:
        if state.watcher is asyncio.current_task():
            try:
                await _save(engine, state, note="", source=state.source)
            except ProfilerStateError as exc:  # it saw no step: nothing to keep
                logger.info("engine %s: %s", engine.name, exc)
            except Exception:  # noqa: BLE001 - logged; the next start begins afresh
                logger.exception("engine %s: the profile that stopped by itself could not be saved", engine.name)


async def _database_back(engine: AsyncEngine) -> None:
    """Wait for the history's database before taking a profile that stopped by itself: the engine
    keeps its result meanwhile, so an outage delays the record instead of losing it."""
    said = False
    while True:
        try:
            await acheck_database()
            return
        except HistoryUnavailableError as exc:
            if not said:
                logger.warning("engine %s: its profile stopped; it is saved when the database is back (%s)",
                               engine.name, exc)
                said = True
        await asyncio.sleep(DATABASE_RETRY_S)


async def _save(engine: AsyncEngine, state: _EngineProfiles, *, note: str, source: str) -> ProfileSaved:
    result = await engine.profile_stop()
    if not result.steps:
        state.status = ProfileStatus(running=False)
        raise ProfilerStateError("the profile saw no engine step (no request ran while it was on), so nothing "
                                 "was saved: start it again and send requests")
    record = await asave_profile(result.to_json(), engine=engine.name, source=source, note=note)
    state.last = ProfileSaved(record.pk, reverse("dashboard-profile", args=[record.pk]), record.steps,
                              record.kernel_calls, list(record.kernels))
    state.status = ProfileStatus(running=False, steps=record.steps, finished=True)
    logger.info("engine %s: profile #%d saved (%d steps)", engine.name, record.pk, record.steps)
    return state.last
