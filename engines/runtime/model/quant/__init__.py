"""ggml's quantized formats, apart from any file that holds them: the types' ids and block sizes
(``quant_types``), their dequantization kernels (``dequantize``), and the two layouts a weight is
kept quantized in (``quantized_weight``, and the CPU's ``interleaved_weight``). The GGUF reader
(``model.gguf``) builds on these; nothing here imports it."""
