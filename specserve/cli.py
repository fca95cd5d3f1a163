"""The `specserve` console script.

    specserve serve CONFIG.yaml [--num-cpus N] [--address ADDR]   local Ray + every app of a Serve config
    specserve bench http [--url ...] [...]                           HTTP benchmark (specserve.bench.http)
    specserve bench engine [...]                                      in-process benchmark (specserve.bench.engine)
    specserve bench ingress [--url ...]                              one huge request vs small ones (specserve.bench.ingress)
    specserve bench overlap [...]                                     pipelined vs sequential speculation on Ray (specserve.bench.overlap)
    specserve bench soak [--streams 500]                             500 streams, a coordinator replica killed (specserve.bench.soak)
    specserve bench serve-gpu [--tiny] [--mps] --out DIR             the Serve app vs the in-process engine (specserve.bench.serve_gpu)
    specserve bench features [--url ...]                             each OpenAI option, speculative vs γ=0 (specserve.bench.features)
    specserve bench mix [--url ...] [--requests 200]                 random option mixes on every API, each answer checked (specserve.bench.mix)
    specserve bench cpu / drafters [...]                             CPU kernels; drafters side by side (specserve.bench.cpu, .drafters)
    specserve bench memory [--tiny]                                  dense vs paged KV at one budget (specserve.bench.memory)
    specserve bench policy [--costs FILE] [--trace FILE]             the γ policy replayed on measured costs (specserve.bench.policy)
    specserve bench acceptance [--drafter feature-head]              a drafter's hits position by position: a trace to replay (specserve.bench.acceptance)
    specserve bench prediction [--model tiny]                        code edits with / without a predicted output (specserve.bench.prediction)
    specserve bench history [--model tiny]                           drafting from earlier answers: repeats, templates, unrelated (specserve.bench.history)
    specserve bench windows [--shape mistral-7b]                     a windowed model's KV blocks given back vs kept (specserve.bench.windows)

A subcommand is one entry in COMMANDS (name -> help, add_arguments, run); a benchmark is one entry
in BENCHES (name -> module with `main(argv)`).
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from pathlib import Path


# -- serve -----------------------------------------------------------------------------------------
def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="a Serve config YAML (e.g. configs/local.yaml)")
    p.add_argument("--address", default=None, help="join a running Ray cluster instead of starting one")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--dashboard", action="store_true",
                   help="start Ray's dashboard (127.0.0.1:8265), which `serve status` needs")
    p.add_argument("--allow-unauthenticated-public", action="store_true",
                   help="serve a non-loopback http_options.host even without an API key")


def unauthenticated_public(spec: dict, allow: bool = False) -> list[str]:
    """The applications that would answer anyone: the config binds beyond loopback, and neither the
    app's `api_key` nor the environment's SPECSERVE_API_KEY gives a key (unless allowed, by the flag
    or the app's `front_door.allow_unauthenticated_public`)."""
    from specserve.serve.front_door import is_loopback

    if allow or is_loopback(str(spec.get("http_options", {}).get("host", "127.0.0.1"))):
        return []
    if os.environ.get("SPECSERVE_API_KEY", "").strip(","):
        return []
    open_apps = []
    for app in spec.get("applications", []):
        args = app.get("args", {})
        if not args.get("api_key") and not args.get("front_door", {}).get("allow_unauthenticated_public"):
            open_apps.append(app.get("name", "?"))
    return open_apps


def _serve(args: argparse.Namespace) -> int:
    """Start (or join) Ray, deploy each application of the config, block until Ctrl-C."""
    # Ray's token auth (the default) stays on; later `ray`/`serve` CLI calls need the same mode
    # exported (RAY_AUTH_MODE=token): see README, "Serving". Set before anything imports Ray,
    # which reads it once.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import yaml

    spec = yaml.safe_load(args.config.read_text())
    open_apps = unauthenticated_public(spec, args.allow_unauthenticated_public)
    if open_apps:
        print(f"refusing to serve {', '.join(open_apps)} on {spec['http_options']['host']} (beyond loopback) "
              "without an API key: export SPECSERVE_API_KEY, or pass --allow-unauthenticated-public "
              "(or set front_door.allow_unauthenticated_public) if something in front authenticates",
              file=sys.stderr)
        return 2
    import ray
    from ray import serve

    http = spec.get("http_options", {})
    host, port = http.get("host", "127.0.0.1"), int(http.get("port", 8000))
    init = {"address": args.address, "include_dashboard": args.dashboard}
    if args.address is None:
        init.update(_node_ip_address=host if host in ("127.0.0.1", "localhost") else None)
        if args.num_cpus is not None:
            init["num_cpus"] = int(args.num_cpus)
    ray.init(**{k: v for k, v in init.items() if v is not None})
    options = {"host": host, "port": port}
    if http.get("request_timeout_s") is not None:  # Serve's end-to-end HTTP timeout (408 beyond it)
        options["request_timeout_s"] = float(http["request_timeout_s"])
    serve.start(http_options=options)
    for app in spec["applications"]:
        module, _, attr = app["import_path"].partition(":")
        builder = getattr(importlib.import_module(module), attr)
        serve.run(builder(app.get("args", {})), name=app["name"], route_prefix=app.get("route_prefix", "/"))
        print(f"application {app['name']!r} ready at http://{host}:{port}{app.get('route_prefix', '/')}", flush=True)
    # `kill` stops it as cleanly as Ctrl-C; SIGINT too when a shell started us in the background
    # (which leaves SIGINT ignored).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
        ray.shutdown()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


# -- bench -----------------------------------------------------------------------------------------
BENCHES = {  # name -> module with `main(argv: list[str]) -> int`; its own argparse does the rest
    "http": "specserve.bench.http",
    "engine": "specserve.bench.engine",
    "gpu": "specserve.bench.gpu",
    "gpu-checks": "specserve.bench.gpu_checks",
    "plain": "specserve.bench.plain",
    "overload": "specserve.bench.overload",
    "ingress": "specserve.bench.ingress",
    "prefill": "specserve.bench.prefill",
    "ttft": "specserve.bench.ttft",
    "overlap": "specserve.bench.overlap",
    "soak": "specserve.bench.soak",
    "serve-gpu": "specserve.bench.serve_gpu",
    "features": "specserve.bench.features",
    "mix": "specserve.bench.mix",
    "cpu": "specserve.bench.cpu",
    "drafters": "specserve.bench.drafters",
    "memory": "specserve.bench.memory",
    "policy": "specserve.bench.policy",
    "acceptance": "specserve.bench.acceptance",
    "host": "specserve.bench.host",
    "qwire": "specserve.bench.qwire",
    "draws": "specserve.bench.draws",
    "grammar": "specserve.bench.grammar",
    "prediction": "specserve.bench.prediction",
    "history": "specserve.bench.history",
    "windows": "specserve.bench.windows",
}


def _bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    for name, module in BENCHES.items():
        sub.add_parser(name, help=f"python -m {module} ... (its own --help)", add_help=False)


def _bench(args: argparse.Namespace) -> int:
    """Import the benchmark only now (it may pull in torch) and hand it the rest of the command line."""
    return importlib.import_module(BENCHES[args.bench]).main(args.rest) or 0


def _distill_args(p: argparse.ArgumentParser) -> None:
    from specserve.distill.main import add_arguments

    add_arguments(p)


def _distill(args: argparse.Namespace) -> int:
    from specserve.distill.main import run

    return run(args)


COMMANDS = {  # name -> (help, add_arguments, run)
    "serve": ("serve a Ray Serve config locally (blocking)", _serve_args, _serve),
    "bench": ("benchmarks", _bench_args, _bench),
    "distill": ("train a feature head (EAGLE-style drafter) for a local causal LM", _distill_args, _distill),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_))
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    return COMMANDS[args.command][2](args)


if __name__ == "__main__":
    sys.exit(main())
