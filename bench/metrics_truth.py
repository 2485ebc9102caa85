"""Do the server's numbers agree with what its clients measure? (issue 58, docs/metrics.md)

``manage.py serve`` with debug and tracing on; closed-loop streaming chat clients (httpx) at each
concurrency, sending mixed prompt lengths (short chats and long documents, so short requests wait
behind long prefills) and mixed output lengths (``max_tokens``, or the model's own end: not
``ignore_eos``, which makes a model write its end-of-turn token, whose text is empty, and the
special tokens after it, so that a client sees its first text a step after the first token). Each
client measures what aiperf and guidellm measure, on its own clock:

- TTFT: from sending the request to the first chunk that carries output text (against ``/metrics``,
  whose histogram counts every request that got a token, a request the model ended at once, with no
  text, is timed at its one chunk);
- E2E: from sending it to the end of the stream (``[DONE]``);
- ITL: (E2E - TTFT) / (output tokens - 1), the output tokens as the usage chunk counts them.

The same requests as the server tells them: each request's ``usage.extra`` (``ttft_s``,
``end_to_end_latency_s``, ``inter_token_latency_standard_s``), the ``/metrics`` histograms' and
counters' deltas over the run (means from ``_sum`` / ``_count``), the request summaries the
history makes of the run's trace (``engines.history.analysis``), and, over the whole run, the
fleet's minute rollups in the server's database (TTFT: their count against every level's, their
mean from their sums against the clients', their p90 bucket against the clients' p90). Means and
p90 must agree within 5 % or 20 ms, token counts exactly; ``--aiperf`` runs aiperf 0.13
(``bench/requirements-truth.txt``, in ``var/truth-venv``) at each concurrency too and holds the
server's ``/metrics`` to its figures.

    python bench/metrics_truth.py                          # smollm2, concurrency 1 4 16
    python bench/metrics_truth.py --model demo --concurrency 4 --requests 16 --json report.json
    python bench/metrics_truth.py --aiperf

Exit status 1 when a figure disagrees (the CI test's small run: tests/server/test_metrics_truth.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import django
import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families
from results_file import ResultsFile, add_results_option  # bench/ is the script's folder, first on sys.path
from servers import launch
from tool_env import tool_venv, write_tokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "debugsite.settings")
django.setup()  # the history's analysis lives in a Django app's package

from engines.history.analysis import analyze_trace  # noqa: E402  (after Django is set up)
from engines.prometheus_names import our_prefix  # noqa: E402

#: A figure agrees when the server's is within this share of the client's, or within ABS_TOLERANCE_S.
REL_TOLERANCE = 0.05
ABS_TOLERANCE_S = 0.020
#: The fleet's rollup sampler's period (engines.fleet.rollups.SAMPLE_S).
ROLLUP_SAMPLE_S = 5.0
#: Words of the prompts: a short chat, a paragraph, a long document (their token counts vary by model).
PROMPT_WORDS = (8, 120, 700)
OUTPUT_TOKENS = (8, 24, 48)


@dataclass
class ClientRecord:
    """One request as its client saw it (seconds on the client's monotonic clock)."""

    request_id: str
    prompt_words: int
    max_tokens: int
    sent: float
    first: float | None = None        # the first chunk with output text
    first_chunk: float | None = None  # the first chunk with a choice (text, or the finish of a token-less end)
    end: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def ttft_any_chunk(self) -> float | None:
        """TTFT to the first chunk with a choice: /metrics' rule, which times every request that got
        a token (a request its first token ended, with no text, at its one chunk)."""
        if self.error is not None or self.output_tokens < 1 or self.first_chunk is None:
            return None
        return self.first_chunk - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    @property
    def output_tokens(self) -> int:
        return int(self.usage.get("completion_tokens", 0))

    @property
    def itl(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def prompt_text(words: int, rng: random.Random) -> str:
    vocabulary = ("river", "market", "engine", "winter", "garden", "signal", "copper", "harbor", "lantern",
                  "meadow", "ledger", "orbit", "canvas", "thunder", "pebble", "violin")
    return " ".join(rng.choice(vocabulary) for _ in range(words))


async def one_request(http: httpx.AsyncClient, model: str, record: ClientRecord, text: str) -> None:
    """Stream one chat completion, noting the client's moments and the usage chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": record.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "user": record.request_id}
    record.sent = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                record.end = time.perf_counter()
                break
            chunk = orjson.loads(data)
            if record.first_chunk is None and chunk.get("choices"):
                record.first_chunk = time.perf_counter()
            if record.first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                record.first = time.perf_counter()
            if chunk.get("usage"):
                record.usage = chunk["usage"]


async def drive(base: str, model: str, concurrency: int, requests: int, seed: int,
                prompt_words: tuple[int, ...] = PROMPT_WORDS,
                output_tokens: tuple[int, ...] = OUTPUT_TOKENS) -> list[ClientRecord]:
    """``requests`` streaming requests from ``concurrency`` closed-loop clients."""
    rng = random.Random(seed)
    plan = [(rng.choice(prompt_words), rng.choice(output_tokens)) for _ in range(requests)]
    texts = [prompt_text(words, rng) for words, _ in plan]
    records: list[ClientRecord] = []
    queue = list(range(requests))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop(0)
            words, max_tokens = plan[i]
            record = ClientRecord(f"truth-c{concurrency}-{seed}-{i}", words, max_tokens, 0.0)
            records.append(record)
            await one_request(http, model, record, texts[i])

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        # Connected before the clock starts for anyone: a TCP handshake is not the server's time.
        await asyncio.gather(*(http.get("/health") for _ in range(concurrency)))
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return records


def scrape(base: str, model: str) -> dict[str, float]:
    """The ``/metrics`` samples of one engine, by sample name after the server's prefix (histogram
    ``_sum``/``_count`` included)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    prefix = our_prefix({sample.name for sample in samples})
    if prefix is None:
        raise SystemExit(f"{base}/metrics is not this server's exposition")
    return {sample.name.removeprefix(prefix): sample.value for sample in samples
            if sample.labels.get("model") == model and "le" not in sample.labels}


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


@dataclass
class Comparison:
    """One figure, the client's and the server's, and whether they agree."""

    figure: str
    source: str
    client: float
    server: float
    exact: bool = False
    #: A figure known to its histogram bucket: it agrees when the client's lies in ``[low, high]``.
    bucket: tuple[float, float] | None = None

    @property
    def ok(self) -> bool:
        if self.exact:
            return self.client == self.server
        if self.bucket is not None:
            return self.bucket[0] <= self.client <= self.bucket[1]
        return abs(self.server - self.client) <= max(REL_TOLERANCE * abs(self.client), ABS_TOLERANCE_S)

    def row(self) -> str:
        mark = "ok" if self.ok else "DISAGREES"
        if self.exact:
            return (f"  {self.figure:<28} {self.source:<18} client {self.client:>10.0f}  "
                    f"server {self.server:>10.0f}  {mark}")
        ratio = self.server / self.client if self.client else float("nan")
        known = (f"  bucket {self.bucket[0] * 1000:.0f}-{self.bucket[1] * 1000:.0f} ms" if self.bucket is not None
                 else f"  ({ratio:.3f})")
        return (f"  {self.figure:<28} {self.source:<18} client {self.client * 1000:>9.1f} ms  "
                f"server {self.server * 1000:>9.1f} ms{known}  {mark}")


def compare(records: list[ClientRecord], before: dict[str, float], after: dict[str, float],
            summaries: dict[str, Any]) -> list[Comparison]:
    """Every figure the client measured against the server's, per source."""
    done = [r for r in records if r.error is None and r.e2e is not None]
    # A request whose first token ended it (the model's end of turn) shows no text: no client TTFT.
    timed = [r for r in done if r.ttft is not None]
    out: list[Comparison] = []

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    per_request = {
        "ttft": ([r.ttft for r in timed], [r.usage["extra"]["ttft_s"] for r in timed]),
        "e2e": ([r.e2e for r in done], [r.usage["extra"]["end_to_end_latency_s"] for r in done]),
        "itl": ([r.itl for r in done if r.itl is not None],
                [r.usage["extra"]["inter_token_latency_standard_s"] for r in done if r.itl is not None]),
    }
    for name, (client, server) in per_request.items():
        out.append(Comparison(f"{name} mean", "usage.extra", statistics.fmean(client), statistics.fmean(server)))
        out.append(Comparison(f"{name} p90", "usage.extra", p90(client), p90(server)))
    families = {"ttft": "time_to_first_token_seconds", "e2e": "e2e_request_latency_seconds",
                "itl": "request_time_per_output_token_seconds"}
    # The server observes a TTFT for every request that got a token, an ITL for those that got two.
    expected = {"ttft": sum(r.output_tokens >= 1 for r in done), "e2e": len(done),
                "itl": sum(r.output_tokens >= 2 for r in done)}
    for name, family in families.items():
        count = delta(f"{family}_count")
        client = per_request[name][0]
        if name == "ttft":  # every request with a token, a token-less end (its end of turn) timed at its chunk
            client = [t for r in done if (t := r.ttft_any_chunk) is not None]
        out.append(Comparison(f"{name} count", "/metrics", expected[name], count, exact=True))
        if count and count == len(client):  # the same requests on both sides
            out.append(Comparison(f"{name} mean", "/metrics", statistics.fmean(client), delta(f"{family}_sum") / count))
    out.append(Comparison("generation tokens", "/metrics", sum(r.output_tokens for r in done),
                          delta("generation_tokens_total"), exact=True))
    out.append(Comparison("prompt tokens", "/metrics", sum(int(r.usage.get("prompt_tokens", 0)) for r in done),
                          delta("prompt_tokens_total"), exact=True))
    out.append(Comparison("requests", "/metrics", len(done), delta("request_success_total"), exact=True))
    traced = [(r, summaries[r.request_id]) for r in done if r.request_id in summaries]
    out.append(Comparison("requests", "trace summaries", len(done), len(traced), exact=True))
    if traced:
        for name, key in (("ttft", "ttft_us"), ("e2e", "e2e_us")):
            pairs = [(getattr(r, name), getattr(s, key)) for r, s in traced]
            client = [c for c, v in pairs if c is not None and v is not None]
            server = [v / 1e6 for c, v in pairs if c is not None and v is not None]
            out.append(Comparison(f"{name} mean", "trace summaries", statistics.fmean(client),
                                  statistics.fmean(server)))
            out.append(Comparison(f"{name} p90", "trace summaries", p90(client), p90(server)))
    return out


def run_level(base: str, model: str, concurrency: int, requests: int, seed: int,
              prompt_words: tuple[int, ...], output_tokens: tuple[int, ...]) -> dict[str, Any]:
    """One concurrency level: reset, drive, read the server's side, compare."""
    # The rollups count what the engine's histograms gained between their samples: one more sample
    # before the reset, or the last level's last observations are lost to them.
    time.sleep(ROLLUP_SAMPLE_S + 1.0)
    httpx.post(f"{base}/debug/reset_engine", json={"model": model, "clear_trace": True}, timeout=60).raise_for_status()
    before = scrape(base, model)
    began = time.perf_counter()
    records = asyncio.run(drive(base, model, concurrency, requests, seed, prompt_words, output_tokens))
    wall = time.perf_counter() - began
    after = scrape(base, model)
    trace = httpx.post(f"{base}/debug/dump_event_trace", json={"model": model}, timeout=120).json()
    summaries = {r.request_id: r for r in analyze_trace(trace).requests}
    comparisons = compare(records, before, after, summaries)
    errors = [r.error for r in records if r.error]
    per_request = [{"request_id": r.request_id, "prompt_tokens": r.usage.get("prompt_tokens"),
                    "completion_tokens": r.output_tokens, "client_ttft_s": r.ttft, "client_e2e_s": r.e2e,
                    "server": {k: r.usage.get("extra", {}).get(k) for k in ("ttft_s", "queue_time_s",
                                                                           "end_to_end_latency_s")}}
                   for r in records]
    ttft_count = after.get("time_to_first_token_seconds_count", 0) - before.get("time_to_first_token_seconds_count", 0)
    client_ttfts = [t for r in records if (t := r.ttft_any_chunk) is not None]
    return {"concurrency": concurrency, "requests": requests, "wall_s": wall, "errors": errors,
            "per_request": per_request, "ttft_count": ttft_count,
            "client_ttfts": client_ttfts, "comparisons": [{**asdict(c), "ok": c.ok} for c in comparisons],
            "ok": not errors and all(c.ok for c in comparisons)}


def run_aiperf(base: str, model: str, concurrency: int, requests: int, tokenizer: Path, venv: Path) -> dict[str, Any]:
    """aiperf's figures at one concurrency and the server's /metrics deltas over its run."""
    before = scrape(base, model)
    with tempfile.TemporaryDirectory() as out:
        cmd = [str(venv / "bin" / "aiperf"), "profile", "--model", model, "--url", base, "--endpoint-type", "chat",
               "--streaming", "--tokenizer", str(tokenizer), "--concurrency", str(concurrency),
               "--request-count", str(requests), "--prompt-input-tokens-mean", "64",
               "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", "24",
               "--prompt-output-tokens-stddev", "0", "--use-server-token-count", "--ui", "none", "--workers-max", "1",
               "--record-processor-service-count", "1", "--artifact-dir", out]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        exports = sorted(Path(out).rglob("profile_export_aiperf.json"))
        if run.returncode != 0 or not exports:
            return {"concurrency": concurrency, "ok": False, "error": (run.stdout + run.stderr)[-2000:]}
        report = json.loads(exports[0].read_text())
    after = scrape(base, model)
    comparisons, notes = [], []
    for name, key, family in (("ttft", "time_to_first_token", "time_to_first_token_seconds"),
                              ("e2e", "request_latency", "e2e_request_latency_seconds")):
        figure = report.get(key) or {}
        count = after.get(f"{family}_count", 0) - before.get(f"{family}_count", 0)
        if figure.get("avg") is None or not count:
            continue
        timed = figure.get("count")
        if timed is not None and timed != count:
            # aiperf times a request from its first text: one whose first token ended it has none.
            notes.append(f"{name}: aiperf timed {timed} requests, the server {count:.0f}: means not compared")
            continue
        server = (after[f"{family}_sum"] - before.get(f"{family}_sum", 0.0)) / count
        comparisons.append(Comparison(f"{name} mean", "aiperf vs /metrics", figure["avg"] / 1000, server))
    return {"concurrency": concurrency, "requests": requests, "notes": notes,
            "comparisons": [{**asdict(c), "ok": c.ok} for c in comparisons],
            "ok": bool(comparisons) and all(c.ok for c in comparisons)}


def rollup_comparisons(var_dir: Path, model: str, levels: list[dict[str, Any]]) -> list[Comparison]:
    """The fleet's minute rollups of the whole run (the server's own database) against the levels:
    TTFT count (exact), mean (from the rollups' sums) and p90 (the bucket it falls in)."""
    from engines.fleet.quantiles import bucket_quantile
    from engines.fleet.rollups import sum_histograms
    from engines.fleet.rows import WindowHistogram

    # A minute is written at the first sample of the next: wait for the one after the run.
    now = time.time()
    time.sleep(60 - now % 60 + ROLLUP_SAMPLE_S + 2.0)
    with sqlite3.connect(var_dir / "db.sqlite3") as db:
        stored = [json.loads(row[0]) for row in db.execute(
            "SELECT ttft FROM engines_fleetrollup WHERE period = 'minute' AND engine = ? AND ttft IS NOT NULL",
            (model,))]
    parts = [WindowHistogram(**h) for h in stored]
    summed = sum_histograms(p.buckets() for p in parts)
    count = sum(level["ttft_count"] for level in levels)
    clients = [t for level in levels for t in level["client_ttfts"]]
    out = [Comparison("ttft count", "rollups", count, summed[0][-1][1] if summed else 0.0, exact=True)]
    sums = [p.sum for p in parts]
    known_sums = [s for s in sums if s is not None]
    if summed and len(known_sums) == len(sums) and len(clients) == count:
        out.append(Comparison("ttft mean", "rollups", statistics.fmean(clients), sum(known_sums) / summed[0][-1][1]))
    if len(summed) == 1 and clients:
        # The rollups know the p90 to its bucket: the clients' p90 must fall in that bucket.
        buckets = summed[0]
        estimate = bucket_quantile(0.9, buckets) or 0.0
        low = max((b for b, _ in buckets if b < estimate), default=0.0)
        high = min((b for b, _ in buckets if b >= estimate), default=float("inf"))
        out.append(Comparison("ttft p90", "rollups", p90(clients), estimate, bucket=(low, high)))
    return out


def truth_venv() -> Path:
    """The virtualenv aiperf runs from (``bench/requirements-truth.txt``), made the first time."""
    return tool_venv("truth-venv", REPO / "bench" / "requirements-truth.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a built-in model or --model spec (default smollm2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per level (default: 8 at concurrency 1, else 4 per client)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-words", type=int, nargs="+", default=list(PROMPT_WORDS),
                        help="the prompts' lengths in words, drawn at random (default: %(default)s)")
    parser.add_argument("--output-tokens", type=int, nargs="+", default=list(OUTPUT_TOKENS),
                        help="the requests' max_tokens, drawn at random (default: %(default)s)")
    parser.add_argument("--aiperf", action="store_true", help="also run aiperf 0.13 at each level (var/truth-venv)")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more argument for manage.py serve")
    parser.add_argument("--json", type=Path, help="write the report here")
    add_results_option(parser, "metrics_truth")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as var_dir:
        server, base = launch(["--model", args.model, "--enable-debug", "--enable-tracing", *args.serve_arg], var_dir)
        try:
            model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
            levels = []
            for concurrency in args.concurrency:
                requests = args.requests or (8 if concurrency == 1 else 4 * concurrency)
                level = run_level(base, model, concurrency, requests, args.seed, tuple(args.prompt_words),
                                  tuple(args.output_tokens))
                levels.append(level)
                if args.aiperf:
                    tokenizer = write_tokenizer(args.model, Path(var_dir) / "tokenizer")
                    level["aiperf"] = run_aiperf(base, model, concurrency, requests, tokenizer, truth_venv())
            # aiperf's requests are in the rollups too, and its clients' times are not ours.
            rollups = [] if args.aiperf else rollup_comparisons(Path(var_dir), model, levels)
        finally:
            server.terminate()
            server.wait(30)
    report = {"model": args.model, "levels": levels,
              "rollups": [{**asdict(c), "ok": c.ok} for c in rollups],
              "ok": all(level["ok"] and level.get("aiperf", {"ok": True})["ok"] for level in levels)
              and all(c.ok for c in rollups)}
    results = ResultsFile(args.results, "metrics_truth")
    for level in levels:
        print(f"concurrency {level['concurrency']}: {level['requests']} requests in {level['wall_s']:.1f} s"
              + (f", errors: {level['errors']}" if level["errors"] else ""))
        for c in [Comparison(**{k: v for k, v in row.items() if k != "ok"}) for row in level["comparisons"]]:
            print(c.row())
            if not c.exact and c.client:
                results.add(f"{c.figure} server/client", c.server / c.client, "ratio", model=args.model,
                            concurrency=level["concurrency"], source=c.source)
        for row in level.get("aiperf", {}).get("comparisons", []):
            print(Comparison(**{k: v for k, v in row.items() if k != "ok"}).row())
        for note in level.get("aiperf", {}).get("notes", []):
            print(f"  aiperf {note}")
    if rollups:
        print("the whole run, in the fleet's minute rollups:")
        for c in rollups:
            print(c.row())
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print("all figures agree" if report["ok"] else "SOME FIGURES DISAGREE")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
