"""The fleet: many servers, ours and foreign, in one dashboard.

Servers that are not ours (vLLM, SGLang, MLC LLM, llama.cpp, or ours without the shared Redis)
are read by URL: ``exposition`` parses what their ``/metrics`` serve, ``server_kinds`` holds one
record per kind (how to tell it, its controls, and its metric names, current and deprecated,
``vllm[:_]`` and ``sglang[:_]``, for the quantities the dashboard shows), ``quantiles`` turns
histogram buckets into percentiles, per server and for the fleet, and ``foreign`` polls a server
within bounded time and bytes.
"""
