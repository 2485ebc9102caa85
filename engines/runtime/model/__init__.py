"""What the weights compute: config, checkpoints and tokenizer, the demo model, the Llama
forward pass, backends, the paged KV tensors and the numba kernels. Imports nothing from
``core`` or ``frontend``."""

from engines.runtime.numba_cache import install_cache_locators

# Before any of this package's compiled functions is decorated (numba picks its cache then).
install_cache_locators()
