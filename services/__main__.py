"""`python -m services all|scheduler|verifier|drafter|gateway`: see services/run.py."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from services.run import SERVICES, serve_until_signalled, start_one, start_stack
from services.runtime import resolve_models, run_async
from shared.bus import redis_url
from shared.settings import AugurySettings, SettingsError, load_settings, redacted_url


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m services",
        description="Run Augury's services over Redis (settings from AUGURY_* variables).",
    )
    parser.add_argument("service", choices=("all", "health", *SERVICES))
    parser.add_argument(
        "probe", nargs="?", choices=SERVICES, help="health: the service to probe on this host"
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
    return parser.parse_args(argv)


async def run(args: argparse.Namespace, settings: AugurySettings, url: str) -> int:
    models = resolve_models(settings)
    if args.service == "all":
        stack = await start_stack(
            settings, url, models, gateway=not args.no_gateway, drafts=args.drafts
        )
    else:
        stack = await start_one(settings, url, models, args.service, args.name)
    logging.getLogger("services").info(
        "%s running (cell %s, redis %s)", args.service, settings.service.cell, redacted_url(url)
    )
    return await serve_until_signalled(stack)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("services").setLevel(args.log_level)
    try:
        settings = load_settings()
    except SettingsError as error:
        print(error)
        return 2
    if args.service == "health":
        from services.health import healthy

        if args.probe is None:
            print("health needs the service to probe, e.g. `python -m services health verifier`")
            return 2
        return 0 if healthy(settings, args.probe) else 1
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

            return run_verifier_group(
                settings, url, tp, threads=args.threads, level=args.log_level
            )
        return run_async(run(args, settings, url))


if __name__ == "__main__":
    raise SystemExit(main())
