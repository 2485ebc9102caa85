"""``/metrics`` bodies as the servers the fleet attaches emit them, made here with
``prometheus_client`` from the names, labels and bucket lists their projects document
(``../shared/reference/peers.md`` §1-2, ``fleet-anchors.md`` §3): vLLM before and after its
0.9-0.10 renames, SGLang with either prefix separator, llama.cpp, MLC LLM's tab-separated text,
and production-stack's router re-exporting its backends' gauges."""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0)
VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0)
SGLANG_TTFT = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_ITL = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100, 0.200,
              0.400, 0.600, 0.800, 1, 2, 4, 6, 8)
SGLANG_E2E = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)


def vllm(version: str, *, model: str = "meta-llama/Llama-3.1-8B-Instruct", running: int = 3, waiting: int = 1,
         kv: float = 0.42, prompt_tokens: int = 1000, generation_tokens: int = 5000, ttfts: Iterable[float] = (),
         itls: Iterable[float] = (), aborted: int = 0, finished: int = 10, dp_ranks: int = 1) -> str:
    """vLLM's exposition: ``"0.8"`` (``gpu_cache_usage_perc``, ``gpu_prefix_cache_*``,
    ``time_per_output_token_seconds``) or ``"0.11"`` (``kv_cache_usage_perc``, ``prefix_cache_*``,
    ``inter_token_latency_seconds``). ``dp_ranks`` repeats every series per ``engine`` label."""
    old = version == "0.8"
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    running_g = Gauge("vllm:num_requests_running", "running", labels, registry=r)
    waiting_g = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=r)
    kv_g = Gauge("vllm:gpu_cache_usage_perc" if old else "vllm:kv_cache_usage_perc", "kv", labels, registry=r)
    prefix = "vllm:gpu_prefix_cache_" if old else "vllm:prefix_cache_"
    hits = Counter(prefix + "hits", "hits", labels, registry=r)
    queries = Counter(prefix + "queries", "queries", labels, registry=r)
    prompt = Counter("vllm:prompt_tokens", "prompt", labels, registry=r)
    gen = Counter("vllm:generation_tokens", "gen", labels, registry=r)
    success = Counter("vllm:request_success", "success", labels + ["finished_reason"], registry=r)
    preempt = Counter("vllm:num_preemptions", "preemptions", labels, registry=r)
    ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", labels, buckets=VLLM_TTFT, registry=r)
    itl = Histogram("vllm:time_per_output_token_seconds" if old else "vllm:inter_token_latency_seconds", "itl",
                    labels, buckets=VLLM_ITL, registry=r)
    e2e = Histogram("vllm:e2e_request_latency_seconds", "e2e", labels, buckets=VLLM_E2E, registry=r)
    ttfts, itls = list(ttfts), list(itls)
    for rank in range(dp_ranks):
        lab = (model, str(rank))
        running_g.labels(*lab).set(running)
        waiting_g.labels(*lab).set(waiting)
        kv_g.labels(*lab).set(kv + 0.1 * rank)
        queries.labels(*lab).inc(prompt_tokens)
        hits.labels(*lab).inc(prompt_tokens // 4)
        prompt.labels(*lab).inc(prompt_tokens)
        gen.labels(*lab).inc(generation_tokens)
        success.labels(*lab, "stop").inc(finished)
        success.labels(*lab, "abort").inc(aborted)
        preempt.labels(*lab).inc(0)
        e2e.labels(*lab)  # vLLM makes every labelled series at start: present, empty
        for value in ttfts:
            ttft.labels(*lab).observe(value)
        for value in itls:
            itl.labels(*lab).observe(value)
    return generate_latest(r).decode()


def sglang(separator: str, *, model: str = "Qwen/Qwen2.5-7B-Instruct", running: int = 2, waiting: int = 0,
           usage: float = 0.3, prompt_tokens: int = 800, cached_tokens: int = 200, generation_tokens: int = 3000,
           ttfts: Iterable[float] = (), old_itl_name: bool = False) -> str:
    """SGLang's exposition with ``sglang:`` or ``sglang_`` (``separator``); TTFT and token counters
    split by ``is_streaming``, as SGLang does; the ITL histogram under its older name if asked."""
    p = f"sglang{separator}"
    r = CollectorRegistry()
    labels = ["model_name", "tp_rank"]
    Gauge(p + "num_running_reqs", "running", labels, registry=r).labels(model, "0").set(running)
    Gauge(p + "num_queue_reqs", "queue", labels, registry=r).labels(model, "0").set(waiting)
    Gauge(p + "token_usage", "usage", labels, registry=r).labels(model, "0").set(usage)
    Gauge(p + "cache_hit_rate", "hit rate", labels, registry=r).labels(model, "0").set(0.25)
    streaming = labels + ["is_streaming"]
    prompt = Counter(p + "prompt_tokens", "prompt", streaming, registry=r)
    cached = Counter(p + "cached_tokens", "cached", streaming, registry=r)
    gen = Counter(p + "generation_tokens", "gen", streaming, registry=r)
    for flag, share in (("true", 0.75), ("false", 0.25)):
        prompt.labels(model, "0", flag).inc(prompt_tokens * share)
        cached.labels(model, "0", flag).inc(cached_tokens * share)
        gen.labels(model, "0", flag).inc(generation_tokens * share)
    Counter(p + "num_requests", "requests", labels, registry=r).labels(model, "0").inc(12)
    Counter(p + "num_aborted_requests", "aborted", labels, registry=r).labels(model, "0").inc(1)
    ttft = Histogram(p + "time_to_first_token_seconds", "ttft", streaming, buckets=SGLANG_TTFT, registry=r)
    for i, value in enumerate(ttfts):
        ttft.labels(model, "0", "true" if i % 2 else "false").observe(value)
    Histogram(p + ("time_per_output_token_seconds" if old_itl_name else "inter_token_latency_seconds"), "itl",
              labels, buckets=SGLANG_ITL, registry=r).labels(model, "0").observe(0.02)
    Histogram(p + "e2e_request_latency_seconds", "e2e", streaming, buckets=SGLANG_E2E, registry=r)
    return generate_latest(r).decode()


def llama_cpp(*, processing: int = 1, deferred: int = 0, prompt_tokens: int = 33065) -> str:
    """llama.cpp's ``--metrics`` exposition (no histograms, no model label)."""
    r = CollectorRegistry()
    Counter("llamacpp:prompt_tokens", "prompt", registry=r).inc(prompt_tokens)
    Counter("llamacpp:tokens_predicted", "predicted", registry=r).inc(7801)
    Gauge("llamacpp:prompt_tokens_seconds", "prompt throughput", registry=r).set(140.2)
    Gauge("llamacpp:requests_processing", "processing", registry=r).set(processing)
    Gauge("llamacpp:requests_deferred", "deferred", registry=r).set(deferred)
    return generate_latest(r).decode()


def mlc(prompt_tokens: int = 120, completion_tokens: int = 512) -> str:
    """MLC LLM's ``/metrics``: tab-separated, unquoted labels, no TYPE lines."""
    return ("# NOTE: token counts use the serving model's tokenizer\n# \n# \n"
            f"engine_prefill_time_sum\t1.23\nengine_decode_time_sum\t4.5\nprompt_tokens_sum\t{prompt_tokens}\n"
            f"completion_tokens_sum\t{completion_tokens}\n# /last_finished_request\n"
            "last_finished_request_ttft_s\t0.05\ndecode_time_by_batch_size_mean{batch_size=1}\t0.012\n")


def production_stack_router() -> str:
    """production-stack's router: its backends' gauges under vLLM's names with a ``server`` label."""
    r = CollectorRegistry()
    Gauge("vllm:num_requests_running", "running", ["server"], registry=r).labels("http://a:8000").set(4)
    Gauge("vllm:current_qps", "qps", ["server"], registry=r).labels("http://a:8000").set(2.5)
    Gauge("vllm:healthy_pods_total", "healthy", registry=r).set(2)
    return generate_latest(r).decode()


def ours(prefix: str = "llm_engine_", *, model: str = "demo", running: int = 2, prompt_tokens: int = 100,
         finished: int = 4, ttfts: Iterable[float] = (), vllm_aliases: bool = False) -> str:
    """A server of ours (the families the fleet reads, and those it is told by): every name under
    ``prefix`` (``serve --metrics-prefix``), vLLM's names beside them with ``vllm_aliases``;
    ``prefix=""``: as a server from before the prefix (issue 60) named them, MLC's sums as gauges
    under MLC's names and the engine's life as ``engine_up``."""
    r = CollectorRegistry()
    legacy = prefix == ""
    life = "engine_" if legacy else prefix
    Gauge(life + "up", "up", ["model", "state"], registry=r).labels(model, "running").set(1)
    Counter(life + "restarts", "restarts", ["model"], registry=r).labels(model).inc(0)
    if legacy:
        Gauge("engine_prefill_time_sum", "prefill seconds", ["model"], registry=r).labels(model).set(1.5)
    else:
        Counter(prefix + "prefill_time_seconds", "prefill seconds", ["model"], registry=r).labels(model).inc(1.5)
    names = {"num_requests_running": Gauge(prefix + "num_requests_running", "running", ["model"], registry=r),
             "prefill_tokens_processed": Counter(prefix + "prefill_tokens_processed", "prefilled", ["model"],
                                                 registry=r),
             "request_success": Counter(prefix + "request_success", "finished", ["model"], registry=r),
             "time_to_first_token_seconds": Histogram(prefix + "time_to_first_token_seconds", "ttft", ["model"],
                                                      buckets=VLLM_TTFT, registry=r)}
    names["num_requests_running"].labels(model).set(running)
    names["prefill_tokens_processed"].labels(model).inc(prompt_tokens)
    names["request_success"].labels(model).inc(finished)
    ttft_list = list(ttfts)
    for value in ttft_list:
        names["time_to_first_token_seconds"].labels(model).observe(value)
    if vllm_aliases:  # what --metrics-vllm-aliases adds: the vLLM-named families a vLLM reader would take
        Gauge("vllm:num_requests_running", "running", ["model_name"], registry=r).labels(model).set(running)
        ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", ["model_name"], buckets=VLLM_TTFT, registry=r)
        for value in ttft_list:
            ttft.labels(model).observe(value)
    return generate_latest(r).decode()
