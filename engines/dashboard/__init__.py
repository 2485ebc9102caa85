"""The live dashboard's server side: what each engine is doing, pushed to browsers over websockets.

``messages`` defines every message a dashboard socket carries (one definition each);
``sampler`` reads each engine's metrics a few times a second, once per server process however
many browsers watch, and publishes snapshots to the engine's channel-layer group;
``engines.consumers`` is the thin websocket consumer that joins those groups and carries out
the dashboard's actions.
"""
