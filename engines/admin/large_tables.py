"""The admin on large tables: page counts, filter choices and sorting that stay fast with
100,000 trace records and 1,000,000 request summaries on PostgreSQL (bench/trace_history.py).

Each piece replaces one query Django would run over the whole table on every list page:
``COUNT(*)`` (:class:`EstimatedCountPaginator`), ``SELECT DISTINCT`` for a filter's choices
(:func:`distinct_values`, :func:`distinct_rows`, :class:`IndexedValuesFilter`), and a sort no index serves
(:func:`indexed_fields` tells which columns may sort a whole table).
"""
from __future__ import annotations

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connections, models
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.functional import cached_property

__all__ = ["EstimatedCountPaginator", "IndexedValuesFilter", "distinct_rows", "distinct_values", "indexed_fields"]


class EstimatedCountPaginator(Paginator):
    """Exact counts, except for an unfiltered list of a large PostgreSQL table.

    ``COUNT(*)`` over a million rows costs more than the rest of the page; the
    planner's row estimate (``pg_class.reltuples``, kept fresh by autovacuum) is close
    enough to number the pages, and any filter or search falls back to an exact count.
    """

    ESTIMATE_ABOVE = 100_000

    @cached_property
    def count(self) -> int:
        qs = self.object_list
        if isinstance(qs, QuerySet) and not qs.query.where and not qs.query.distinct:
            connection = connections[qs.db]
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
                                   [qs.model._meta.db_table])
                    row = cursor.fetchone()
                if row and row[0] > self.ESTIMATE_ABOVE:
                    return int(row[0])
        return super().count


def distinct_values(model: type[models.Model], field_name: str) -> list[str]:
    """The distinct values of an indexed, non-null column, in order (:func:`distinct_rows` of one)."""
    return [row[0] for row in distinct_rows(model, field_name)]


def distinct_rows(model: type[models.Model], *field_names: str) -> list[tuple]:
    """The distinct combinations of non-null columns that an index leads with, in order.

    On PostgreSQL a recursive query hops through the index one combination at a time (a
    "loose index scan"): a few probes for a handful of engine names instead of
    ``SELECT DISTINCT`` reading all 100,000 rows on every list page.
    """
    manager = model._default_manager
    connection = connections[manager.db]
    if connection.vendor != "postgresql":
        return list(manager.order_by(*field_names).values_list(*field_names).distinct())
    quote = connection.ops.quote_name
    columns = []
    for name in field_names:
        field = model._meta.get_field(name)
        assert isinstance(field, models.Field) and field.column is not None  # a column, as said above
        columns.append(quote(field.column))
    table = quote(model._meta.db_table)
    # The next combination after the last one found, in the index's order: a row comparison,
    # which PostgreSQL answers from the index, one probe a combination.
    picked = ", ".join(f"t.{c} AS c{i}" for i, c in enumerate(columns))
    found = ", ".join(f"v.c{i}" for i in range(len(columns)))
    order = ", ".join(f"t.{c}" for c in columns)
    sql = (f"WITH RECURSIVE v AS ((SELECT {picked} FROM {table} t ORDER BY {order} LIMIT 1) "
           f"UNION ALL SELECT n.* FROM v, LATERAL (SELECT {picked} FROM {table} t "
           f"WHERE ({order}) > ({found}) ORDER BY {order} LIMIT 1) n) SELECT * FROM v")
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return [tuple(row) for row in cursor.fetchall()]


class IndexedValuesFilter(admin.AllValuesFieldListFilter):
    """Django's "all values" filter, listing the values through :func:`distinct_values`."""

    def __init__(self, field: models.Field, request: HttpRequest, params: dict[str, list[str]],
                 model: type[models.Model], model_admin: admin.ModelAdmin, field_path: str) -> None:
        # django-stubs still types the filters' params as Django 4's dict of strings (Django 5 passes
        # request.GET.lists()), and lookup_choices as the queryset Django puts there (any iterable does).
        super().__init__(field, request, params, model, model_admin, field_path)  # type: ignore[arg-type]
        self.lookup_choices = distinct_values(model, field.name)  # type: ignore[assignment]


def indexed_fields(model: type[models.Model]) -> frozenset[str]:
    """The fields an index can sort the whole table by: ``db_index`` ones, and the first
    field of each of ``Meta.indexes``."""
    opts = model._meta
    # Field.__init__ sets db_index; django-stubs declares it as an argument only.
    return frozenset({f.name for f in opts.concrete_fields if f.db_index}  # type: ignore[attr-defined]
                     | {index.fields[0].lstrip("-") for index in opts.indexes})
