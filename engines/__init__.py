"""LLM engine debug server: the Django app around our inference engines (``engines.runtime``)."""

__version__ = "0.1.0"
