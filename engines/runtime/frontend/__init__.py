"""The process boundary: typed messages, the engine-core loop (and an engine process's
``main``), the thread and process transports, and the asyncio front end ``AsyncEngine``."""
