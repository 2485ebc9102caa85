"""Disaggregated serving, the engine's side: a window of one request's K/V leaves one engine
and lands in pages another engine reserved for it (MLC's MicroServing).

Three steps, tied by the request id (the client's ``user``):

1. ``prepare_receive`` on the decode engine (``receiver.KVReceiver.prepare``): the prompt's
   cached prefix is matched, pages are reserved up to ``end`` and a ``KVReceipt`` names them
   (with a fresh ``ticket``, so metadata of an earlier reservation of the same id is refused
   as stale).
2. ``remote_send`` on the prefill engine: a request with a ``KVSend`` prefills ``prompt[:end]``
   without sampling (``sender.KVSender`` checks the window and copies the K/V of
   ``[begin:end]`` out of the pages as a ``KVBlock``). A block for an engine of the same server
   rides back on the request's last output; one for another server's engine is posted from the
   prefill engine's own process straight to that engine's listener (``kv_http``, in the
   ``kv_wire`` format), and the last output says how it went (``KVDelivery``).
3. ``start_generation`` on the decode engine: a request with ``kv_window_begin`` adopts the
   filled reservation and generates on it.

Modules: ``transfer`` (the data and the window checks), ``receiver``, ``sender``, ``kv_wire``
(the transfer format), ``kv_http`` (the engine process's listener and the poster).
"""
