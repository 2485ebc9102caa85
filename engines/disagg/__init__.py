"""Disaggregated serving in the server: moving a request's K/V from the engine that prefilled it
to the engine that decodes it (``delivery``). The engine side is ``engines.runtime``'s
``core.disagg``; the wire format is its ``kv_wire``."""
