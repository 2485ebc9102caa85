"""The live dashboard, one package: what each engine is doing, pushed to browsers over
websockets, the pages around it, and the fleet's pages.

Live: ``sampler`` reads each engine's metrics a few times a second, once per server process
however many browsers watch, and publishes snapshots to the engine's channel-layer group;
``feed`` tells a page whether they still arrive. ``consumers`` are the thin websocket consumers
of an engine (join those groups, carry out the dashboard's actions) and of its live timeline,
on one base (``StaffSocket``); ``fleet_socket`` is the fleet page's, on the same base. ``routing``
routes them, ``same_origin`` lets them open only from the server's own pages, and
``socket_auth`` reads their session and user (and leaves a socket anonymous, saying why, while
the database does not answer); ``messages`` and ``timeline_messages`` define every message a
socket carries (one model each).

Pages: ``pages`` (the overview, an engine, the playground, the local login link, whose account
``local_login`` keeps), ``request_page`` (one request and where its time went, as a
``waterfall``), ``timeline`` (a saved or live trace and its data), ``profiles`` (a saved profile,
its data, a compare), ``fleet`` (the fleet's grid, attaching servers, jobs) and ``fleet_history``
(the fleet over time, its SLOs), all in the admin's frame (``frame``); ``urls`` routes them
under ``/dashboard/``.
"""
