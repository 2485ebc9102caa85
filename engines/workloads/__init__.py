"""Workloads, replays and the regression report (issue 62): what the flight recorder captured sent
again to any OpenAI-compatible server, and two such runs compared.

- ``replay``: a workload (``engines.runtime.telemetry.flight_recorder``) sent to a server at its
  recorded arrival times; what its client saw is a run.
- ``run_compare``: two runs compared, figure by figure, with bootstrap intervals and verdicts.
"""
