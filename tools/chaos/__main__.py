"""`python -m tools.chaos`: replay requests through the services while killing each in turn.

    python -m tools.chaos                                   # 100 requests, every service killed
    python -m tools.chaos --kill gateway verifier drafter   # leave the scheduler alone
    python -m tools.chaos --requests 24 --max-tokens 12 --redis-url redis://127.0.0.1:6379/0
    python -m tools.chaos --drafts draft-s:2 draft-l --kill drafter:draft-s \
        --env AUGURY_SCHEDULER__DRAFT_CHOOSER=lbss     # a replica of draft-s dies under LBSS

Exits 0 when the run passed, 1 when it found a problem (see tools/chaos/report.py), 2 on bad
arguments. The table goes to stdout and, with chaos.json, to `--out`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from shared.model.model_set import DRAFT_NAMES, REPO_ROOT
from tools.chaos.cluster import SERVICES, Draft
from tools.chaos.run import ChaosConfig, recovery_settings, run_chaos

OUT = REPO_ROOT / ".cache" / "bench-chaos" / "latest"
LOGS = REPO_ROOT / ".cache" / "bench-chaos"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tools.chaos",
        description="Fault injection: SIGKILL each service in turn during an open-loop replay "
        "and check every answer against plain greedy decoding of the target.",
    )
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length cap (ids)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kill", nargs="+", default=list(SERVICES),
        help=f"kill targets in order: {', '.join(SERVICES)} or drafter:<model> (its first "
        "replica)",
    )  # fmt: skip
    p.add_argument("--first-kill-s", type=float, default=10.0, help="after the replay starts")
    p.add_argument(
        "--kill-spacing-s", type=float, default=5.0, help="after a killed service is back"
    )
    p.add_argument("--restart-after-s", type=float, default=2.0)
    p.add_argument(
        "--busy-wait-s", type=float, default=30.0, help="a due kill waits for work in flight"
    )
    p.add_argument("--hang-s", type=float, default=90.0, help="no output for this long: hung")
    p.add_argument("--connect-timeout-s", type=float, default=180.0)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--redis-url", help="an existing Redis (default: an embedded one)")
    p.add_argument("--target-dir", type=Path, help="default: SmolLM2-135M-Instruct")
    p.add_argument(
        "--drafts", nargs="+", default=[DRAFT_NAMES[0]], metavar="DRAFT[:REPLICAS]",
        help="draft models (a committed draft's name or a checkpoint directory), each with its "
        "number of drafter replicas (default 1)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads per model service")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="AUGURY_X=VALUE",
        help="a setting for every service, on top of the quick-recovery ones",
    )
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--logs", type=Path, default=LOGS, help="service logs go in a folder here")
    return p.parse_args(argv)


def parse_drafts(specs: Sequence[str]) -> tuple[Draft, ...]:
    """`name[:replicas]` each: a committed draft's name, or a checkpoint directory."""
    from shared.model.model_set import draft_dirs

    committed = draft_dirs()
    drafts = []
    for spec in specs:
        where, _, count = spec.rpartition(":") if ":" in spec else (spec, "", "1")
        if not count.isdigit() or int(count) < 1:
            raise SystemExit(f"--drafts takes DRAFT[:REPLICAS] with REPLICAS >= 1, got {spec!r}")
        path = committed.get(where) or Path(where)
        if not (path / "config.json").is_file():
            raise SystemExit(f"--drafts: {where!r} is neither a committed draft nor a checkpoint")
        drafts.append(Draft(where if where in committed else path.name, path, int(count)))
    return tuple(drafts)


def config_from(args: argparse.Namespace) -> ChaosConfig:
    from shared.model.model_set import target_dir

    settings = recovery_settings()
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("AUGURY_"):
            raise SystemExit(f"--env takes AUGURY_NAME=VALUE, got {item!r}")
        settings[name] = value
    return ChaosConfig(
        target=args.target_dir or target_dir(),
        drafts=parse_drafts(args.drafts),
        requests=args.requests,
        rate=args.rate,
        max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        seed=args.seed,
        kill=tuple(args.kill),
        first_kill_s=args.first_kill_s,
        spacing_s=args.kill_spacing_s,
        restart_after_s=args.restart_after_s,
        busy_wait_s=args.busy_wait_s,
        hang_s=args.hang_s,
        connect_timeout_s=args.connect_timeout_s,
        start_timeout_s=args.start_timeout_s,
        redis_url=args.redis_url,
        threads=args.threads,
        settings=settings,
        logs=args.logs,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run_chaos(config_from(args))
    except ValueError as error:  # a kill target that names no service or draft
        print(f"chaos run: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # the services did not start
        print(f"chaos run failed: {error}", file=sys.stderr)
        return 1
    report.write(args.out)
    sys.stdout.write(report.markdown())
    print(f"written to {args.out}", file=sys.stderr)
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
