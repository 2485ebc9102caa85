"""LLM engine debug server: the Django app around our inference engines (``engines.runtime``)."""
import os

__version__ = "0.1.0"

# After each call OpenBLAS's idle threads spin for 2**28 cycles (about 0.1 s) by default,
# holding a core that numba's parallel kernels then wait a whole scheduler slice for (35 ms a
# decode step on 2 cores, measured). 2**4 cycles: they sleep at once. OpenBLAS reads this only
# when numpy loads it, so it is set here, as the app's package is imported: manage.py, the ASGI
# app, the tests and the benches import it before numpy (and engine processes inherit it).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
