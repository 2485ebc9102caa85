"""A newcomer's first minutes: a fresh clone's first start, its first load, first save, first profile.

The clone is made from this repository's HEAD (``git clone``), with the virtualenv already built
(the clone's ``.venv`` is a link to this checkout's) and a new, empty ``HOME``, so nothing is
cached: no compiled kernels, no demo checkpoint, no record of the model file's check. The bench
runs ``scripts/serve.sh`` there as a user would (both built-in models, debug and tracing on) and
measures:

- the seconds from the command to ``/health`` answering 200, with what the console printed and when;
- right after, a burst of ``--burst`` concurrent streaming chat requests to the first model: each
  one's time to first token and the whole burst's;
- the first ``/debug/save_event_trace`` and the first ``/debug/profile_start`` (and its stop);

then stops the server and does it all again in the same clone (``warm``: every cache filled).
The first-burst goal is a max TTFT within 2x of the warm server's.

    .venv/bin/python bench/first_start.py
    .venv/bin/python bench/first_start.py --burst 8 --max-tokens 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from results_file import add_results_option, ResultsFile  # bench/ is the script's folder, first on sys.path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Console:
    """A server's output, each line with the seconds since the command started."""

    def __init__(self, process: subprocess.Popen, began: float) -> None:
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(process, began), daemon=True)
        self.thread.start()

    def _read(self, process: subprocess.Popen, began: float) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append((time.perf_counter() - began, line.rstrip("\n")))


async def burst(base: str, model: str, clients: int, max_tokens: int) -> list[float]:
    """``clients`` streaming chat requests at once; each one's seconds to its first token."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        async def one(i: int) -> float:
            body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
                    "messages": [{"role": "user", "content": f"Tell me a story about lighthouse number {i}."}]}
            began = time.perf_counter()
            first = None
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {") and '"content"' in line:
                        first = time.perf_counter() - began
            return first if first is not None else float("nan")

        return list(await asyncio.gather(*(one(i) for i in range(clients))))


def timed_post(http: httpx.Client, path: str, body: dict) -> tuple[float, int]:
    began = time.perf_counter()
    status = http.post(path, json=body).status_code
    return time.perf_counter() - began, status


def run_once(clone: Path, home: Path, args: argparse.Namespace) -> dict:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "DATABASE_URL", "DJANGO_SETTINGS_MODULE",
                                                             "NUMBA_CACHE_DIR", "ENGINES_CACHE_DIR", "VIRTUAL_ENV")}
    env |= {"HOME": str(home), "PYTHONUNBUFFERED": "1"}
    began = time.perf_counter()
    process = subprocess.Popen(["scripts/serve.sh", "--port", str(port), *args.serve_args], cwd=clone, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    console = Console(process, began)
    base = f"http://127.0.0.1:{port}"
    result: dict = {}
    try:
        with httpx.Client(base_url=base, timeout=600) as http:
            while True:
                if process.poll() is not None:
                    raise SystemExit("the server exited:\n" + "\n".join(line for _, line in console.lines))
                try:
                    if http.get("/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            result["health_s"] = time.perf_counter() - began
            model = http.get("/v1/models").json()["data"][0]["id"]
            t = time.perf_counter()
            ttfts = asyncio.run(burst(base, model, args.burst, args.max_tokens))
            result["burst_s"] = time.perf_counter() - t
            result["ttft_max_s"], result["ttft_median_s"] = max(ttfts), sorted(ttfts)[len(ttfts) // 2]
            result["save_trace_s"], _ = timed_post(http, "/debug/save_event_trace", {"model": model, "note": "first"})
            result["profile_start_s"], _ = timed_post(http, "/debug/profile_start", {"model": model})
            http.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 8})
            result["profile_stop_s"], _ = timed_post(http, "/debug/profile_stop", {"model": model})
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        console.thread.join(5)
    result["console"] = [f"{at:7.1f} s  {line}" for at, line in console.lines]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--keep", action="store_true", help="keep the clone and its HOME (printed)")
    parser.add_argument("serve_args", nargs="*", help="more arguments for scripts/serve.sh (after --)")
    add_results_option(parser, "first_start")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="first-start-"))
    clone, home = root / "clone", root / "home"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    (clone / ".venv").symlink_to(REPO / ".venv")
    home.mkdir()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True).stdout
    print(f"clone of {head.strip()} in {clone}; HOME {home}; {os.cpu_count()} cores")
    rows = {}
    for phase in ("cold", "warm"):
        rows[phase] = run_once(clone, home, args)
        print(f"\n== {phase} ==")
        print("\n".join(rows[phase].pop("console")))
    print(f"\n{'':6}{'to /health':>12}{'burst':>8}{'max TTFT':>10}{'median TTFT':>13}{'save trace':>12}"
          f"{'profile start':>15}{'profile stop':>14}   (seconds; burst of {args.burst} streams)")
    for phase, r in rows.items():
        print(f"{phase:<6}{r['health_s']:>12.1f}{r['burst_s']:>8.2f}{r['ttft_max_s']:>10.2f}{r['ttft_median_s']:>13.2f}"
              f"{r['save_trace_s']:>12.2f}{r['profile_start_s']:>15.2f}{r['profile_stop_s']:>14.2f}")
    print(f"first burst's max TTFT / warm's: {rows['cold']['ttft_max_s'] / rows['warm']['ttft_max_s']:.2f}")
    results = ResultsFile(args.results, "first_start")
    for phase, r in rows.items():
        for metric, key in (("to /health", "health_s"), (f"burst of {args.burst}", "burst_s"),
                            ("max TTFT", "ttft_max_s"), ("median TTFT", "ttft_median_s"),
                            ("first save trace", "save_trace_s"),
                            ("first profile start", "profile_start_s"), ("profile stop", "profile_stop_s")):
            results.add(metric, r[key], "s", phase=phase)
    results.add("first burst's max TTFT / warm's", rows["cold"]["ttft_max_s"] / rows["warm"]["ttft_max_s"], "ratio")
    print(json.dumps({"cold": rows["cold"], "warm": rows["warm"]}))
    if not args.keep:
        subprocess.run(["rm", "-rf", str(root)], check=False)


if __name__ == "__main__":
    main()
