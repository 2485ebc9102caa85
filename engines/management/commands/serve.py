"""``manage.py serve``: build the engines, then serve them over HTTP with Daphne in this process.

The flags follow ``mlc_llm serve``. Engines are built and started *before* the
server listens, in the same process as the ASGI app, so the first request
finds them ready in the registry. Ctrl-C or SIGTERM stops Daphne (which cancels
in-flight requests, aborting them in their engines) and then the engines.

With ``--trace-autosave`` and ``--metrics-snapshot-interval`` a
:class:`~engines.history.autosave.HistoryAutosave` runs on Daphne's event loop while
it serves; it is stopped (saving the last trace window) before the engines stop.
"""
from __future__ import annotations

# daphne.server installs Twisted's asyncio reactor on import; it must come
# before anything else imports twisted.internet.reactor.
from daphne.server import Server  # isort:skip

import asyncio
import fcntl
import functools
import ipaddress
import logging
import math
import os
import signal
import socket
from argparse import ArgumentParser, ArgumentTypeError
from collections.abc import Callable, Collection
from typing import Any

from daphne.endpoints import build_endpoint_description_strings
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor

from debugsite.cookies import cookie_names
from engines.dashboard.local_login import local_login_path
from engines.dashboard.sampler import hub_for
from engines.fleet import service as fleet
from engines.fleet.service import fleet_service
from engines.history.autosave import HistoryAutosave
from engines.history.capture import start_digest_process, stop_digest_process
from engines.server.loop_lag import loop_lag
from engines.history.incidents import incident_recorder
from engines.watchdog.stall_watch import stall_watch
from engines.watchdog.detector import LOOP_LAG_S, NO_PROGRESS_S, STEP_S, StallThresholds
from engines.server.malloc_tuning import tune_malloc
from engines.prometheus_names import DEFAULT_METRICS_PREFIX, check_prefix
from engines import otel
from engines.server import server_identity
from engines.registry import RegistryError, configure, registry
from engines.startup import (
    ENGINE_MODES,
    WEIGHTS_DTYPES,
    ModelSpec,
    build_engines,
    builtin_model_names,
    engine_mode,
    keeps_quantized,
    parse_byte_size,
    prepare_kernels,
)

logger = logging.getLogger("engines.serve")


def debug_routes() -> list[str]:
    """The ``/debug/`` routes, as the URLconf routes them (the one list of them)."""
    from django.urls import get_resolver

    routes = (str(pattern.pattern) for pattern in get_resolver().url_patterns)
    return [route[len("debug/"):] for route in routes if route.startswith("debug/")]


def is_loopback(host: str) -> bool:
    """True when only this machine can reach ``host``. Other host names could resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allow_host(host: str) -> None:
    """Add the listen address to ``ALLOWED_HOSTS``, so the URL ``serve`` prints answers: Django
    refuses any Host header not listed there (400). Clients that name the server otherwise need
    their name in the ``ALLOWED_HOSTS`` environment variable; the 400 tells them so."""
    entry = f"[{host.strip('[]')}]" if ":" in host else host
    if entry not in settings.ALLOWED_HOSTS:
        settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, entry]


def check_port_free(host: str, port: int) -> None:
    """Raise a CommandError when ``host:port`` cannot be listened on (another server holds it):
    checked before the models load, which takes from seconds to minutes. Bound as Twisted binds
    (``SO_REUSEADDR``), so a port left in TIME_WAIT by a server that just stopped passes; Daphne's
    own listen still catches one taken in between."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        raise CommandError(f"could not listen on {host}:{port}: {exc.strerror or exc} (is the port already in "
                           "use? pick another with --port)") from None


def byte_size(text: str) -> int:
    """argparse type for a size in bytes (``parse_byte_size``)."""
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise ArgumentTypeError(str(exc)) from None


def seconds(text: str) -> float:
    """argparse type for an interval: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def metrics_prefix(text: str) -> str:
    """argparse type for ``--metrics-prefix``: a prefix that can start a metric name."""
    try:
        return check_prefix(text)
    except ValueError as exc:
        raise ArgumentTypeError(str(exc)) from None


class _Interrupted(Exception):
    """SIGTERM arrived before Daphne took over signal handling (while engines were loading)."""


class Command(BaseCommand):
    help = ("Serve engines (the built-in smollm2 and demo models by default) over the OpenAI API, /debug, "
            "/metrics and the dashboard.")

    # Django's system checks run anyway in the ASGI app; skipping them here keeps start-up quick.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--model", action="append", dest="models", metavar="smollm2|demo|PATH[:NAME]",
            help="model to serve (repeatable): a built-in one (smollm2: SmolLM2-135M-Instruct, a real chat "
                 "model; demo: random weights, for tests), a local Hugging Face checkpoint folder or a GGUF "
                 "file, optionally ':NAME' for the served name (default: smollm2 and demo)",
        )
        parser.add_argument("--enable-debug", action="store_true",
                            help="mount /debug/*, honour debug_config in requests and return usage.extra")
        parser.add_argument("--enable-tracing", action="store_true",
                            help="record the event trace that /debug/dump_event_trace returns")
        parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
        parser.add_argument("--api-key", default=os.environ.get("API_KEY") or None,
                            help="require 'Authorization: Bearer KEY' on /v1, /debug, /microserving, /stats "
                                 "and /metrics (default: $API_KEY)")
        parser.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto",
                            help="compute backend: cuda when a GPU is usable, else cpu (default auto)")
        parser.add_argument("--engine-mode", choices=ENGINE_MODES, default="process",
                            help="run each engine loop in its own process (default: its Python work then never "
                                 "waits on the server's GIL) or on a thread of the server")
        parser.add_argument("--drain-timeout", type=seconds, default=5.0, metavar="SECONDS",
                            help="on SIGTERM or Ctrl-C, let running requests finish for up to SECONDS, then end "
                                 "the rest with finish_reason 'abort' and [DONE] (as reset_engine does); new "
                                 "requests get 503 meanwhile. A second signal stops at once (default 5)")
        parser.add_argument("--no-engine-restart", action="store_true",
                            help="leave an engine that dies dead (default: restart it after 0.5 s, 1 s, 2 s, ...; "
                                 "an engine that dies 5 times in 10 minutes stays dead; /debug/reset_engine "
                                 "restarts a dead one)")
        parser.add_argument("--otlp-traces-endpoint", metavar="URL", default=None,
                            help="export a span per generation request (OpenTelemetry's GenAI conventions, with "
                                 "queue, prefill and decode spans, joined to the client's traceparent) over "
                                 "OTLP/HTTP to URL, e.g. http://127.0.0.1:4318/v1/traces (default: "
                                 "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or $OTEL_EXPORTER_OTLP_ENDPOINT/v1/traces; "
                                 "neither: off, at no cost)")
        parser.add_argument("--kv-port", type=int, default=0, metavar="PORT",
                            help="with --enable-debug: the port of the first engine's K/V listener, where other "
                                 "servers send disaggregated K/V (the next engine takes the next port; default: "
                                 "any free port, named in prep_recv's kv_append_metadata)")
        router = parser.add_argument_group("disaggregated serving (a router in front of engine servers)")
        router.add_argument("--router", choices=("disagg",),
                            help="serve no engines: route /v1/completions and /v1/chat/completions over "
                                 "--prefill-url and --decode-url servers (MicroServing, as MLC's router)")
        router.add_argument("--prefill-url", action="append", default=[], metavar="URL",
                            help="a server that prefills (repeatable; taken in turn)")
        router.add_argument("--decode-url", action="append", default=[], metavar="URL",
                            help="a server that decodes (repeatable; the least loaded is picked)")
        parser.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                            help="KV-cache dtype, and the weights' where they are floats: a Hugging Face folder's, "
                                 "a GGUF's dequantized by --weights-dtype (default float32; float16 on the cuda "
                                 "backend only)")
        parser.add_argument("--weights-dtype", choices=WEIGHTS_DTYPES, default=None,
                            help="how a GGUF's matrices are held (a Hugging Face folder's weights are in --dtype "
                                 "whatever this says). gguf, the default: as the file holds them (Q8_0, Q4_0, Q4_1; "
                                 "Q4_K as Q4_1, other block types as Q8_0), read by integer kernels with int8 "
                                 "activations, as llama.cpp does: SmolLM2's weights take 97 MB, not 538, and its "
                                 "batch-1 decode runs 3.1x float32's on a 2-core Xeon; its top token is float32's "
                                 "at 98%% of steps, its greedy text parts from float32's after 5-63 tokens (README, "
                                 "GGUF files). "
                                 "float32, or float16 with --dtype float16: dequantized at load, the path held to "
                                 "transformers' answers, at that memory and speed")
        history = parser.add_argument_group("trace history")
        history.add_argument("--trace-autosave", type=seconds, default=0, metavar="SECONDS",
                             help="every SECONDS, save each engine's event trace into the history and clear it, "
                                  "so a long run is kept in slices (needs --enable-tracing; default 0: off)")
        history.add_argument("--metrics-snapshot-interval", type=seconds, metavar="SECONDS",
                             default=settings.METRICS_SNAPSHOT_INTERVAL_S,
                             help="every SECONDS, save each engine's metrics into the history (0: off; "
                                  "default %(default)g, from $METRICS_SNAPSHOT_INTERVAL_S)")
        parser.add_argument("--capture-text", action="store_true",
                            help="let captures keep text: the live requests table, /debug/list_requests and a "
                                 "stall's evidence show each request's prompt start and output end (32 tokens "
                                 "each). Default: ids, counts and times only (README, \"What each capture "
                                 "holds\")")
        stalls = parser.add_argument_group("stalls (the watchdog: an engine up but not progressing)")
        stalls.add_argument("--stall-no-progress-s", type=seconds, default=NO_PROGRESS_S, metavar="SECONDS",
                            help="a stall: requests waiting and no engine step finished for SECONDS "
                                 "(default %(default)g)")
        stalls.add_argument("--stall-step-s", type=seconds, default=STEP_S, metavar="SECONDS",
                            help="a stall: one engine step running longer than SECONDS (default %(default)g)")
        stalls.add_argument("--stall-loop-lag-s", type=seconds, default=LOOP_LAG_S, metavar="SECONDS",
                            help="a stall: the server's event loop running SECONDS late (default %(default)g)")
        stalls.add_argument("--stall-health-ok", action="store_true",
                            help="/health answers 200 while a stall lasts (still saying 'stalled' and why); "
                                 "default 503, so a load balancer moves traffic away")
        metrics = parser.add_argument_group("Prometheus /metrics")
        metrics.add_argument("--metrics-prefix", type=metrics_prefix, default=DEFAULT_METRICS_PREFIX, metavar="PREFIX",
                             help="start every /metrics name with PREFIX, our namespace in a shared Prometheus "
                                  "(default %(default)s: llm_engine_num_requests_running, ...)")
        metrics.add_argument("--metrics-vllm-aliases", action="store_true",
                             help="also export the series vLLM defines alike under vLLM's names and model_name "
                                  "label (vllm:num_requests_running, ...), for vLLM's Grafana dashboards and "
                                  "inference-perf; promtool flags their colons")
        sizing = parser.add_argument_group("engine sizing")
        sizing.add_argument("--max-num-seqs", type=int, help="concurrent running sequences per engine")
        pages = sizing.add_mutually_exclusive_group()
        pages.add_argument("--num-pages", type=int, help="KV-cache pages per engine")
        pages.add_argument("--max-total-tokens", type=int, help="KV-cache capacity in tokens (sets the pages)")
        pages.add_argument("--kv-cache-bytes", type=byte_size, metavar="SIZE",
                           help="KV-cache size in bytes per engine (512M, 2GiB, ...). Default, with none of "
                                "these three: as large as the model's weights, at least one full context, "
                                "at most a quarter of the free memory")
        sizing.add_argument("--page-size", type=int, help="tokens per KV-cache page")
        sizing.add_argument("--prefill-chunk-size", type=int, help="per-step token budget (prefill + decode)")

    def handle(self, *args: Any, **options: Any) -> None:
        tune_malloc()  # before Daphne's and the savers' threads exist: see engines.server.malloc_tuning
        host, port, api_key = options["host"], options["port"], options["api_key"]
        server_identity.configure(port)  # before anything names this server (fleet, snapshots, history)
        if api_key is not None and not api_key.strip():
            # A blank key would pass the "a key is set" check below and protect nothing.
            raise CommandError("the API key is empty or only whitespace: pass a real --api-key KEY "
                               "(or set API_KEY), or none at all on 127.0.0.1.")
        if not is_loopback(host) and not api_key:
            raise CommandError(
                f"refusing to listen on {host} without an API key: anyone who can reach that address could "
                "run prompts, read traces and reset the engines. Pass --api-key KEY (or set API_KEY), "
                "or listen on 127.0.0.1."
            )
        if not is_loopback(host):
            allow_host(host)
        if options["trace_autosave"] and not options["enable_tracing"]:
            raise CommandError(
                "--trace-autosave saves the event trace, which engines record only with --enable-tracing: "
                "add --enable-tracing, or drop --trace-autosave."
            )
        if options["router"] and (options["models"] or not options["prefill_url"] or not options["decode_url"]):
            raise CommandError("--router disagg serves no engines: give it at least one --prefill-url and one "
                               "--decode-url (servers run with --enable-debug), and no --model.")
        if (options["prefill_url"] or options["decode_url"]) and not options["router"]:
            raise CommandError("--prefill-url and --decode-url belong to a router: add --router disagg.")
        try:
            options["keep_quantized"] = keeps_quantized(options["weights_dtype"], options["dtype"])
        except RegistryError as exc:  # its words are the environment's too: say the flags'
            raise CommandError(f"--weights-dtype {options['weights_dtype']} with --dtype {options['dtype']}: "
                               "dequantized weights are stored in --dtype (give both the same, or leave "
                               "--weights-dtype out: a GGUF's matrices then stay in the file's types)") from exc
        try:
            traces_endpoint = otel.endpoint_from(options["otlp_traces_endpoint"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if options["router"] and options["otlp_traces_endpoint"]:
            raise CommandError("--otlp-traces-endpoint: a router exports no spans (its engine servers do): give the "
                               "flag to them.")
        specs = [] if options["router"] else self._model_specs(options["models"] or list(builtin_model_names()))
        try:
            stall_watch.configure(StallThresholds(options["stall_no_progress_s"], options["stall_step_s"],
                                                  options["stall_loop_lag_s"]), options["stall_health_ok"])
        except ValueError as exc:
            raise CommandError(f"--stall-*: {exc}") from None
        check_port_free(host, port)
        # Before the ASGI app is built (its websocket session middleware reads the name once).
        settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME = cookie_names(port)

        # Until Daphne installs its own handlers, SIGTERM must unwind like Ctrl-C: a migration
        # rolls back and engines built so far are stopped, rather than the process dying mid-step.
        previous_term = signal.signal(signal.SIGTERM, _raise_interrupted)
        try:
            self._apply_migrations()
            if options["router"]:
                self._configure_router(options)
            else:
                self._load_engines(specs, options)
                otel.configure(traces_endpoint)  # off (None) without a flag or variable
            if options["enable_debug"]:
                logger.info("Enable debug endpoint and debug_config in requests...")
            if options["enable_tracing"]:
                start_digest_process()  # trace saves parse out of this process: engines.history.digest
            autosave = HistoryAutosave(registry, trace_interval_s=options["trace_autosave"],
                                       metrics_interval_s=options["metrics_snapshot_interval"])
            links = functools.partial(self._print_urls, host, port, options["enable_debug"], api_key, autosave)
            self._run_daphne(host, port, options["verbosity"], autosave, options["drain_timeout"], links)
        except (KeyboardInterrupt, _Interrupted):
            pass
        finally:
            signal.signal(signal.SIGTERM, previous_term)
            otel.shutdown()  # the spans of the requests that ended, out before the process goes
            had_engines = len(registry) > 0
            registry.shutdown_all()
            stop_digest_process()
            if had_engines:
                self.stdout.write("Engines stopped. Bye.")

    def _model_specs(self, values: list[str]) -> list[ModelSpec]:
        try:
            return [ModelSpec.parse(v) for v in values]
        except RegistryError as exc:
            raise CommandError(str(exc)) from exc

    def _apply_migrations(self) -> None:
        """Create or update the database on first run, quietly when there is nothing to do.

        Under a lock file in the var folder: servers started together on one machine (a prefill
        and a decode server, say) share its database, and two first runs migrating at once fail.
        """
        with open(settings.VAR_DIR / "migrate.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            executor = MigrationExecutor(connections[DEFAULT_DB_ALIAS])
            plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
            if plan:
                self.stdout.write(f"Applying {len(plan)} database migration(s)...")
                call_command("migrate", interactive=False, verbosity=0)
        # The server runs on an event loop; don't carry this thread's connection into it.
        connections.close_all()

    def _load_engines(self, specs: list[ModelSpec], options: dict[str, Any]) -> None:
        from engines.runtime import CheckpointError, EngineConfig, KVListenSpec

        sizing = {
            key: options[key]
            for key in ("max_num_seqs", "num_pages", "max_total_tokens", "kv_cache_bytes", "page_size",
                        "prefill_chunk_size")
            if options[key] is not None
        }
        try:
            prepare_kernels(options["backend"], specs, keep_quantized=options["keep_quantized"],
                            progress=lambda line: self._say(f"  {line}"))
        except RuntimeError as exc:
            raise CommandError(str(exc)) from exc
        for spec in specs:
            self.stdout.write(f"Loading {spec.source}" + (f" as {spec.name}" if spec.name else "") + "...")
        try:
            engines = build_engines(
                specs,
                EngineConfig(**sizing),
                backend=options["backend"],
                dtype=options["dtype"],
                enable_tracing=options["enable_tracing"],
                process=engine_mode(options["engine_mode"]),
                restart=not options["no_engine_restart"],
                kv_listen=KVListenSpec(options["host"], options["kv_port"], options["api_key"])
                if options["enable_debug"] else None,
                progress=lambda message: self._say(f"  {message}..."),
                keep_quantized=options["keep_quantized"],
            )
            configure(engines, enable_debug=options["enable_debug"], api_key=options["api_key"],
                      metrics_prefix=options["metrics_prefix"], metrics_vllm_aliases=options["metrics_vllm_aliases"],
                      capture_text=options["capture_text"])
        except (CheckpointError, RegistryError, ValueError, RuntimeError) as exc:
            registry.shutdown_all()  # the engines that did start
            raise CommandError(str(exc)) from exc
        for engine in registry:
            tracing = "tracing on" if engine.tracing_enabled else "tracing off"
            where = "own process" if engine.process else "server thread"
            self.stdout.write(f"  {engine.name}: {engine.backend_name} backend, weights {engine.weights_format}, "
                              f"{tracing}, {where}; "
                              f"KV cache {engine.kv_cache.describe() if engine.kv_cache else 'starting'}")

    def _say(self, line: str) -> None:
        """A progress line, out at once (a first start prints them over tens of seconds)."""
        self.stdout.write(line)
        self.stdout.flush()

    def _configure_router(self, options: dict[str, Any]) -> None:
        from engines.disagg.router import DisaggRouter

        configure([], enable_debug=options["enable_debug"], api_key=options["api_key"], start=False,
                  metrics_prefix=options["metrics_prefix"], metrics_vllm_aliases=options["metrics_vllm_aliases"])
        registry.router = DisaggRouter(options["prefill_url"], options["decode_url"], api_key=options["api_key"])
        self.stdout.write(f"Routing over prefill {', '.join(registry.router.prefill_urls)} and decode "
                          f"{', '.join(registry.router.decode_urls)}")

    def _print_urls(self, host: str, port: int, enable_debug: bool, api_key: str | None,
                    autosave: HistoryAutosave) -> None:
        shown = f"[{host}]" if ":" in host else host
        base = f"http://{shown}:{port}"
        if is_loopback(host):
            dashboard = f"{base}{local_login_path()}   (one-time link: the dashboard, signed in)"
        else:
            dashboard = f"{base}/dashboard/   (sign in with a staff account: manage.py createsuperuser)"
        lines = [
            f"Dashboard    {dashboard}",
            f"OpenAI API   {base}/v1   (models: {', '.join(registry.model_names()) or 'those of the decode servers'})",
            f"Metrics      {base}/metrics",
            f"Health       {base}/health",
            f"Admin        {base}/admin/",
            f"History      {base}/admin/engines/tracerecord/  ({_describe_autosave(autosave)})",
        ]
        if otel.exporting():
            lines.append(f"OpenTelemetry  request spans to {otel.exporting()} (OTLP/HTTP)")
        if enable_debug:
            lines.insert(1, f"Debug        {base}/debug/  ({', '.join(debug_routes())})")
        if api_key:
            lines.append("API key required: send 'Authorization: Bearer <key>'.")
        lines.append("Quit with CONTROL-C.")
        self.stdout.write("\n".join(lines))
        self.stdout.flush()

    def _run_daphne(self, host: str, port: int, verbosity: int, autosave: HistoryAutosave,
                    drain_timeout_s: float, listening: Callable[[], None]) -> None:
        """Serve until a signal; ``listening()`` runs once the port is bound (the links printed
        then answer; on a port in use Daphne never calls it and this raises)."""
        from debugsite.asgi import application
        from engines.server import daphne_requests

        daphne_requests.install()

        def ready() -> None:
            # Called with Daphne's loop set but not yet running, and only once every endpoint
            # listens (a failed listen aborts the start): the tasks begin when it serves.
            listening()
            loop = asyncio.get_event_loop()
            autosave.start(loop)
            loop.call_soon(lambda: hub_for(registry).start())  # the dashboard's samplers, once it runs
            loop.call_soon(loop_lag.start)
            stall_watch.add_listener(incident_recorder)  # each incident kept in the history
            stall_watch.start(lambda: list(registry))  # a thread: the loop may be what stalls
            fleet.configure(f"http://{host}:{port}")
            loop.call_soon(lambda: fleet_service().start())  # this server in the fleet, once it runs
            stopper = GracefulStop(loop, drain_timeout_s, self.stdout)
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stopper.signalled)

        server = Server(
            application=application,  # static files included (debugsite.asgi)
            endpoints=[f"{endpoint}:backlog={LISTEN_BACKLOG}"
                       for endpoint in build_endpoint_description_strings(host=host, port=port)],
            # Not Twisted's handlers, which stop the reactor at once and cut every stream: ours drain
            # first (GracefulStop); the clean-up after run() is the same either way.
            signal_handlers=False,
            action_logger=self._log_action if verbosity >= 2 else None,
            verbosity=verbosity,
            ready_callable=ready,
        )
        server.run()
        stall_watch.stop()  # a drain's quiet end is not a stall
        loop = asyncio.get_event_loop()
        # The autosave is spared the cancel-all: cancelled mid-save it would lose a trace window
        # it had already taken from the recorder. Once the requests are cancelled it stops
        # between saves and saves the last window.
        _finish_pending_tasks(keep=autosave.tasks)
        loop.run_until_complete(autosave.stop())
        loop.run_until_complete(_stop_samplers())
        loop.run_until_complete(_leave_fleet())
        loop.run_until_complete(loop.shutdown_asyncgens())
        if not server.listening_addresses:
            raise CommandError(f"could not listen on {host}:{port} (is the port already in use?)")

    def _log_action(self, protocol: Any, action: str, details: dict[str, Any]) -> None:
        if protocol == "http" and action == "complete":
            self.stdout.write(f"{details['method']} {details['path']} {details['status']} "
                              f"{details['time_taken'] * 1000:.1f}ms")


#: Connections the kernel holds for the server before it accepts them (Twisted's default is 50). A
#: burst of a few hundred clients connecting at once overflowed 50: the kernel dropped their SYNs,
#: and each waited for its retransmission, a second or more, and longer when the loop was busy
#: (bench/soak.py's bursts of 200; the kernel's ListenOverflows counter). The kernel caps it at
#: net.core.somaxconn (4,096 on current kernels).
LISTEN_BACKLOG = 1024


class GracefulStop:
    """SIGTERM or Ctrl-C: drain (``EngineRegistry.drain``), then stop the server; a second
    signal stops it at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, drain_timeout_s: float, out: Any) -> None:
        self.loop = loop
        self.drain_timeout_s = drain_timeout_s
        self.out = out
        self.task: asyncio.Task[None] | None = None

    def signalled(self) -> None:
        if self.task is not None:
            self.out.write("Stopping now.")
            _stop_reactor()
            return
        self.out.write(f"Shutting down: finishing the requests in flight (at most {self.drain_timeout_s:g} s; "
                       "Ctrl-C again to stop now)...")
        self.task = self.loop.create_task(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        try:
            cut = await registry.drain(self.drain_timeout_s)
            if cut:
                self.out.write(f"Ended {cut} unfinished request(s) with finish_reason 'abort'.")
            await asyncio.sleep(0.1)  # the last chunks leave the socket buffers
        finally:
            _stop_reactor()


async def _stop_samplers() -> None:
    await hub_for(registry).stop()


async def _leave_fleet() -> None:
    """Stop publishing and say this server left on purpose (shown as stopped, not gone)."""
    await fleet_service().stop()


def _stop_reactor() -> None:
    from twisted.internet import reactor

    if reactor.running:
        # Twisted types the reactor by zope interfaces, whose methods mypy reads as lacking self.
        reactor.stop()  # type: ignore[misc]


def _describe_autosave(autosave: HistoryAutosave) -> str:
    trace = (f"traces saved every {autosave.trace_interval_s:g} s" if autosave.traced_engines
             else "trace autosave off")
    metrics = (f"metrics every {autosave.metrics_interval_s:g} s" if autosave.metrics_interval_s
               else "metrics snapshots off")
    return f"{trace}; {metrics}"


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise _Interrupted()


def _finish_pending_tasks(keep: Collection[asyncio.Task[Any]] = ()) -> None:
    """Cancel what is still running on Daphne's event loop and let it unwind, before engines stop.

    Daphne cancels each connection's application task on shutdown, but Django runs the
    view in an inner task that the cancellation does not reach, so a stream in flight
    would stay suspended forever and be torn down by the garbage collector at exit
    (which crashed the interpreter). Cancelling it here runs the stream's cleanup (the
    request is aborted in its engine) while the loop and the engines still exist.
    The tasks in ``keep`` go on running meanwhile; the caller ends them.
    """
    loop = asyncio.get_event_loop()
    pending = [task for task in asyncio.all_tasks(loop) if not task.done() and task not in keep]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=10))
