"""One recorded workload replayed onto our server and onto llama.cpp's own (issue 62), and the report.

Both serve the built-in SmolLM2-135M-Instruct Q4_1 GGUF at ``--threads``: ours as ``manage.py serve
--model smollm2 --enable-debug --enable-tracing --backend cpu --weights-dtype gguf`` (the file's
matrices kept quantized, as llama.cpp keeps them; BLAS, OpenMP and numba given ``--threads``),
llama.cpp as ``python -m llama_cpp.server --model FILE --n_threads N --n_threads_batch N`` from
llama-cpp-python ``LLAMA_CPP_VERSION``, built as ``bench/gguf_vs_llamacpp.py`` builds it (there a
tiny generation first: the build without AMX where the default one dies in its first product,
``--llamacpp-build``), with its ``[server]`` packages, pinned in
``bench/requirements-llamacpp-server.txt``, added to that build's venv (once). That server runs one
request at a time (one ``Llama`` behind a lock, no batching), in the environment the bench started
with, and with ``--interrupt_requests False``: by default a request that waits cuts the running
one's stream short; it answers an ``X-Request-Id`` that is not a UUID with a bare 400
(starlette-context's check), so the replay names no request there, and applies a repeat penalty
of 1.1 unless a request says otherwise, so each says ``repeat_penalty: 1.0`` (``LLAMACPP_BODY``).

The workload is recorded on ours: ``--bursts`` bursts ``--burst-gap`` seconds apart, each of 4 to 8
requests sent at once, prompts of 64 to 256 tokens and 64 to 128 output tokens (a seeded draw,
``plan_bursts``), greedy, EOS ignored; then ``POST /debug/dump_workload``, of which the bench keeps
its own requests (by their ``X-Request-Id``). Each of ``--rounds`` replays it
(``engines.workloads.replay``, arrivals ``--speed`` times faster) onto both servers, the first one
alternating, after an untimed request to each; each asks for its recorded length (``ignore_eos``,
and ``min_tokens`` for llama.cpp's server, which stops at EOS otherwise); prompts as text
(``prompt_form="text"``: llama.cpp's server takes text only, so both get the same prompts). The
rounds' requests are pooled a server, and ``compare_runs`` (A ours, B llama.cpp) gives the TTFT,
ITL and E2E percentiles with bootstrap intervals, output tokens/s, and how many greedy outputs are
the same.

Files: ``var/bench-replay/<UTC time>/``: workload.json, ours.json and llamacpp.json (the pooled
runs), report.json and report.md, and llama.cpp's server log; the figures go to the results file.
Where llama.cpp cannot be built or started, or its server dies, the bench replays onto ours alone,
says why with the log's tail, and exits 1.

    .venv/bin/python bench/replay.py                              # 3 bursts, 2 threads, 1 round
    .venv/bin/python bench/replay.py --threads 1 --bursts 2 --rounds 2 --speed 2
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The repository root, not bench/, first on the path (as bench/gguf_vs_llamacpp.py has it).
sys.path[0] = str(REPO)

# First: it keeps the environment as the bench started, before ``engines`` sets its own threads' variables.
from bench.gguf_vs_llamacpp import (  # noqa: E402
    DEFAULT_BUILD, LLAMA_BUILDS, LLAMA_CPP_VERSION, START_ENVIRONMENT, LlamaBuild, build_param, builtin_gguf,
    working_llamacpp)
from bench.cpu_threads import THREAD_VARIABLES  # noqa: E402
from bench.results_file import ResultsFile, add_results_option, current_commit, this_machine  # noqa: E402
from bench.servers import free_port, launch, stop, wait_healthy  # noqa: E402
from bench.tool_env import tool_venv  # noqa: E402

import httpx  # noqa: E402

from engines.workloads.replay import prompt_for, replay  # noqa: E402
from engines.workloads.run_compare import compare_runs, markdown  # noqa: E402

BENCH = "replay"
OUT = REPO / "var" / "bench-replay"
SERVER_REQUIREMENTS = REPO / "bench" / "requirements-llamacpp-server.txt"
MODEL = "smollm2"
#: The recorded requests' ``X-Request-Id`` prefix: what the bench keeps of the dumped workload.
RECORD_PREFIX = "bench-replay-record-"
BURST_SIZE = (4, 8)
PROMPT_TOKENS = (64, 256)
OUTPUT_TOKENS = (64, 128)
#: llama.cpp's context: the longest request (256 + 128 tokens, and a few of the text prompt's index) fits.
LLAMACPP_CONTEXT = 1024
#: What every request to llama.cpp's server adds: its server applies a repeat penalty of 1.1 unless a
#: request says otherwise (ours and vLLM none), which would make its greedy replay another sampler's.
LLAMACPP_BODY = {"repeat_penalty": 1.0}
PROMPT_FORM = "text"


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the recorded traffic: when it is sent (seconds from the first), its lengths."""

    offset_s: float
    prompt_tokens: int
    max_tokens: int


def plan_bursts(bursts: int, gap_s: float, seed: int = 0) -> list[PlannedRequest]:
    """``bursts`` bursts ``gap_s`` apart, each of ``BURST_SIZE`` requests sent at once, of
    ``PROMPT_TOKENS`` prompt and ``OUTPUT_TOKENS`` output tokens (inclusive ranges, drawn from ``seed``)."""
    rng = random.Random(seed)
    plan = []
    for burst in range(bursts):
        for _ in range(rng.randint(*BURST_SIZE)):
            plan.append(PlannedRequest(burst * gap_s, rng.randint(*PROMPT_TOKENS), rng.randint(*OUTPUT_TOKENS)))
    return plan


def recorded_part(workload: dict[str, Any], prefix: str = RECORD_PREFIX) -> dict[str, Any]:
    """``workload`` with only the requests whose id starts with ``prefix``, their offsets from the
    first of them (the server's warming request and any other left out)."""
    kept = [r for r in workload.get("requests") or () if str(r.get("request_id", "")).startswith(prefix)]
    if not kept:
        raise ValueError(f"the dumped workload holds no request named {prefix}*: "
                         f"{len(workload.get('requests') or ())} others")
    first = min(r["offset_s"] for r in kept)
    return {**workload, "requests": [{**r, "offset_s": r["offset_s"] - first} for r in kept]}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's runs (``Run.as_dict``) as one: every round's requests, named ``<id>#<round>`` so
    that the report pairs each with the same round's on the other target, and the durations summed
    (its throughput: all the tokens over all the time). A single run is itself."""
    if len(runs) == 1:
        return runs[0]
    out = {key: value for key, value in runs[0].items() if key != "summary"}
    out["requests"] = [{**r, "request_id": f"{r['request_id']}#{round_}"}
                       for round_, run in enumerate(runs) for r in run["requests"]]
    out["duration_s"] = sum(run["duration_s"] for run in runs)
    out["tag"] = ",".join(run["tag"] for run in runs)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="each server's compute threads (default 2)")
    parser.add_argument("--bursts", type=int, default=3, help="bursts of the recorded traffic (default 3)")
    parser.add_argument("--burst-gap", type=float, default=5.0, metavar="SECONDS",
                        help="seconds between the bursts' starts (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="the draw of the bursts' sizes and lengths")
    parser.add_argument("--speed", type=float, default=1.0, help="replay arrivals this many times faster (default 1)")
    parser.add_argument("--rounds", type=int, default=1, help="replays onto each server, alternated (default 1)")
    parser.add_argument("--max-seconds", type=float, default=300.0,
                        help="a replay sends nothing after this, and gives up on a request then (default 300)")
    parser.add_argument("--llamacpp-build", choices=["auto", *LLAMA_BUILDS], default="auto",
                        help="llama.cpp's build (auto: the default one, unless it crashes with AMX on)")
    add_results_option(parser, BENCH)
    args = parser.parse_args(argv)
    for name in ("threads", "bursts", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if not args.speed > 0 or not args.max_seconds > 0 or args.burst_gap < 0:
        parser.error("--speed and --max-seconds must be > 0, --burst-gap >= 0")
    return args


# ------------------------------------------------------------------------------ the servers


class LlamaCppUnavailable(Exception):
    """llama.cpp's side could not run; the message says why (a log's tail included)."""


def log_tail(log: Path, lines: int = 30) -> str:
    """The last ``lines`` of ``log`` (empty where there is none)."""
    try:
        return "".join(log.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


def llamacpp_server_python(choice: str) -> tuple[LlamaBuild, Path]:
    """The llama.cpp build that generates here (``working_llamacpp``) and its python, with the
    server's packages (``SERVER_REQUIREMENTS``) installed into its venv once."""
    try:
        build, ready = working_llamacpp(choice, builtin_gguf())
        print(f"llama.cpp {ready['version']} ({build.name} build: {build.flags}): {ready['system']}", flush=True)
        tool_venv(build.venv.relative_to(REPO / "var").as_posix(), SERVER_REQUIREMENTS)
    except (SystemExit, subprocess.CalledProcessError) as exc:
        # A build chosen by hand is not replaced when its probe dies (-11, SIGSEGV: AMX's on some Xeons).
        hint = "" if choice == "auto" else f" (the {choice} build, chosen by --llamacpp-build; auto falls back)"
        raise LlamaCppUnavailable(f"llama-cpp-python {LLAMA_CPP_VERSION} is not usable here{hint}: {exc}") from None
    return build, build.python


def start_llamacpp(python: Path, file: Path, threads: int, log: Path) -> tuple[subprocess.Popen, str, list[str]]:
    """llama.cpp's server on ``file`` at ``threads`` on a free loopback port, once ``/v1/models``
    answers; its process, base URL and flags. Its output goes to ``log``."""
    port = free_port()
    flags = ["--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(LLAMACPP_CONTEXT),
             "--interrupt_requests", "False"]
    command = [str(python), "-m", "llama_cpp.server", "--model", str(file), "--host", "127.0.0.1",
               "--port", str(port), *flags]
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=START_ENVIRONMENT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, base, timeout=300, path="/v1/models")
    except SystemExit as exc:
        stop(server)
        raise LlamaCppUnavailable(f"llama.cpp's server did not start ({exc}); {log}:\n{log_tail(log)}") from None
    return server, base, flags


# --------------------------------------------------------------------------------- traffic


async def record(base: str, plan: list[PlannedRequest]) -> dict[str, Any]:
    """Send ``plan`` to our server at its offsets (token-id prompts, greedy, EOS ignored) after one
    warming request, and return the bench's part of its flight recorder's workload."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        warm = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 8,
                                                          "temperature": 0},
                                 headers={"X-Request-Id": "bench-replay-warm"})
        warm.raise_for_status()
        start = time.perf_counter()

        async def one(index: int, planned: PlannedRequest) -> None:
            await asyncio.sleep(max(0.0, start + planned.offset_s - time.perf_counter()))
            body = {"model": MODEL, "prompt": prompt_for(index, planned.prompt_tokens),
                    "max_tokens": planned.max_tokens, "temperature": 0, "ignore_eos": True}
            answer = await client.post("/v1/completions", json=body,
                                       headers={"X-Request-Id": f"{RECORD_PREFIX}{index}"})
            answer.raise_for_status()

        await asyncio.gather(*(one(i, planned) for i, planned in enumerate(plan)))
        dumped = await client.post("/debug/dump_workload", json={"model": MODEL})
        dumped.raise_for_status()
    return recorded_part(dumped.json())


async def warm_up(base: str, model: str) -> None:
    """One short untimed request (a server's first pays its own costs: compiles, allocations)."""
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        answer = await client.post("/v1/completions", json={"model": model, "prompt": "The capital of France is",
                                                              "max_tokens": 8, "temperature": 0})
        answer.raise_for_status()


async def replay_onto(workload: dict[str, Any], target: Target, speed: float, max_seconds: float,
                      tag: str) -> dict[str, Any]:
    """``workload`` replayed onto ``target`` with text prompts: the run as its JSON. llama.cpp's server
    refuses an ``X-Request-Id`` that is not a UUID: only ours gets the requests' names."""
    async with httpx.AsyncClient(base_url=target.base) as client:
        run = await replay(workload, client, target.model, target.name, speed, max_seconds=max_seconds, tag=tag,
                           prompt_form=PROMPT_FORM, request_ids=target.name == "ours",
                           extra_body=target.extra_body)
    return run.as_dict()


# ------------------------------------------------------------------------------ the report


def medians(run: dict[str, Any]) -> dict[str, float | None]:
    """A run's TTFT, ITL and E2E medians (seconds) over its requests that succeeded, its output
    tokens/s and the output tokens its server counted."""
    ok = [r for r in run["requests"] if r.get("error") is None and r.get("ttft_s") is not None]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    tokens = sum(output_tokens(r) for r in ok)
    return {"TTFT": median([r["ttft_s"] for r in ok]), "ITL": median([v for r in ok for v in r.get("itl_s") or ()]),
            "E2E": median([r["e2e_s"] for r in ok if r.get("e2e_s") is not None]),
            "tokens/s": tokens / run["duration_s"] if run["duration_s"] > 0 else None,
            "tokens": tokens, "succeeded": len(ok)}


def output_tokens(request: dict[str, Any]) -> int:
    """A replayed request's output tokens: as its server counted them, else its text chunks."""
    return request.get("completion_tokens") or len(request.get("itl_s") or ()) + 1


def ended_short(run: dict[str, Any], workload: dict[str, Any]) -> int:
    """The run's requests that succeeded with fewer output tokens than recorded (a server that
    ignores ``ignore_eos`` stopped at EOS: less work than the other did)."""
    recorded = {str(r["request_id"]): r.get("completion_tokens") or 1 for r in workload["requests"]}
    return sum(1 for r in run["requests"] if r.get("error") is None and r.get("ttft_s") is not None
               and output_tokens(r) < recorded.get(r["request_id"], 0))


def print_medians(name: str, figures: dict[str, float | None], requests: int) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:,.1f} ms"

    rate = figures["tokens/s"]
    print(f"{name:<10} TTFT p50 {ms(figures['TTFT'])}, ITL p50 {ms(figures['ITL'])}, E2E p50 {ms(figures['E2E'])}; "
          f"{figures['tokens']} output tokens, {'-' if rate is None else f'{rate:,.1f}'} tokens/s; "
          f"{figures['succeeded']} of {requests} requests succeeded", flush=True)


def add_results(results: ResultsFile, server: str, figures: dict[str, Any], where: dict[str, Any]) -> None:
    for figure in ("TTFT", "ITL", "E2E"):
        if figures[figure] is not None:
            results.add(f"{figure} p50", figures[figure] * 1000, "ms", server=server, **where)
    if figures["tokens/s"] is not None:
        results.add("output tokens/s", figures["tokens/s"], "tok/s", server=server, **where)


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


# ------------------------------------------------------------------------------------ main


@dataclass
class Target:
    """A server a replay goes to: its name in the report, base URL, the model it lists, what it runs
    (the report's configuration), its process, and its log where the bench keeps one."""

    name: str
    base: str
    model: str
    config: dict[str, Any]
    process: subprocess.Popen
    log: Path | None = None
    #: Added to each request's body (``replay``'s ``extra_body``).
    extra_body: dict[str, Any] = field(default_factory=dict)

    def failure(self, what: str) -> str:
        """``what`` went wrong, with the server's exit status (None: still running) and its log's tail."""
        try:
            self.process.wait(timeout=10)  # a server that broke a connection as it died: its status
        except subprocess.TimeoutExpired:
            pass
        tail = f"; {self.log}:\n{log_tail(self.log)}" if self.log else ""
        return f"{self.name}'s server: {what}; exit status {self.process.poll()}{tail}"


def replay_rounds(targets: list[Target], workload: dict[str, Any],
                  args: argparse.Namespace, stamp: str) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
    """Each target warmed, then ``args.rounds`` replays onto each, the first one alternating: the runs
    by target, and why llama.cpp's side stopped where it did (ours failing ends the bench)."""
    runs: dict[str, list[dict[str, Any]]] = {target.name: [] for target in targets}
    error = None
    live = []
    for target in targets:
        try:
            asyncio.run(warm_up(target.base, target.model))
            live.append(target)
        except httpx.HTTPError as exc:
            if target.name == "ours":
                raise
            error = target.failure(f"its first request failed ({type(exc).__name__}: {exc})")
            print(error, flush=True)
    for round_ in range(args.rounds):
        for target in (live if round_ % 2 == 0 else live[::-1]):
            tag = f"{stamp}-{'ours' if target.name == 'ours' else 'llamacpp'}-{round_}"
            run = asyncio.run(replay_onto(workload, target, args.speed, args.max_seconds, tag))
            run["target_config"] = target.config
            runs[target.name].append(run)
            failed = sum(r["error"] is not None for r in run["requests"])
            short = ended_short(run, workload)
            rate = medians(run)["tokens/s"] or 0.0
            print(f"round {round_ + 1}: {target.name} in {run['duration_s']:.1f} s, {rate:,.1f} output tokens/s"
                  f"{f', {failed} request(s) failed' if failed else ''}"
                  f"{f', {short} ended before their recorded length' if short else ''}", flush=True)
        for target in [t for t in live if t.name != "ours" and t.process.poll() is not None]:
            error = target.failure("it exited during the replay")
            print(error, flush=True)
            live.remove(target)
    return runs, error


def report(runs: dict[str, list[dict[str, Any]]], folder: Path, results: ResultsFile, where: dict[str, Any]) -> None:
    """Each target's rounds pooled, saved and summed up (medians, throughput: printed and to the
    results file), and where both ran, the regression report of llama.cpp's (B) against ours (A)."""
    pools = {name: pooled(done) for name, done in runs.items() if done}
    figures = {name: medians(run) for name, run in pools.items()}
    print()
    for name, run in pools.items():
        write_json(folder / ("ours.json" if name == "ours" else "llamacpp.json"), run)
        print_medians(name, figures[name], len(run["requests"]))
        add_results(results, name, figures[name], where)
    if "llama.cpp" not in pools:
        return
    compared = compare_runs(pools["ours"], pools["llama.cpp"])
    write_json(folder / "report.json", compared)
    (folder / "report.md").write_text(markdown(compared))
    print(f"\n{markdown(compared)}")
    a, b = figures["ours"]["tokens/s"], figures["llama.cpp"]["tokens/s"]
    if a and b:
        print(f"ours/llama.cpp output tokens/s: {a / b:.2f}")
        results.add("ours/llama.cpp output tokens/s", a / b, "ratio", **where)
    if compared["outputs_compared"]:
        results.add("outputs identical", compared["outputs_identical"] / compared["outputs_compared"], "fraction",
                    **where)


def main() -> None:
    args = parse_args()
    machine = this_machine()
    plan = plan_bursts(args.bursts, args.burst_gap, args.seed)
    print(f"replay: ours vs llama.cpp's server (llama-cpp-python {LLAMA_CPP_VERSION}) on {MODEL}; {machine['cpu']}, "
          f"{machine['vector_width']}-bit vectors, {machine['cores']} cores; {args.threads} thread(s) each; "
          f"{args.bursts} burst(s), {len(plan)} requests; speed {args.speed:g}; {args.rounds} round(s)", flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    folder = OUT / stamp
    folder.mkdir(parents=True, exist_ok=True)

    build: LlamaBuild = LLAMA_BUILDS.get(args.llamacpp_build, DEFAULT_BUILD)
    llama_error: str | None = None
    try:
        build, llama_python = llamacpp_server_python(args.llamacpp_build)
    except LlamaCppUnavailable as exc:
        llama_error = str(exc)
        print(f"llama.cpp's side will not run: {exc}", flush=True)

    serve = ["--model", MODEL, "--enable-debug", "--enable-tracing", "--backend", "cpu", "--weights-dtype", "gguf"]
    targets: list[Target] = []
    try:
        # A first start at these sources compiles every kernel: minutes on a busy 2-core machine.
        ours, ours_base = launch(serve, folder / "var", env={name: str(args.threads) for name in THREAD_VARIABLES},
                                 timeout=900)
        targets.append(Target("ours", ours_base, MODEL, {"kind": "ours", "version": current_commit(),
                                                         "flags": " ".join(serve), "threads": args.threads}, ours))
        if llama_error is None:
            log = folder / "llamacpp-server.log"
            try:
                llama, llama_base, flags = start_llamacpp(llama_python, builtin_gguf(), args.threads, log)
            except LlamaCppUnavailable as exc:
                llama_error = str(exc)
                print(exc, flush=True)
            else:
                listed = httpx.get(f"{llama_base}/v1/models", timeout=30).json()["data"][0]["id"]
                version = f"llama-cpp-python {LLAMA_CPP_VERSION} ({build.name} build: {build.flags})"
                targets.append(Target("llama.cpp", llama_base, listed, {
                    "kind": "llama.cpp", "version": version, "flags": " ".join(flags), "threads": args.threads,
                    "request_body": LLAMACPP_BODY}, llama, log, LLAMACPP_BODY))

        workload = asyncio.run(record(ours_base, plan))
        write_json(folder / "workload.json", workload)
        print(f"recorded {len(workload['requests'])} requests on ours over "
              f"{max(r['offset_s'] for r in workload['requests']):.1f} s: {folder / 'workload.json'}", flush=True)
        runs, replay_error = replay_rounds(targets, workload, args, stamp)
        llama_error = llama_error or replay_error
    finally:
        for target in targets:
            stop(target.process)

    where = {"threads": args.threads, "bursts": args.bursts, "requests": len(workload["requests"]),
             "speed": args.speed, "rounds": args.rounds, "prompt_form": PROMPT_FORM, **build_param(build)}
    report(runs, folder, ResultsFile(args.results, BENCH), where)
    print(f"files: {folder}", flush=True)
    if llama_error is not None:
        raise SystemExit(f"llama.cpp's side did not run to the end: {llama_error}")


if __name__ == "__main__":
    main()
