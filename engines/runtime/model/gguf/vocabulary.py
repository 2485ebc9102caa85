"""A GGUF file's tokenizer as a Hugging Face ``tokenizer.json``, from llama.cpp's metadata keys.

A GGUF holds no ``tokenizer.json``: its vocabulary, merges, token types and special ids are
metadata (``tokenizer.ggml.*``), and how text is split before the merges is named by one string,
``tokenizer.ggml.pre``, which llama.cpp maps to a list of regular expressions
(``llama-vocab.cpp``). :func:`tokenizer_files_from_gguf` writes the equivalent ``tokenizer.json``
(a byte-level BPE model; the pre-tokenizer as a sequence of isolating splits, one per llama.cpp
expression, then GPT-2's byte mapping; control tokens as special added tokens) and the
``tokenizer_config.json`` fields (special token strings, ``add_bos_token``, the chat template), so
the engine's :class:`~engines.runtime.model.tokenizer.Tokenizer`, the grammar compiler and the
chat template renderer take a GGUF exactly as they take a Hugging Face folder.

Only byte-level BPE vocabularies (``tokenizer.ggml.model`` ``gpt2``: Llama 3, Qwen2, SmolLM,
GPT-2 and their kin) are read; SentencePiece (``llama``) and the rest raise a
:class:`CheckpointError` naming what is supported.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from engines.runtime.model.config import CheckpointError

__all__ = ["PRE_TOKENIZERS", "tokenizer_files_from_gguf"]

# GPT-2's split (llama.cpp's "gpt2" expression; the trailing \s+ is what llama.cpp's own GPT-2
# splitter does for whitespace at the end, and what Hugging Face's ByteLevel regex says).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: ``tokenizer.ggml.pre`` -> (llama.cpp's expressions, in order; whether whole words in the
#: vocabulary skip the merges, llama.cpp's ``ignore_merges``). Each group is one case of
#: ``llm_tokenizer_bpe``'s switch.
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{name: ((_GPT2,), False) for name in ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion")},
    **{name: ((r"\p{N}", _GPT2), False)
       for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")},
    **{name: ((_LLAMA3,), True)
       for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "smaug-bpe", "dbrx")},
    **{name: ((_QWEN2,), False) for name in ("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez", "hunyuan")},
}

# llama.cpp's token types (``llama_token_type``).
_CONTROL, _USER_DEFINED = 3, 4


def tokenizer_files_from_gguf(metadata: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(tokenizer.json text, tokenizer_config.json dict)`` for a GGUF file's metadata.

    Raises :class:`CheckpointError` for a tokenizer this engine does not read, naming what it reads.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(
            f"the GGUF's tokenizer is {model!r}; this engine reads byte-level BPE vocabularies "
            "(tokenizer.ggml.model 'gpt2': Llama 3, Qwen2, SmolLM and kin) from GGUF files. Serve the "
            "model's Hugging Face folder instead, which carries its tokenizer.json"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"the GGUF's pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; this engine splits "
            f"text as {', '.join(sorted(PRE_TOKENIZERS))}. Serve the model's Hugging Face folder instead"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError("the GGUF has no tokenizer.ggml.tokens: it carries no vocabulary")
    if not isinstance(merges, list):
        raise CheckpointError("the GGUF's byte-level vocabulary has no tokenizer.ggml.merges")
    token_types = metadata.get("tokenizer.ggml.token_type")
    types: Sequence[int] = [int(t) for t in token_types] if token_types is not None else [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"the GGUF lists {len(tokens)} tokens but {len(types)} token types: corrupt")

    expressions, ignore_merges = PRE_TOKENIZERS[pre]
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # a duplicate keeps its first id, as llama.cpp's text_to_token does
    added = [
        {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": types[i] == _CONTROL}
        for i in range(len(tokens)) if types[i] in (_CONTROL, _USER_DEFINED)
    ]
    splits = [{"type": "Split", "pattern": {"Regex": e}, "behavior": "Isolated", "invert": False} for e in expressions]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            *splits, {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        # No post-processor: add_bos_token / add_eos_token below decide, as in llama.cpp.
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    }
    config: dict[str, Any] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[name] = tokens[int(token_id)]
    # llama.cpp adds BOS to a BPE prompt only when the file says so (Llama 3's converter does).
    config["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return orjson.dumps(tokenizer_json).decode(), config
