"""The app's ``manage.py`` commands: ``serve`` (build the engines and serve them), ``fleet``
(attach, list and detach foreign servers), ``replay`` (send a recorded workload to a server),
``compare_runs`` (the regression report of one run against another) and ``prune_history`` (the
history's retention limits, applied now)."""
