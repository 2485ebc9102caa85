"""Workloads, replays and the regression report (issue 62): what the flight recorder captured sent
again to any OpenAI-compatible server, and two such runs compared.

- ``replay``: a workload (``engines.runtime.telemetry.flight_recorder``) sent to a server at its
  recorded arrival times; what its client saw is a run.
- ``run_job``: the replay job the admin starts: a run record, the target's configuration, and for
  our servers a profile and the trace of the run.
- ``run_compare``: two runs compared, figure by figure, with bootstrap intervals and verdicts,
  their configurations diffed, their phases and kernels side by side.
- ``run_report``: that report for two saved runs, with the phases and kernels their records hold.
"""
