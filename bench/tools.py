"""The tools operators already point at servers, pointed at ours (issue 60): aiperf, guidellm and
lm-evaluation-harness, each as its users run it, with a few requests.

``manage.py serve --model MODEL`` (smollm2 by default) on a free port; the tools from
``bench/requirements-tools.txt`` in a virtualenv of their own, ``var/bench-tools-venv`` (made the
first time: the CPU build of torch 2.13.0 first, then the pinned tools; never the project's
``.venv``); a Hugging Face tokenizer folder made from the model's own tokenizer (offline: the tools
are told ``HF_HUB_OFFLINE=1``). Then, one after the other:

- aiperf: ``aiperf profile`` streaming chat at ``--concurrency``, ``--requests`` requests of 64
  prompt tokens and 16 output tokens; its ``profile_export_aiperf.json`` read back;
- guidellm: ``guidellm run`` at a synchronous rate, the same request shape; its
  ``benchmarks.json`` read back;
- lm-eval: ``lm_eval --model local-completions`` over a multiple-choice task whose data the bench
  writes (``MC_ITEMS``: a handful of questions, four answers each), scored by loglikelihood (each
  answer's tokens' logprobs, from ``echo`` with ``max_tokens: 0``, ``--batch_size 2``: lists of
  prompts); its ``results_*.json`` read back, and each item's pick checked against the same
  loglikelihoods asked of the server directly.

Each tool must exit 0, its own summary must parse, and the server's ``request_success_total`` must
have counted the requests the tool says it made. Every figure goes to ``bench/results/tools.jsonl``.

    .venv/bin/python bench/tools.py
    .venv/bin/python bench/tools.py --model demo --requests 4 --only aiperf
    .venv/bin/python bench/tools.py --write-tokenizer var/tokenizer --write-task var/lm-eval-task  # for a hand run

Exit status 1 when a tool failed or a check disagreed.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from results_file import ResultsFile, add_results_option  # bench/ is the script's folder, first on sys.path
from servers import launch
from tool_env import tool_venv, write_tokenizer

REPO = Path(__file__).resolve().parents[1]
REQUIREMENTS = REPO / "bench" / "requirements-tools.txt"
#: Installed alone, first: the CPU build on this machine's disk (pip's find-links), not a CUDA one.
TORCH = "torch==2.13.0"
VERSIONS = {"aiperf": "0.13.0", "guidellm": "0.8.1", "lm-eval": "0.4.13"}
TOOLS = ("aiperf", "guidellm", "lm-eval")
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 16

#: The lm-eval task's data: (question, four answers, the right one's index).
MC_ITEMS = (
    ("What is the capital of France?", ("Paris", "Berlin", "Madrid", "Rome"), 0),
    ("How many legs does a spider have?", ("Six", "Four", "Eight", "Ten"), 2),
    ("Which planet is known as the Red Planet?", ("Venus", "Mars", "Jupiter", "Saturn"), 1),
    ("What do bees make?", ("Milk", "Silk", "Wax paper", "Honey"), 3),
    ("What is frozen water called?", ("Ice", "Steam", "Sand", "Glass"), 0),
    ("Which animal is known as the king of the jungle?", ("The mouse", "The lion", "The cow", "The fish"), 1),
    ("What color is the sky on a clear day?", ("Green", "Red", "Blue", "Black"), 2),
    ("How many days are there in a week?", ("Five", "Ten", "Three", "Seven"), 3),
)
TASK = "bench_tools_mc"


@dataclass
class ToolRun:
    """One tool's run: its command as run, exit status, the figures read from its own summary."""

    tool: str
    command: list[str]
    returncode: int | None = None
    wall_s: float = 0.0
    figures: dict[str, tuple[float, str]] = field(default_factory=dict)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    error: str | None = None
    output_tail: str = ""

    @property
    def ok(self) -> bool:
        return (self.error is None and self.returncode == 0 and bool(self.figures)
                and all(ok for _, ok, _ in self.checks))

    def shown_command(self, base: str, replacements: dict[str, str]) -> str:
        text = shlex.join(self.command).replace(base, "http://127.0.0.1:8000")
        for path, name in replacements.items():
            text = text.replace(path, name)
        return text


def tool_env(offline: bool) -> dict[str, str]:
    """The tools' environment: no telemetry, no API key of ours, and with ``offline`` no hub (aiperf
    0.13.0 is run without: told ``HF_HUB_OFFLINE``, it looks a tokenizer folder's path up as a hub
    snapshot and fails, "Repo id must be in the form 'repo_name'"; given the folder it never asks)."""
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "VIRTUAL_ENV", "PYTHONPATH")}
    env.update(TOKENIZERS_PARALLELISM="false", DO_NOT_TRACK="1", OPENAI_API_KEY="unused",
               HF_HOME=str(REPO / "var" / "bench-tools-hf"))
    if offline:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def execute(run: ToolRun, cwd: Path, out: Path, report: str, offline: bool = True) -> dict | None:
    """Run the tool, then read the first file under ``out`` named like ``report`` (its own summary),
    or note why there is none."""
    _run_tool(run, cwd, timeout=900, offline=offline)
    found = sorted(out.rglob(report))
    if not found:
        run.error = run.error or f"no {report} under its output folder"
        return None
    return json.loads(found[0].read_text())


def _run_tool(run: ToolRun, cwd: Path, timeout: float, offline: bool) -> None:
    began = time.perf_counter()
    try:
        done = subprocess.run(run.command, cwd=cwd, env=tool_env(offline), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        run.error = f"timed out after {timeout:.0f} s"
        run.output_tail = str(e.stdout or "")[-3000:]
        return
    run.wall_s = time.perf_counter() - began
    run.returncode = done.returncode
    run.output_tail = (done.stdout + done.stderr)[-4000:]
    if done.returncode != 0:
        run.error = f"exit status {done.returncode}"


def served_requests(base: str, model: str) -> float:
    """The server's ``request_success_total`` for ``model`` (whatever its metrics prefix)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name.endswith("request_success_total") and sample.labels.get("model") == model)


def run_aiperf(venv: Path, base: str, model: str, tokenizer: Path, work: Path, concurrency: int,
               requests: int) -> ToolRun:
    out = work / "aiperf"
    run = ToolRun("aiperf", [
        str(venv / "bin" / "aiperf"), "profile", "--model", model, "--url", base, "--endpoint-type", "chat",
        "--streaming", "--tokenizer", str(tokenizer), "--concurrency", str(concurrency),
        "--request-count", str(requests), "--prompt-input-tokens-mean", str(PROMPT_TOKENS),
        "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(OUTPUT_TOKENS),
        "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
        "--ui", "none", "--workers-max", "1", "--record-processor-service-count", "1", "--artifact-dir", str(out)])
    report = execute(run, work, out, "profile_export_aiperf.json", offline=False)
    if report is None:
        return run
    for name, key in (("ttft mean", "time_to_first_token"), ("ttft p99", "time_to_first_token"),
                      ("itl mean", "inter_token_latency"), ("request latency mean", "request_latency")):
        stat = "p99" if name.endswith("p99") else "avg"
        value = (report.get(key) or {}).get(stat)
        if value is not None:
            run.figures[name] = (float(value), "ms")
    for name, key, unit in (("output tokens/s", "output_token_throughput", "tok/s"),
                            ("requests/s", "request_throughput", "req/s"),
                            ("requests", "request_count", "count"),
                            ("output tokens per request", "output_sequence_length", "tokens")):
        value = (report.get(key) or {}).get("avg")
        if value is not None:
            run.figures[name] = (float(value), unit)
    return run


def run_guidellm(venv: Path, base: str, model: str, tokenizer: Path, work: Path, requests: int) -> ToolRun:
    out = work / "guidellm"
    out.mkdir(parents=True, exist_ok=True)
    run = ToolRun("guidellm", [
        str(venv / "bin" / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={base},model={model}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--output", f"kind=json,path={out / 'benchmarks.json'}", "--output", "kind=console",
        "--disable-progress"])
    report = execute(run, work, out, "benchmarks.json")
    if report is None:
        return run
    benchmark = report["benchmarks"][0]
    metrics = benchmark["metrics"]

    def stat(key: str, name: str = "mean") -> float | None:
        value = (metrics.get(key) or {}).get("successful", {}).get(name)
        return None if value is None else float(value)

    for name, key, which, unit in (("ttft mean", "time_to_first_token_ms", "mean", "ms"),
                                   ("ttft p99", "time_to_first_token_ms", "percentiles", "ms"),
                                   ("itl mean", "inter_token_latency_ms", "mean", "ms"),
                                   ("request latency mean", "request_latency", "mean", "s"),
                                   ("output tokens/s", "output_tokens_per_second", "mean", "tok/s"),
                                   ("requests/s", "requests_per_second", "mean", "req/s"),
                                   ("output tokens per request", "output_token_count", "mean", "tokens")):
        if which == "percentiles":
            value = ((metrics.get(key) or {}).get("successful", {}).get("percentiles") or {}).get("p99")
            value = None if value is None else float(value)
        else:
            value = stat(key, which)
        if value is not None:
            run.figures[name] = (value, unit)
    totals = metrics.get("request_totals") or benchmark.get("request_totals") or {}
    if "successful" in totals:
        run.figures["requests"] = (float(totals["successful"]), "count")
        run.checks.append(("no request errored", not totals.get("errored"), f"{totals.get('errored', 0)} errored"))
    return run


def write_task(folder: Path) -> Path:
    """The multiple-choice task's data (JSON lines) and its lm-eval YAML, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": list(c), "answer": a}) + "\n"
                            for q, c, a in MC_ITEMS))
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    return folder


def direct_picks(base: str, model: str) -> list[int]:
    """Each item's answer with the highest summed logprob, asked of the server directly (echo with
    ``max_tokens: 0``: lm-eval's acc). As lm-eval splits them: context and context + answer tokenized
    (by the server's ``/tokenize``, no special tokens, as lm-eval's API models), the answer's tokens
    those past the context's count, the whole sent as a token list."""
    picks = []
    with httpx.Client(base_url=base, timeout=120) as http:
        def tokens(text: str) -> list[int]:
            reply = http.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
            reply.raise_for_status()
            return reply.json()["tokens"]

        for question, choices, _ in MC_ITEMS:
            context = f"Question: {question}\nAnswer:"
            known = len(tokens(context))
            scores = []
            for choice in choices:
                reply = http.post("/v1/completions", json={
                    "model": model, "prompt": tokens(f"{context} {choice}"), "max_tokens": 0, "echo": True,
                    "logprobs": 1, "temperature": 0})
                reply.raise_for_status()
                logprobs = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
                scores.append(sum(logprobs[known:]))
            picks.append(max(range(len(scores)), key=scores.__getitem__))
    return picks


def run_lm_eval(venv: Path, base: str, model: str, tokenizer: Path, work: Path) -> ToolRun:
    task_dir = write_task(work / "lm-eval-task")
    before = served_requests(base, model)
    out = work / "lm-eval"
    model_args = ",".join([f"model={model}", f"base_url={base}/v1/completions", f"tokenizer={tokenizer}",
                           "tokenizer_backend=huggingface", "num_concurrent=1", "max_retries=1"])
    run = ToolRun("lm-eval", [
        str(venv / "bin" / "lm_eval"), "--model", "local-completions", "--model_args", model_args,
        "--tasks", TASK, "--include_path", str(task_dir), "--batch_size", "2", "--output_path", str(out),
        "--log_samples"])
    report = execute(run, work, out, "results_*.json")
    if report is None:
        return run
    scores = report["results"][TASK]
    for name in ("acc", "acc_norm"):
        if f"{name},none" in scores:
            run.figures[name] = (float(scores[f"{name},none"]), "ratio")
    run.figures["items"] = (float(len(MC_ITEMS)), "count")
    served = served_requests(base, model) - before
    loglikelihoods = sum(len(choices) for _, choices, _ in MC_ITEMS)
    run.checks.append(("the server answered each loglikelihood request", served == loglikelihoods,
                       f"{loglikelihoods} asked, server {served:.0f}"))
    samples = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))
    if samples:
        rows = sorted((json.loads(line) for line in samples[0].read_text().splitlines()), key=lambda r: r["doc_id"])
        theirs = [max(range(len(r["filtered_resps"])), key=lambda i: float(r["filtered_resps"][i][0])) for r in rows]
        ours = direct_picks(base, model)
        run.checks.append(("lm-eval's picks = the server's echo logprobs' picks", theirs == ours,
                           f"lm-eval {theirs}, direct {ours}"))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a built-in model (default smollm2)")
    parser.add_argument("--concurrency", type=int, default=2, help="aiperf's concurrency (default 2)")
    parser.add_argument("--requests", type=int, default=8, help="requests for aiperf and guidellm (default 8)")
    parser.add_argument("--only", choices=TOOLS, action="append", help="run only this tool (repeatable)")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more argument for manage.py serve")
    parser.add_argument("--write-tokenizer", type=Path, metavar="FOLDER",
                        help="only write the model's tokenizer folder, as the tools are given it, and exit")
    parser.add_argument("--write-task", type=Path, metavar="FOLDER",
                        help=f"only write the lm-eval task {TASK} (its data and YAML) for --include_path, and exit")
    add_results_option(parser, "tools")
    args = parser.parse_args()
    if args.write_tokenizer or args.write_task:
        if args.write_tokenizer:
            print(write_tokenizer(args.model, args.write_tokenizer))
        if args.write_task:
            print(write_task(args.write_task.resolve()))
        return
    tools = args.only or list(TOOLS)

    venv = tool_venv("bench-tools-venv", REQUIREMENTS, first=(TORCH,))
    runs: list[ToolRun] = []
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        tokenizer = write_tokenizer(args.model, work / "tokenizer")
        server, base = launch(["--model", args.model, *args.serve_arg], work / "var")
        try:
            model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
            for tool in tools:
                print(f"== {tool} {VERSIONS[tool]}", flush=True)
                before = served_requests(base, model)
                if tool == "aiperf":
                    run = run_aiperf(venv, base, model, tokenizer, work, args.concurrency, args.requests)
                elif tool == "guidellm":
                    run = run_guidellm(venv, base, model, tokenizer, work, args.requests)
                else:
                    run = run_lm_eval(venv, base, model, tokenizer, work)
                served = served_requests(base, model) - before
                if tool != "lm-eval" and "requests" in run.figures:
                    made = run.figures["requests"][0]
                    run.checks.append(("the server counted the tool's requests", served == made,
                                       f"tool {made:.0f}, server {served:.0f}"))
                    if "output tokens per request" in run.figures:
                        held = run.figures["output tokens per request"][0]
                        run.checks.append(("ignore_eos held the requested output length", held == OUTPUT_TOKENS,
                                           f"{held:g} of {OUTPUT_TOKENS} tokens a request"))
                if tool != "lm-eval":
                    run.figures["server requests"] = (served, "count")
                runs.append(run)
                shown = {f"{venv}/bin/": "", str(tokenizer): "TOKENIZER", str(work): "OUT"}
                print(f"   {run.shown_command(base, shown)}")
                print(f"   exit {run.returncode} in {run.wall_s:.1f} s" + (f": {run.error}" if run.error else ""))
                for name, (value, unit) in run.figures.items():
                    print(f"   {name:<28} {value:>10.4g} {unit}")
                for name, ok, detail in run.checks:
                    print(f"   {'ok' if ok else 'FAILED'}: {name} ({detail})")
                if not run.ok:
                    tail = "\n".join("     " + line for line in run.output_tail.splitlines())
                    print("   its output's tail:\n" + tail)
        finally:
            server.terminate()
            server.wait(30)
    results = ResultsFile(args.results, "tools")
    for run in runs:
        if not run.ok:
            continue
        for name, (value, unit) in run.figures.items():
            results.add(name, value, unit, tool=run.tool, version=VERSIONS[run.tool], model=args.model,
                        requests=args.requests if run.tool != "lm-eval" else len(MC_ITEMS),
                        concurrency=args.concurrency if run.tool == "aiperf" else 1)
    ok = all(run.ok for run in runs)
    print("every tool ran and agreed" if ok else "SOME TOOL FAILED: " + ", ".join(r.tool for r in runs if not r.ok))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
