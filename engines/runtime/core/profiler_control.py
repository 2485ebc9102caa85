"""The built-in profiler's life on one engine: start, status, stop, and what a profile says it
was taken on.

A profile swaps the model's backend for a timed one (``telemetry.profiler.ProfiledBackend``)
until it stops, by request, at its step limit or at its time limit; one that stopped by itself
waits for :meth:`ProfilerControl.stop` to take it. A profile with a trigger is armed first
(:meth:`ProfilerControl.arm`) and starts itself when the trigger fires (``core.profile_trigger``).
The step's seams lap the running profiler through the engine's ``StepObserver``. Start and stop
run between steps, on the engine thread; :meth:`ProfilerControl.status` from any thread.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from engines.runtime.core.profile_trigger import ArmedTrigger, ProfileTrigger
from engines.runtime.telemetry.profiler import ProfiledBackend, ProfileResult, ProfilerStateError, ProfileStatus, \
    StepProfiler

if TYPE_CHECKING:
    from engines.runtime.model.llama import LlamaModel

__all__ = ["ProfilerControl"]


class ProfilerControl:
    """Starts and stops profiles of one engine's steps.

    Args:
        model: the engine's model, whose backend a profile swaps.
        checkpoint_name: the model's name, for the result.
        engine_config: the engine's sizing (a dataclass), for the result's configuration.
    """

    def __init__(self, model: "LlamaModel", checkpoint_name: str, engine_config: Any) -> None:
        self.model = model
        self.checkpoint_name = checkpoint_name
        self.engine_config = engine_config
        #: The running profile; None when none runs (the step's seams check the observer, not this).
        self.running: StepProfiler | None = None
        self._stopped: StepProfiler | None = None  # ended by itself, not taken yet
        self._plain_backend = model.backend
        self._peak: tuple[float | None, str] | None = None  # measured once, at the first profile
        #: The armed profile's watch, until it fires or is cancelled; None when none is armed.
        self.armed: ArmedTrigger | None = None
        self._armed_options: tuple[int | None, float, bool] = (None, 60.0, False)
        self._trigger: dict[str, str] | None = None  # the running or stopped profile's, if it started itself

    @property
    def plain_backend(self) -> Any:
        """The backend the model computes on when no profile runs."""
        return self._plain_backend

    def start(self, max_steps: int | None = None, max_seconds: float = 60.0,
              stack_sampling: bool = False) -> StepProfiler:
        """Profile the next steps until :meth:`stop`, ``max_steps`` steps or ``max_seconds``.
        A profile already running (or stopped and not yet taken) is a :class:`ProfilerStateError`."""
        self._check_idle()
        self._trigger = None
        return self._start(max_steps, max_seconds, stack_sampling)

    def _check_idle(self) -> None:
        if self.running is not None:
            raise ProfilerStateError("a profile is already running: stop it first")
        if self.armed is not None:
            raise ProfilerStateError(f"a profile is armed ({self.armed.trigger.describe()}): stop it first")
        if self._stopped is not None:
            raise ProfilerStateError("a finished profile has not been taken yet: stop it first")

    def _start(self, max_steps: int | None, max_seconds: float, stack_sampling: bool) -> StepProfiler:
        profiler = StepProfiler(max_steps=max_steps, max_seconds=max_seconds, stack_sampling=stack_sampling)
        if self._peak is None:
            self._peak = self._plain_backend.peak_bandwidth()
        self.model.use_backend(ProfiledBackend(self._plain_backend, profiler))
        self.running = profiler
        return profiler

    def arm(self, trigger: ProfileTrigger, max_steps: int | None = None, max_seconds: float = 60.0,
            stack_sampling: bool = False) -> ProfileStatus:
        """Arm a profile that starts itself when ``trigger`` fires, bounded then by ``max_steps`` and
        ``max_seconds`` as :meth:`start`'s; one at a time, as :meth:`start`."""
        self._check_idle()
        self.armed = ArmedTrigger(trigger)
        self._armed_options = (max_steps, max_seconds, stack_sampling)
        return self.status()

    def fire(self) -> StepProfiler:
        """Start the armed profile whose trigger fired (between steps, on the engine thread)."""
        armed, self.armed = self.armed, None
        assert armed is not None and armed.fired_by is not None
        self._trigger = {"trigger": armed.trigger.describe(), "fired_by": armed.fired_by}
        return self._start(*self._armed_options)

    def status(self) -> ProfileStatus:
        """Where the profiler stands; safe from any thread."""
        armed = self.armed
        if armed is not None:
            max_steps, _, stack_sampling = self._armed_options
            return ProfileStatus(running=False, max_steps=max_steps, stack_sampling=stack_sampling, armed=True,
                                 trigger=armed.trigger.describe(), fired_by=armed.fired_by or "")
        profiler = self.running or self._stopped
        if profiler is None:
            return ProfileStatus(running=False)
        status = profiler.status()
        trigger = self._trigger
        return dataclasses.replace(status, trigger=trigger["trigger"], fired_by=trigger["fired_by"]) if trigger \
            else status

    def end(self) -> None:
        """The running profile ends (its limit, or a stop): the plain backend is back, and the
        profile waits to be taken."""
        profiler, self.running = self.running, None
        self.model.use_backend(self._plain_backend)
        assert profiler is not None
        profiler.finish("request")  # no-op when it ended by itself
        self._stopped = profiler

    def stop(self, engine_name: str = "engine") -> ProfileResult:
        """End the profile (or take the one that stopped by itself) and summarise it. None to stop
        is a :class:`ProfilerStateError`."""
        if self.armed is not None:
            armed, self.armed = self.armed, None
            raise ProfilerStateError(f"the armed profile never started ({armed.trigger.describe()} did not happen "
                                     f"in {armed.steps_seen} steps): it is disarmed and nothing was saved")
        if self.running is not None:
            self.end()
        profiler, self._stopped = self._stopped, None
        if profiler is None:
            raise ProfilerStateError("no profile is running: start one first")
        peak, source = self._peak or (None, "")
        trigger, self._trigger = self._trigger, None
        result = profiler.result(engine=engine_name, model=self.checkpoint_name, backend=self.model.backend_name,
                                 device=self._plain_backend.device_name(), peak_gbs=peak, peak_source=source,
                                 config=self.describe())
        return dataclasses.replace(result, trigger=trigger)

    def describe(self) -> dict[str, Any]:
        """The engine's configuration as plain data: what a profile was taken on."""
        import numba

        return {
            "checkpoint": self.checkpoint_name, "backend": self.model.backend_name, "dtype": self.model.dtype,
            **dataclasses.asdict(self.model.config),
            **{f"engine_{k}": v for k, v in dataclasses.asdict(self.engine_config).items()},
            "numba": numba.__version__,
        }
