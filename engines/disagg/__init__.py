"""Disaggregated serving in the server. ``router`` is the disaggregating router (``serve --router
disagg``): ordinary OpenAI requests in, MicroServing's three calls to prefill and decode servers
behind them; ``router_trace`` is its own lane on the fleet's timeline. ``delivery`` moves a
request's K/V from the engine that prefilled it to the engine that decodes it. The engine side
is ``engines.runtime``'s ``core.disagg``; the wire format is its ``kv_wire``."""
