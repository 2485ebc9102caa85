"""The fleet: many servers, ours and foreign, in one dashboard (docs/fleet.md).

Ours: ``service`` runs the fleet in a server process (store, publisher, pollers, board, the
control listener). The shared state lives in a ``store`` (the Redis every member already uses,
or this process alone), under the keys ``keys`` names; ``membership`` is which servers of ours
form the fleet (a card and a heartbeat each), ``publisher`` this server's part (its card, and its
engines' rows once a second). ``rows`` types what a member publishes and a page is sent, and
``windows`` turns cumulative readings into recent ones (a counter's rate, a histogram's last
minute), for ours and foreign servers alike.

Foreign servers (vLLM, SGLang, MLC LLM, llama.cpp, or ours without the shared Redis) are read by
URL: ``attach`` checks a URL and keeps the server; ``server_kinds`` holds one record per kind of
server (how to tell it, its controls, and its metric names, current and deprecated, for the
quantities the dashboard shows); ``exposition`` parses what their ``/metrics`` serve; ``foreign``
reads a server within bounded time and bytes and normalises it; ``polling`` polls each attached
server from the one member that holds its lease.

The view and its history: ``board`` assembles the fleet's one view (every server and engine, the
totals) while anyone watches, with ``quantiles`` for percentiles per server and across servers
whose buckets differ; ``rollups`` keeps every engine's rows per minute and per hour in the
database and reads SLO figures back. Acting on it: ``controls`` runs one action on many engines
as a tracked job; ``merged_trace`` opens the traces a job saved as one timeline, on the fleet's
clock as ``clock`` measures a member against it. ``outage_log`` gives a retrying loop one
warning per outage.
"""
