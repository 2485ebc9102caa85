"""What the weights compute: config, checkpoints and tokenizer, the demo model, the Llama
forward pass, backends, the paged KV tensors and the numba kernels. Imports nothing from
``core`` or ``frontend``."""
