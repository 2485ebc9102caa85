"""What a server's ``/metrics`` serves, as samples by name: the Prometheus text format (through
``prometheus_client``'s parser), or MLC LLM's own tab-separated text.

MLC's ``/metrics`` is not valid Prometheus text (tab-separated, label values unquoted, no
``# TYPE`` lines), so it gets a parser of its own; everything else goes through the library.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Exposition", "ExpositionError", "Sample", "parse_exposition"]


class ExpositionError(ValueError):
    """A ``/metrics`` body that is neither Prometheus text nor MLC's; the message says where."""


@dataclass(frozen=True)
class Sample:
    """One line of the exposition: its labels and its value."""

    labels: dict[str, str]
    value: float


@dataclass
class Exposition:
    """Samples by their full name (``vllm:prompt_tokens_total``, ``..._bucket``), and each
    family's declared type by family name (``counter``, ``histogram``; ``unknown`` when the
    body declares none). ``format`` is ``prometheus`` or ``mlc``."""

    samples: dict[str, list[Sample]] = field(default_factory=lambda: defaultdict(list))
    types: dict[str, str] = field(default_factory=dict)
    format: str = "prometheus"

    @property
    def names(self) -> set[str]:
        """Every sample name present."""
        return set(self.samples)


# MLC's lines: ``name\tvalue`` or ``name{key=value,...}\tvalue`` (values unquoted).
_MLC_LINE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\t(?P<value>\S+)$")


def parse_exposition(text: str) -> Exposition:
    """Parse a ``/metrics`` body. Raises :class:`ExpositionError` for anything else (HTML, JSON,
    a cut-off or garbled line)."""
    if _looks_like_mlc(text):
        return _parse_mlc(text)
    out = Exposition()
    try:
        for family in text_string_to_metric_families(text):
            out.types[family.name] = family.type
            for sample in family.samples:
                out.samples[sample.name].append(Sample(dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError) as exc:  # the library's ways of saying "not this format"
        raise ExpositionError(f"not Prometheus text: {exc}") from None
    return out


def _looks_like_mlc(text: str) -> bool:
    for line in text.splitlines():
        if line and not line.startswith("#"):
            return "\t" in line and bool(_MLC_LINE.match(line))
    return False


def _parse_mlc(text: str) -> Exposition:
    out = Exposition(format="mlc")
    for number, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        match = _MLC_LINE.match(line)
        if match is None:
            raise ExpositionError(f"line {number} of MLC's metrics text is not 'name<TAB>value': {line[:80]!r}")
        labels = {}
        for pair in filter(None, (match["labels"] or "").split(",")):
            key, _, value = pair.partition("=")
            labels[key.strip()] = value.strip().strip('"')
        try:
            value = float(match["value"])
        except ValueError:
            raise ExpositionError(f"line {number}: {match['value']!r} is not a number") from None
        out.samples[match["name"]].append(Sample(labels, value))
    return out
