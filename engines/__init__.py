"""LLM engine debug server: the Django app around our inference engines (``engines.runtime``)."""
import os

__version__ = "0.1.0"

# After each call OpenBLAS's idle threads spin for 2**28 cycles (about 0.1 s) by default,
# holding a core that numba's parallel kernels then wait a whole scheduler slice for (35 ms a
# decode step on 2 cores, measured). 2**4 cycles: they sleep at once. OpenBLAS reads this only
# when numpy loads it, so it is set here, as the app's package is imported: manage.py, the ASGI
# app, the tests and the benches import it before numpy (and engine processes inherit it).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
# The mirror image: after a parallel loop numba's OpenMP threads (GNU libgomp) spin 300,000
# rounds (about 5 ms here) before sleeping, so the BLAS call after a numba kernel lost its second
# core for that long: a prefill's first projection took 8.9 ms instead of 4.3 after the previous
# step's lm_head. 10,000 rounds still bridge the gaps between a decode step's kernels (decode
# speed unchanged, measured at batch 1, 8 and 32); a passive wait policy cost decode 20-70%.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
