"""What the stall watchdog costs an engine: decode tokens/s with it on against off (goal >= 0.99).

One engine on the demo model, on a thread of this process (``AsyncEngine``, engine mode
``thread``), decodes the same batch again and again, the watchdog on and off by turns (the order
flipped every round, so neither side always runs first), with a pause between runs:

* **on**: as served. The engine loop writes its ``ProgressBoard`` before and after every step,
  and a ``StallWatch`` at its default interval (``POLL_S``, 0.5 s) reads the board from a thread
  of its own, as ``manage.py serve`` runs it;
* **off**: the engine loop's board is :class:`OffBoard`, whose writes do nothing, and no watch
  runs. The loop still calls the three methods (a no-op call, some 50 ns, against steps of tens
  of milliseconds): no product switch exists to leave them out, and none is needed for this.

A thread engine is the harder case: the watch thread takes this process's GIL, the engine's own,
at every poll (with an engine process it takes the server's). The loop-lag probe the watch reads
(``engines.server.loop_lag``) predates the watchdog and runs in neither mode. A run's decode tokens/s
counts the tokens that arrive after every request of the batch has its first one, over the time
they took: the batch decoding, with no prefill. Figures: the median of the rounds' on/off ratios
(each round's two runs side by side), the median tokens/s of each mode, and, beside them, the
parts measured alone: the board's two writes a step, and one poll of the watch, with the on/off
they make at the steps/s measured (what a machine too noisy to resolve 1% end to end still tells).

    .venv/bin/python bench/watchdog_overhead.py
    .venv/bin/python bench/watchdog_overhead.py --rounds 11 --requests 32 --max-tokens 96
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
import os
import timeit
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_threads import use_threads  # noqa: E402 - nothing here imports numpy before it runs
from bench.results_file import ResultsFile, add_results_option, this_machine  # noqa: E402

if TYPE_CHECKING:
    from engines.runtime import AsyncEngine
    from engines.watchdog.stall_watch import StallWatch

MODES = ("off", "on")
#: Seconds between two runs: the engine's kernel threads that spun for the last one settle.
PAUSE_S = 1.0
PROMPT_TOKENS = 16


class OffBoard:
    """A progress board whose writes do nothing: the engine loop with the watchdog off."""

    def step_started(self, work: int) -> None:
        pass

    def step_finished(self, work: int) -> None:
        pass

    def idle(self) -> None:
        pass


async def decode_run(engine: AsyncEngine, tag: str, requests: int, max_tokens: int) -> float:
    """``requests`` greedy requests at once, ``max_tokens`` each; the batch's decode tokens/s."""
    from engines.runtime import GenerationRequest, SamplingParams

    vocab = engine.checkpoint.config.vocab_size
    arrivals: list[tuple[float, int]] = []  # (when, tokens) of every output
    firsts: list[float] = []

    async def one(i: int) -> None:
        prompt = [300 + (i * 37 + j * 11) % (vocab - 310) for j in range(PROMPT_TOKENS)]
        request = GenerationRequest(f"{tag}-{i}", prompt,
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        first = True
        async for out in engine.generate(request):
            tokens = sum(len(c.token_ids) for c in out.choices)
            if tokens:
                now = time.perf_counter()
                arrivals.append((now, tokens))
                if first:
                    firsts.append(now)
                    first = False

    await asyncio.gather(*(one(i) for i in range(requests)))
    assert len(firsts) == requests, "a request produced nothing"
    start = max(firsts)
    after = [(t, n) for t, n in arrivals if t > start]
    return sum(n for _, n in after) / (max(t for t, _ in after) - start)


def board_writes_ns(board: object) -> float:
    """What one step's two writes of ``board`` cost (ns), as the loop makes them."""
    started, finished = board.step_started, board.step_finished  # type: ignore[attr-defined]

    def step() -> None:
        started(32)
        finished(32)

    number = 200_000
    return min(timeit.repeat(step, number=number, repeat=5)) / number * 1e9


def poll_us(watch: StallWatch) -> float:
    """One poll of the watch (every engine's board read, its detector fed), in µs."""
    number = 20_000
    return min(timeit.repeat(watch.poll, number=number, repeat=5)) / number * 1e6


async def measure(args: argparse.Namespace) -> dict[str, object]:
    from engines.runtime import AsyncEngine, EngineConfig, demo_checkpoint_path, load_checkpoint
    from engines.watchdog.stall_watch import POLL_S, StallWatch

    config = EngineConfig(max_num_seqs=args.requests, max_total_tokens=args.requests * 256,
                          prefill_chunk_size=256, enable_prefix_cache=False)
    engine = AsyncEngine(load_checkpoint(demo_checkpoint_path()), "bench", config, backend="cpu")
    engine.start()
    core = engine._transport.core  # the engine loop of a thread engine: its board is swapped between runs
    board, off_board = core.board, OffBoard()
    polls = 0

    def engines() -> list[AsyncEngine]:
        nonlocal polls
        polls += 1
        return [engine]

    watch = StallWatch(poll_s=POLL_S)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    run_s = 0.0
    try:
        for round_ in range(args.rounds + 1):  # the first warms up, uncounted
            order = MODES if round_ % 2 else MODES[::-1]
            for mode in order:
                gc.collect()  # the last run's garbage, collected here rather than during this run
                await asyncio.sleep(PAUSE_S)
                core.board = board if mode == "on" else off_board
                if mode == "on":
                    watch.start(engines)
                began = time.perf_counter()
                rate = await decode_run(engine, f"r{round_}-{mode}", args.requests, args.max_tokens)
                run_s = max(run_s, time.perf_counter() - began)
                if mode == "on":
                    watch.stop()
                if round_:
                    rates[mode].append(rate)
            if round_:
                print(f"round {round_} ({'/'.join(order)}): off {rates['off'][-1]:.0f}, on {rates['on'][-1]:.0f} "
                      f"tok/s, on/off {rates['on'][-1] / rates['off'][-1]:.3f}", flush=True)
        core.board = board
        incidents = watch.incidents(engine.name)
        if incidents or polls < args.rounds:
            raise SystemExit(f"the watch polled {polls} times and opened {len(incidents)} incident(s): "
                             "the 'on' runs did not run as served")
        counted = polls  # the timed polls below (the watch stopped, its engines kept) would add to it
        return {"rates": rates, "polls": counted, "run_s": run_s, "board_ns": board_writes_ns(board),
                "off_board_ns": board_writes_ns(off_board), "poll_us": poll_us(watch)}
    finally:
        watch.stop()
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=32, help="the batch: requests decoding together")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens each request generates")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="the engine's compute threads (default: one per core, as served)")
    add_results_option(parser, "watchdog_overhead")
    args = parser.parse_args()
    use_threads(args.threads)  # before numpy and numba load
    from engines.watchdog.stall_watch import POLL_S

    cpu = this_machine()["cpu"]
    print(f"CPU: {cpu}, {this_machine()['cores']} cores; {args.threads} engine thread(s)")
    found = asyncio.run(measure(args))
    rates: dict[str, list[float]] = found["rates"]  # type: ignore[assignment]
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    ratio = statistics.median(ratios)
    median = {mode: statistics.median(values) for mode, values in rates.items()}
    spread = max(max(v) / min(v) - 1 for v in rates.values())
    print(f"median decode tok/s of {args.rounds} rounds (batch {args.requests}, {args.max_tokens} tokens each, "
          f"runs up to {found['run_s']:.1f} s): off {median['off']:.0f}, on {median['on']:.0f}; "
          f"rounds within {spread:.0%} of each other")
    print(f"on/off: median of the rounds {ratio:.3f} (goal >= 0.99; rounds {min(ratios):.3f} .. {max(ratios):.3f}); "
          f"the watch polled {found['polls']} times")
    # The parts' share of the engine's time: the writes at the steps the off median ran (a decode
    # step gives every request of the batch one token) and the polls' time, all on the engine's GIL.
    steps_per_s = median["off"] / args.requests
    parts = 1 - ((found["board_ns"] - found["off_board_ns"]) * 1e-9 * steps_per_s  # type: ignore[operator]
                 + found["poll_us"] * 1e-6 / POLL_S)  # type: ignore[operator]
    print(f"alone: the board's two writes a step {found['board_ns']:.0f} ns (off: {found['off_board_ns']:.0f} ns); "
          f"a poll {found['poll_us']:.1f} µs, every {POLL_S:g} s: at {steps_per_s:.0f} steps/s, on/off {parts:.5f}")
    results = ResultsFile(args.results, "watchdog_overhead")
    params = {"requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "threads": args.threads, "engine_mode": "thread"}
    labels = {"off": "off (board writes nothing, no watch)", "on": f"on (board, a poll every {POLL_S:g} s)"}
    for mode in MODES:
        results.add("decode", median[mode], "tok/s", watchdog=labels[mode], **params)
    results.add("on/off", ratio, "ratio", watchdog=labels["on"], **params)
    # As a cost in parts per million: a ratio's four figures would round it to 1.
    results.add("cost from the parts", (1 - parts) * 1e6, "ppm", watchdog=labels["on"], **params)
    results.add("board writes a step", found["board_ns"], "ns", watchdog=labels["on"], **params)
    results.add("board writes a step", found["off_board_ns"], "ns", watchdog=labels["off"], **params)
    results.add("a poll", found["poll_us"], "µs", watchdog=labels["on"], **params)


if __name__ == "__main__":
    main()
