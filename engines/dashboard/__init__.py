"""The live dashboard, one package: what each engine is doing, pushed to browsers over
websockets, and the pages around it.

Live: ``sampler`` reads each engine's metrics a few times a second, once per server process
however many browsers watch, and publishes snapshots to the engine's channel-layer group;
``consumers`` are the thin websocket consumers (join those groups, carry out the dashboard's
actions, follow an engine's trace), routed by ``routing`` and guarded by ``same_origin``;
``messages`` and ``timeline_messages`` define every message a socket carries (one model each).

Pages: ``pages`` (the overview, an engine, the playground, the local login link), ``timeline``
(a saved or live trace and its data), ``profiles`` (a saved profile, its data, a compare), all
in the admin's frame (``frame``); ``urls`` routes them under ``/dashboard/``.
"""
