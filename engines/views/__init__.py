"""The API's views, one module per surface (their routes: ``engines.api_routes``); each parses,
calls and shapes. ``api`` is their base (reading a body, replying, the error shape, the debug
gate); ``openai`` serves ``/v1``, ``debug`` MLC's ``/debug/*`` and ours (and vLLM's cache reset and
profiler names), ``microserving`` ``/microserving/*``, ``vllm`` vLLM's ``/tokenize``,
``/detokenize`` and ``/version``, ``metrics`` ``/metrics``, ``/stats`` and ``/health``, and
``fleet`` ``/fleet.json``."""
