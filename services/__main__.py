"""`python -m services all|scheduler|verifier|drafter|gateway`: see services/run.py.

`python -m services health [--live] SERVICE` probes a service on this host (services/health.py);
it imports nothing that imports torch, so it answers in well under a second.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from services.health import SERVICE_NAMES
from shared.settings import AugurySettings, SettingsError, load_settings, redacted_url

if TYPE_CHECKING:
    from services.run import Stack

PASSWORD_FILE_VARIABLE = "REDIS_PASSWORD_FILE"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m services",
        description="Run Augury's services over Redis (settings from AUGURY_* variables).",
    )
    parser.add_argument("service", choices=("all", "health", *SERVICE_NAMES))
    parser.add_argument(
        "probe",
        nargs="?",
        choices=("all", *SERVICE_NAMES),
        help="health: the service to probe on this host",
    )
    parser.add_argument(
        "--live",
        action="store_true",
        help="health: liveness (the process's event loop runs) instead of readiness",
    )
    parser.add_argument("--name", help="drafter: the draft model this replica serves")
    parser.add_argument(
        "--drafts",
        nargs="*",
        help="all: the draft models to start a drafter for (default: every configured one)",
    )
    parser.add_argument("--no-gateway", action="store_true", help="all: no HTTP gateway")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument(
        "--tp",
        type=int,
        help="verifier: ranks (GPUs) the target is split over, one process each "
        "(default: engine.tensor_parallel_size)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="DEBUG adds the scheduler's per-micro-batch timings (draft, verify, whole step)",
    )
    return parser.parse_intermixed_args(argv)


async def run(args: argparse.Namespace, settings: AugurySettings, url: str) -> int:
    from services.health import keep_alive
    from services.run import serve_until_signalled

    # liveness from the start: a model service loading its weights is alive, not yet ready
    names = ("all", *SERVICE_NAMES) if args.service == "all" else (args.service,)
    touching = [asyncio.create_task(keep_alive(name), name=f"alive-{name}") for name in names]
    try:
        stack = await start_unless_signalled(args, settings, url)
        if stack is None:
            return 0
        logging.getLogger("services").info(
            "%s running (cell %s, redis %s)", args.service, settings.service.cell, redacted_url(url)
        )
        return await serve_until_signalled(stack)
    finally:
        for task in touching:
            task.cancel()
        await asyncio.gather(*touching, return_exceptions=True)


async def start_unless_signalled(
    args: argparse.Namespace, settings: AugurySettings, url: str
) -> Stack | None:
    """Start the services; None when SIGTERM or SIGINT came first (a stop during a long model
    load or profile measurement is a clean exit, not a kill)."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    starting = asyncio.create_task(start(args, settings, url), name="start")
    signalled = asyncio.create_task(stopping.wait(), name="start-signalled")
    try:
        await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        signalled.cancel()
    if starting.done():
        return starting.result()
    logging.getLogger("services").info("stopped while starting")
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)
    return None


async def start(args: argparse.Namespace, settings: AugurySettings, url: str) -> Stack:
    from services.run import start_one, start_stack
    from services.runtime import resolve_models

    models = resolve_models(settings)
    if args.service == "all":
        return await start_stack(
            settings, url, models, gateway=not args.no_gateway, drafts=args.drafts
        )
    return await start_one(settings, url, models, args.service, args.name)


def probe(args: argparse.Namespace, settings: AugurySettings) -> int:
    from services.health import alive, ready

    if args.live:  # without a service: any Augury service process on this host
        return 0 if alive(args.probe or "*") else 1
    if args.probe is None:
        print("health needs the service to probe, e.g. `python -m services health verifier`")
        return 2
    # `all` is ready when its scheduler and verifier are (the gateway is optional there)
    probes = ("scheduler", "verifier") if args.probe == "all" else (args.probe,)
    return 0 if all(ready(settings, name) for name in probes) else 1


def read_password_file() -> None:
    """`REDIS_PASSWORD_FILE` (a Docker secret's path): its content becomes the Redis password
    unless `AUGURY_REDIS__PASSWORD` is set, so the password is in no command line and in no
    container's configuration."""
    path = os.environ.get(PASSWORD_FILE_VARIABLE)
    if path and not os.environ.get("AUGURY_REDIS__PASSWORD"):
        os.environ["AUGURY_REDIS__PASSWORD"] = Path(path).read_text().strip()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("services").setLevel(args.log_level)
    try:
        read_password_file()
        settings = load_settings()
    except OSError as error:
        print(f"could not read {PASSWORD_FILE_VARIABLE}: {error}")
        return 2
    except SettingsError as error:
        print(error)
        return 2
    if args.service == "health":
        return probe(args, settings)
    from services.runtime import run_async
    from shared.bus import redis_url

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    tp = args.tp or settings.engine.tensor_parallel_size
    if tp > 1 and args.service != "verifier":
        print(
            f"a tensor-parallel target ({tp} ranks) runs as its own verifier group: start it with "
            "`python -m services verifier --tp N` and the other services without it"
        )
        return 2
    with redis_url(settings.redis) as url:
        if tp > 1:
            from services.verifier.group import run_verifier_group

            return run_verifier_group(settings, url, tp, threads=args.threads, level=args.log_level)
        return run_async(run(args, settings, url))


if __name__ == "__main__":
    raise SystemExit(main())
