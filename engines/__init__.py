"""LLM engine debug server: the Django app around our inference engines (``engines.runtime``)."""
import os

__version__ = "0.1.0"

# After each call OpenBLAS's idle threads spin for 2**28 cycles (about 0.1 s) by default,
# holding a core that numba's parallel kernels then wait a whole scheduler slice for
# (docs/perf-log/code-comments.md#openblas-spin). 2**4 cycles: they sleep at once. OpenBLAS reads this only
# when numpy loads it, so it is set here, as the app's package is imported: manage.py, the ASGI
# app, the tests and the benches import it before numpy (and engine processes inherit it).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
# The mirror image: after a parallel loop numba's OpenMP threads (GNU libgomp) spin 300,000
# rounds before sleeping, so the BLAS call after a numba kernel lost its second core for that
# long. 10,000 rounds still bridge the gaps between a decode step's kernels, and a passive wait
# policy slows decode (docs/perf-log/code-comments.md#gomp-spin has the figures).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
