"""Every compiled CPU function of the model states its fast-math flags. numba lets a callee that
states none inherit its caller's (``inherit_if_not_set("fastmath")``) the first time a caller
compiles it, keeps that version for every later call, and caches it on disk under a key without
the flags: which test or process compiled a kernel first then decided its rounding (seen: a fresh
clone's cached ``quantize_activations_cpu`` dividing by a reciprocal, 1 ulp off its reference, and
``rope_kv_append_cpu`` fused into FMAs)."""
from __future__ import annotations

import importlib
import pkgutil

import numpy as np
from numba import float32, njit
from numba.core.registry import CPUDispatcher

import engines.runtime.model.kernels as kernels_package

MODULES = [importlib.import_module(f"{kernels_package.__name__}.{m.name}")
           for m in pkgutil.iter_modules(kernels_package.__path__)]
MODULES += [importlib.import_module(f"engines.runtime.model.{name}")
            for name in ("cpu_step", "step_inputs", "thread_team", "quant.dequantize")]


def test_every_compiled_cpu_function_states_its_fastmath() -> None:
    found, silent = 0, []
    for module in MODULES:
        for name, value in vars(module).items():
            if isinstance(value, CPUDispatcher) and value.py_func.__module__ == module.__name__:
                found += 1
                if "fastmath" not in value.targetoptions and not value.targetoptions.get("inline") == "always":
                    silent.append(f"{module.__name__}.{name}")
    assert found > 40 and silent == []


def test_a_callee_that_states_none_would_take_its_callers() -> None:
    """The numba behaviour the rule above guards against, as this numba does it."""
    def divide(x, out):
        for i in range(x.shape[0]):
            out[i] = x[i] / float32(127.0)

    silent, stated = njit(divide), njit(fastmath=False)(divide)

    @njit(fastmath=True)
    def through_silent(x, out):
        silent(x, out)

    @njit(fastmath=True)
    def through_stated(x, out):
        stated(x, out)

    x = (np.random.default_rng(0).standard_normal(10_000) * 100).astype(np.float32)
    want = x / np.float32(127.0)
    got_silent, got_stated, direct = (np.empty_like(x) for _ in range(3))
    through_silent(x, got_silent)
    through_stated(x, got_stated)
    silent(x, direct)  # called directly now: the version its fast-math caller compiled
    assert np.array_equal(got_stated, want)
    assert not np.array_equal(got_silent, want) and np.array_equal(direct, got_silent)
