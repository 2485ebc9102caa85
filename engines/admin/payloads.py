"""What the trace and profile admins share: both records store a gzip JSON payload
(``engines.models.PayloadRecord``), which no admin page reads to show a record.

Lists, detail pages, actions and deletes load records with the payload deferred, so a page
costs the same for a 1 KB profile and a 200 MB trace. The payload is read (and its CRC
checked) only where it is needed: a download or a page's data (``engines.history.downloads``),
and the "Verify stored payloads" action here, which checks the selected records on request.
"""
from __future__ import annotations

from typing import Generic, TypeVar

from django.contrib import admin, messages
from django.contrib.admin.utils import model_ngettext
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.defaultfilters import filesizeformat

from engines.history.downloads import read_payload
from engines.history.payload import PayloadError
from engines.models import PayloadRecord

__all__ = ["PayloadRecordAdmin"]

#: How many damaged records the verify action names one by one.
VERIFY_NAMED = 20


RecordT = TypeVar("RecordT", bound=PayloadRecord)


class PayloadRecordAdmin(admin.ModelAdmin, Generic[RecordT]):
    """The admin of a :class:`PayloadRecord`: payload deferred, its size and check shown, its
    bytes verified on request; records come from saving, never from a form.

    Generic in the record's model (``PayloadRecordAdmin[TraceRecord]``), so that a subclass's
    queryset holds its own records to a type checker."""

    #: Columns no page of this admin reads: the payload, and any a record adds.
    deferred_fields: tuple[str, ...] = ("payload",)
    actions: tuple[str, ...] = ("verify_payloads",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[RecordT]:
        return super().get_queryset(request).defer(*self.deferred_fields)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.display(description="payload size")
    def payload_size(self, obj: PayloadRecord) -> str:
        return f"{filesizeformat(obj.payload_bytes)} JSON, {filesizeformat(obj.compressed_bytes)} stored (gzip)"

    @admin.display(description="payload check")
    def payload_check(self, obj: PayloadRecord) -> str:
        """When the payload's bytes are checked; this page shows the record without reading them."""
        if obj.payload_crc32 is None:
            how = "no checksum (saved before checksums were kept): checked by inflating it"
        else:
            how = f"CRC32 {obj.payload_crc32:08x} of the stored bytes: checked"
        return (f"{how} on every download and page that reads it, and by the list's "
                "“Verify stored payloads” action; this page does not read it.")

    @admin.action(description="Verify stored payloads of the selected records", permissions=["view"])
    def verify_payloads(self, request: HttpRequest, queryset: QuerySet[PayloadRecord]) -> None:
        """Read each selected record's payload and check it (size and CRC, or inflated without one)."""
        checked, damaged = 0, []
        for record in queryset.order_by("pk").iterator(chunk_size=100):
            checked += 1
            try:
                read_payload(record)
            except PayloadError as exc:
                damaged.append(f"#{record.pk}: {exc}")
        what = f"{checked} {model_ngettext(self.opts, checked)}"
        if not damaged:
            self.message_user(request, f"Checked {what}: every stored payload is intact.", messages.SUCCESS)
            return
        named = " ".join(damaged[:VERIFY_NAMED]) + (f" … and {len(damaged) - VERIFY_NAMED} more."
                                                   if len(damaged) > VERIFY_NAMED else "")
        self.message_user(request, f"Checked {what}: {len(damaged)} damaged. {named} "
                                   "Their metadata and derived figures are still valid; delete those records, or "
                                   "restore them from a database backup.", messages.ERROR)
