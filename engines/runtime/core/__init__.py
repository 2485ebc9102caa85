"""Serving one model: requests, scheduler, KV page pool and prefix cache, sampling, grammars,
stop rules and the ``Engine`` step loop. Uses ``model`` and ``telemetry``; never ``frontend``."""
