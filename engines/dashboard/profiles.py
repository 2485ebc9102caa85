"""The profile pages: one saved profile (kernel table, step breakdown, flame graph, config), its
data and download, its kernels on the timeline, and two profiles compared.

The page's table is rendered here (it reads without JavaScript); ``static/engines/js/profile/``
sorts it and draws the step chart and the flame graph from ``data.json``: the stored gzip bytes,
inflated by the browser. Every read of a profile's payload checks it (``engines.history.downloads``):
a damaged one is answered with what is wrong (409), never a 500.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.urls import reverse

from engines.dashboard.frame import data_error, page_context, record_payload
from engines.history.downloads import PAYLOAD_ERROR_STATUS, gzip_json_response, read_payload
from engines.history.payload import PayloadError, compress_json, decompress_json
from engines.models import ProfileRecord
from engines.registry import registry
from engines.server.server_identity import server_id

#: A kernel slower (or faster) by more than this share is highlighted on the compare page.
CHANGE_THRESHOLD = 0.10


def _record(request: HttpRequest, pk: int) -> ProfileRecord | None:
    """The profile ``pk`` without its payload (whoever needs it reads it checked), or None."""
    if not request.user.has_perm("engines.view_profilerecord"):
        raise PermissionDenied
    return ProfileRecord.objects.defer("payload").filter(pk=pk).first()


def _missing_text(pk: int) -> str:
    return (f"There is no profile #{pk}: it was never saved, or deleted (retention keeps each engine's newest "
            f"profiles). Profile records lists those kept.")


def _problem_page(request: HttpRequest, problem: str, *, status: int) -> HttpResponse:
    """What was wrong with the address, in the admin's frame, with the way back to the list."""
    return render(request, "dashboard/profile_problem.html",
                  page_context(request, "Profile not shown", problem=problem), status=status)


def _missing_page(request: HttpRequest, pk: int) -> HttpResponse:
    return _problem_page(request, _missing_text(pk), status=404)


@staff_member_required
def profile_page(request: HttpRequest, pk: int) -> HttpResponse:
    """``/dashboard/profiles/<id>/``: one profile."""
    record = _record(request, pk)
    if record is None:
        return _missing_page(request, pk)
    others = (ProfileRecord.objects.filter(engine=record.engine).exclude(pk=record.pk).defer("payload")
              .order_by("-captured_at", "-id")[:50])
    source = {"data_url": reverse("dashboard-profile-data", args=[pk])}
    return render(request, "dashboard/profile.html", page_context(
        request, f"Profile #{record.pk} of {record.engine}", record=record, source=source,
        kernels=[_kernel_row(k) for k in record.kernels], columns=KERNEL_COLUMNS, others=others,
        duration_text=duration(record.duration_us),
        engine_url=reverse("dashboard-engine", args=[record.engine])
        if record.server == server_id() and registry.get(record.engine) else None))


def duration(us: float | None) -> str:
    """µs as a person reads them: 850 µs, 12.3 ms, 1.50 s."""
    if us is None:
        return "–"
    if us < 1000:
        return f"{us:.3g} µs" if us < 100 else f"{us:.0f} µs"
    if us < 1e6:
        return f"{us / 1000:.3g} ms" if us < 1e5 else f"{us / 1000:.0f} ms"
    return f"{us / 1e6:.3g} s"


def _number(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}g}" if value < 10 ** digits else f"{value:,.0f}"


def _kernel_row(kernel: dict[str, Any]) -> dict[str, Any]:
    """A kernel-table row: ``cells`` as (text, sort key) in the table's column order."""
    peak = kernel.get("peak_fraction")
    return {"name": kernel["name"], "cells": [
        (f"{kernel['calls']:,}", kernel["calls"]),
        (duration(kernel["total_us"]), kernel["total_us"]),
        (duration(kernel["mean_us"]), kernel["mean_us"]),
        (duration(kernel["p50_us"]), kernel["p50_us"]),
        (duration(kernel["p99_us"]), kernel["p99_us"]),
        (f"{100 * (kernel.get('share_of_steps') or 0):.1f} %", kernel.get("share_of_steps") or 0),
        (_number(kernel.get("gbs")), kernel.get("gbs") or 0),
        (_number(kernel.get("gflops")), kernel.get("gflops") or 0),
        ("–" if peak is None else f"{100 * peak:.1f} %", -1 if peak is None else peak),
    ]}


KERNEL_COLUMNS = ("calls", "total", "mean", "p50", "p99", "share of step time", "GB/s", "GFLOP/s", "of peak GB/s")


@staff_member_required
def profile_data(request: HttpRequest, pk: int) -> HttpResponse | StreamingHttpResponse:
    """``data.json``: the whole profile, gzip on the wire."""
    return record_payload(request, _record(request, pk), "data", _missing_text(pk))


@staff_member_required
def profile_download(request: HttpRequest, pk: int) -> HttpResponse | StreamingHttpResponse:
    """``profile.json.gz``: the stored bytes, as a file."""
    return record_payload(request, _record(request, pk), "json.gz", _missing_text(pk))


@staff_member_required
def profile_trace(request: HttpRequest, pk: int) -> HttpResponse:
    """``trace.json``: the profile's kernel, phase and step spans as a Chrome trace (gzip)."""
    record = _record(request, pk)
    if record is None:
        return data_error(_missing_text(pk), 404)
    try:
        trace = orjson.loads(decompress_json(read_payload(record)))["trace"]
    except PayloadError as exc:
        return data_error(str(exc), PAYLOAD_ERROR_STATUS)
    return gzip_json_response(compress_json(orjson.dumps(trace)).data)


@staff_member_required
def profile_timeline(request: HttpRequest, pk: int) -> HttpResponse:
    """``timeline/``: the profile's spans in the timeline viewer."""
    record = _record(request, pk)
    if record is None:
        return _missing_page(request, pk)
    trace_url = reverse("dashboard-profile-trace", args=[pk])
    source = {"mode": "saved", "kind": "profile", "record": record.pk, "engine": record.engine,
              "data_url": trace_url, "requests_url": None, "download_json": None,
              "download_gzip": reverse("dashboard-profile-download", args=[pk]),
              "record_url": reverse("dashboard-profile", args=[pk]), "events": record.kernel_calls}
    return render(request, "dashboard/timeline.html",
                  page_context(request, f"Timeline of profile #{record.pk}", source=source, record=record))


#: A side's columns on the compare page: (key, header).
COMPARE_COLUMNS = (("calls", "calls"), ("total", "total"), ("mean", "mean"), ("gbs", "GB/s"))


@dataclass(frozen=True)
class KernelChange:
    """One kernel name in two profiles (either side may lack it): A is the baseline, B is measured
    against it, and every change on the compare page is (B − A) / A, as the trace compare's."""

    name: str
    a: dict[str, Any] | None
    b: dict[str, Any] | None

    @property
    def change(self) -> float | None:
        """B's mean time over A's, less one: +0.25 is 25% slower."""
        if not self.a or not self.b or not self.a.get("mean_us"):
            return None
        return self.b["mean_us"] / self.a["mean_us"] - 1

    def cells(self, side: str) -> list[tuple[str, str]]:
        """One side's figures as printed, each with its column's key (:data:`COMPARE_COLUMNS`)."""
        k = self.a if side == "a" else self.b
        if k is None:
            return [(key, "–") for key, _ in COMPARE_COLUMNS]
        return list(zip((key for key, _ in COMPARE_COLUMNS),
                        (f"{k['calls']:,}", duration(k["total_us"]), duration(k["mean_us"]), _number(k.get("gbs"))),
                        strict=True))

    @property
    def cells_a(self) -> list[tuple[str, str]]:
        return self.cells("a")

    @property
    def cells_b(self) -> list[tuple[str, str]]:
        return self.cells("b")

    @property
    def change_text(self) -> str:
        change = self.change
        if change is None:  # a side lacks the kernel, or A has no mean time to compare with: a dash
            return "only in A" if self.b is None else "only in B" if self.a is None else "–"
        return f"{100 * change:+.1f} %"

    @property
    def verdict(self) -> str:
        change = self.change
        if change is None:
            return "only-a" if self.b is None else "only-b"
        return "slower" if change > CHANGE_THRESHOLD else "faster" if change < -CHANGE_THRESHOLD else "same"


@staff_member_required
def profile_compare(request: HttpRequest) -> HttpResponse:
    """``compare/?a=<id>&b=<id>``: two profiles' kernels and step phases side by side."""
    try:
        a_pk, b_pk = int(request.GET["a"]), int(request.GET["b"])
    except (KeyError, ValueError):
        return _problem_page(request, "Name the two profiles to compare by their ids: "
                                      "/dashboard/profiles/compare/?a=<id>&b=<id>.", status=400)
    a, b = _record(request, a_pk), _record(request, b_pk)
    if a is None or b is None:
        return _missing_page(request, a_pk if a is None else b_pk)
    try:
        phases_a, phases_b = _phase_means(a), _phase_means(b)
    except PayloadError as exc:
        return _problem_page(request, str(exc), status=PAYLOAD_ERROR_STATUS)
    names = list(dict.fromkeys([k["name"] for k in a.kernels] + [k["name"] for k in b.kernels]))
    by_a, by_b = {k["name"]: k for k in a.kernels}, {k["name"]: k for k in b.kernels}
    rows = [KernelChange(name, by_a.get(name), by_b.get(name)) for name in names]
    phases = [(name, duration(phases_a.get(name)), duration(phases_b.get(name)),
               _change_text(phases_a.get(name), phases_b.get(name)))
              for name in dict.fromkeys([*phases_a, *phases_b])]
    # B measured against A, the baseline: the title names B first, as every change is (B − A) / A.
    return render(request, "dashboard/profile_compare.html", page_context(
        request, f"Profile #{b.pk} against #{a.pk}", a=a, b=b, rows=rows, phases=phases, columns=COMPARE_COLUMNS,
        threshold_pct=round(100 * CHANGE_THRESHOLD)))


def _change_text(a: float | None, b: float | None) -> str:
    """(B − A) / A as printed, or a dash without a baseline."""
    return "–" if not a or b is None else f"{100 * (b / a - 1):+.1f} %"


def _phase_means(record: ProfileRecord) -> dict[str, float]:
    """Mean µs per step of each phase, and of the whole step (``step``); raises ``PayloadError``."""
    profile = orjson.loads(decompress_json(read_payload(record)))
    fields, rows = profile["step_rows"]["fields"], profile["step_rows"]["rows"]
    if not rows:
        return {}
    means = {"step": sum(r[fields.index("total_us")] for r in rows) / len(rows)}
    for phase in profile.get("phases", []):
        column = fields.index(phase)
        means[phase] = sum(r[column] for r in rows) / len(rows)
    return means
