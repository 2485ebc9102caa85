"""The stall watchdog (issue 61): an engine that is up but not progressing, caught with its
evidence. ``detector`` (the three rules over progress readings, plain logic), ``stall_watch``
(the thread that polls every engine's board, feeds the detectors and takes an incident's
evidence) and ``stack_capture`` (every thread's stack of an engine process read from outside, with
py-spy). The history keeps the incidents (``engines.history.incidents``); ``/health``, ``/metrics``
and ``/debug/list_incidents`` show them.

This ``__init__`` imports nothing: import from the modules.
"""
