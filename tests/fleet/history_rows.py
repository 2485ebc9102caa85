"""A fleet's history for the tests of its page (server and browser): rollups of two engines on
two servers, five bad minutes on one, and a job among them."""
from __future__ import annotations


def make_history(minutes: int = 30) -> None:
    """Rollups of two engines on two servers over the last ``minutes`` and one job among them."""
    import datetime as dt

    from engines.fleet.rows import WindowHistogram
    from engines.models import FleetJob, FleetRollup

    now = dt.datetime.now(dt.timezone.utc).replace(second=0, microsecond=0)
    bounds = [0.05, 0.1, 0.2, 0.5, 1.0]
    rows = []
    for m in range(minutes):
        start = now - dt.timedelta(minutes=minutes - m)
        slow = 0.3 if 10 <= m < 15 else 0.0  # five bad minutes on one server
        for server, engine, share_fast in (("a:1", "demo", 0.95 - slow), ("b:2", "llama", 0.9)):
            fast, total = 100 * share_fast, 100.0
            ttft = WindowHistogram(bounds=bounds, cumulative=[fast / 2, fast, fast + 3, total - 1, total, total])
            itl = WindowHistogram(bounds=bounds, cumulative=[90.0, 99.0, 100.0, 100.0, 100.0, 100.0])
            rows.append(FleetRollup(period="minute", start=start, server=server, server_name=server, engine=engine,
                                    model=engine, samples=12, running=3.0, waiting=0.5, kv_usage=0.4,
                                    prompt_tokens=600.0, generation_tokens=3000.0,
                                    ttft=ttft.model_dump(), itl=itl.model_dump()))
    FleetRollup.objects.bulk_create(rows)
    job = FleetJob.objects.create(action="reset", requested_by="admin", requested_on="a:1")
    FleetJob.objects.filter(pk=job.pk).update(created_at=now - dt.timedelta(minutes=minutes - 12))


def make_one_minute_load(busy: str = "c:3", idle: str = "idle:4", minutes: int = 6) -> None:
    """Two servers' last ``minutes``, idle (histograms of no request) but for one minute of load
    on ``busy``, three minutes before the last."""
    import datetime as dt

    from engines.fleet.rows import WindowHistogram
    from engines.models import FleetRollup

    now = dt.datetime.now(dt.timezone.utc).replace(second=0, microsecond=0)
    bounds = [0.05, 0.1, 0.2, 0.5, 1.0]
    nothing = WindowHistogram(bounds=bounds, cumulative=[0.0] * 6).model_dump()
    rows = []
    for m in range(minutes):
        start = now - dt.timedelta(minutes=minutes - m)
        for server in (busy, idle):
            loaded = server == busy and m == minutes - 3
            ttft = WindowHistogram(bounds=bounds, cumulative=[10.0, 18.0, 19.0, 20.0, 20.0, 20.0]).model_dump()
            itl = WindowHistogram(bounds=bounds, cumulative=[15.0, 19.0, 20.0, 20.0, 20.0, 20.0]).model_dump()
            rows.append(FleetRollup(period="minute", start=start, server=server, server_name=server, engine="demo",
                                    model="demo", samples=12, running=2.0 if loaded else 0.0, waiting=0.0,
                                    generation_tokens=900.0 if loaded else 0.0, ttft=ttft if loaded else nothing,
                                    itl=itl if loaded else nothing))
    FleetRollup.objects.bulk_create(rows)


if __name__ == "__main__":  # the browser tests write it into a live server's database
    import sys

    import django

    django.setup()
    make_one_minute_load() if sys.argv[1:] == ["one-minute"] else make_history()
