"""Replay a trace against a running server, export recorded traffic, compare runs.

    python -m tools.replay run --trace TRACE --base-url http://127.0.0.1:8000 --out runs/a \\
        [--rate-scale 2] [--duration 60] [--max-requests 500] [--label a] [--target DIR]
    python -m tools.replay export --redis redis://host:6379/0 --out recorded.jsonl [--count N]
    python -m tools.replay compare runs/a runs/b [--out runs/a-vs-b]

TRACE is a trace file (`.jsonl`, Azure `.csv`, ShareGPT `.json` with `--rate`; see
`tools/load/readers.py`) or the traffic the gateways recorded (`AUGURY_GATEWAY__RECORD_REQUESTS`),
named by a Redis URL with the stream as a query parameter:

    redis://host:6379/0?stream=augury:{0}:recorded
    unix:///run/redis.sock?db=0&stream=augury:{0}:recorded

Without `stream`, the stream is `augury:<cell>:recorded` of `AUGURY_SERVICE__CELL` (default 0).
Requests that give only lengths get prompts of those lengths, built from the datasets with the
tokenizer of `--target` (default: SmolLM2-135M-Instruct). `run` waits until the server's
`/health` answers 200, replays open-loop (`tools/load/client.py`), writes the report
(`report.json`, `report.md`, `records.jsonl`, plots) into `--out` and prints its tables.

Bad input (no such trace, a malformed trace, an unreachable server or Redis) ends with one line
on stderr and exit code 2. A run where requests failed still writes its report (failures counted
by reason) and then exits with code 1, naming the most frequent reasons on stderr;
`--allow-failures` makes it exit 0 (fault tests that expect some failures).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from redis.exceptions import RedisError

from shared.settings import redacted_url
from tools.load.client import ReplayError, api_root, replay
from tools.load.recording import is_redis_url, read_recorded, split_trace_url
from tools.load.trace import TraceError, TraceRequest

REQUESTS_FAILED = 1
BAD_INPUT = 2
HEALTH_POLL_S = 0.25


class CLIError(Exception):
    """Bad input: printed as one line, exit code 2."""


# ---- the pieces ------------------------------------------------------------------------------
def default_stream() -> str:
    from shared.settings import SettingsError, load_settings
    from shared.wire.streams import recorded_stream

    try:
        return recorded_stream(load_settings().service.cell)
    except SettingsError as error:
        raise CLIError(str(error).replace("\n", " ")) from None


def read_recording(url: str, stream: str | None, count: int | None = None) -> list[TraceRequest]:
    redis_url, in_url = split_trace_url(url)
    name = stream or in_url or default_stream()
    try:
        return read_recorded(redis_url, name, count=count)
    except (RedisError, OSError, ValueError) as error:  # ValueError: a malformed URL
        where = redacted_url(redis_url)
        raise CLIError(f"could not read the recording {name} at {where}: {error}") from None


def load_trace(trace: str, *, rate: float | None, seed: int) -> list[TraceRequest]:
    """A trace file's requests, or a recording's when `trace` is a Redis URL."""
    if is_redis_url(trace):
        return read_recording(trace, None)
    from tools.load.readers import read_trace

    path = Path(trace)
    if not path.is_file():
        raise CLIError(f"trace file not found: {path}")
    return read_trace(path, rate=rate, seed=seed)


def fill_prompts(
    requests: list[TraceRequest], target: Path | None, seed: int
) -> list[TraceRequest]:
    """Requests without text get a dataset prompt of their input length (target's tokenizer)."""
    if all(r.prompt is not None or r.messages is not None for r in requests):
        return requests
    from transformers import AutoTokenizer

    from tools.load.prompts import PromptBuilder

    if target is None:
        from shared.model.smollm2 import ensure_smollm2

        target = ensure_smollm2()
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as error:
        raise CLIError(f"could not load the tokenizer of {target}: {error}") from None
    try:
        return PromptBuilder(tokenizer, seed=seed).fill(requests)
    except ValueError as error:  # TraceError among them: a length no prompt can have
        raise CLIError(f"could not build prompts: {error}") from None


async def wait_until_healthy(base_url: str, timeout_s: float) -> None:
    """Poll GET /health until it answers 200; CLIError after `timeout_s`."""
    url = f"{api_root(base_url)}/health"
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
                    last = f"HTTP {response.status}"
            except (aiohttp.ClientError, OSError, TimeoutError) as error:
                last = str(error) or type(error).__name__
            if time.monotonic() >= deadline:
                raise CLIError(
                    f"the server is not ready: GET {url} gave {last} for {timeout_s:g} s"
                )
            await asyncio.sleep(HEALTH_POLL_S)


# ---- commands --------------------------------------------------------------------------------
def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from tools.load.report import REPORT_MD, write_report

    requests = load_trace(args.trace, rate=args.rate, seed=args.seed)
    if not requests:
        raise CLIError(f"the trace {args.trace} holds no requests")
    requests = fill_prompts(requests, args.target, args.seed)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")

    async def serve() -> list[Any]:
        await wait_until_healthy(args.base_url, args.health_timeout)
        return await replay(
            requests,
            args.base_url,
            rate_scale=args.rate_scale,
            duration_s=args.duration,
            max_requests=args.max_requests,
            model=args.model,
            api_key=args.api_key,
            request_timeout_s=args.request_timeout,
            show_progress=not args.no_progress,
        )

    records = asyncio.run(serve())
    meta = {
        "command": shlex.join(["python", "-m", "tools.replay", *argv]),
        "trace": args.trace,
        "rate_scale": args.rate_scale,
        "label": args.label,
        "base_url": args.base_url,
        "started_at": started_at,
    }
    summary = write_report(args.out, records, meta=meta, plots=not args.no_plots)
    print((args.out / REPORT_MD).read_text())
    if summary["failed"] and not args.allow_failures:
        reasons = "; ".join(
            f"{n} x {reason}" for reason, n in list(summary["failures_by_reason"].items())[:3]
        )
        print(
            f"tools.replay: {summary['failed']} of {summary['requests']} requests failed: "
            f"{reasons} (all in {args.out / REPORT_MD})",
            file=sys.stderr,
        )
        return REQUESTS_FAILED
    return 0


def export(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from tools.load.readers import write_trace

    requests = read_recording(args.redis, args.stream, args.count)
    write_trace(args.out, requests)
    print(f"{len(requests)} requests written to {args.out}")
    return 0


def compare_runs(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from tools.load.compare import compare

    try:
        print(compare(args.dirs, args.out), end="")
    except ValueError as error:  # a directory without a (valid) report
        raise CLIError(str(error)) from None
    return 0


# ---- the command line ------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m tools.replay",
        description="Replay traces against a server, export recorded traffic, compare runs.",
    )
    commands = top.add_subparsers(dest="command", required=True)

    r = commands.add_parser("run", help="replay a trace open-loop and write a report")
    r.set_defaults(handler=run)
    r.add_argument(
        "--trace",
        required=True,
        metavar="PATH|URL",
        help="a trace file, or redis://...?stream=NAME",
    )
    r.add_argument(
        "--base-url", required=True, metavar="URL", help="the server, e.g. http://127.0.0.1:8000"
    )
    r.add_argument("--out", type=Path, required=True, metavar="DIR", help="the report's directory")
    r.add_argument(
        "--rate-scale", type=positive_float, default=1.0, metavar="X", help="x2: twice as fast"
    )
    r.add_argument(
        "--duration", type=positive_float, metavar="S", help="stop sending after S seconds"
    )
    r.add_argument("--max-requests", type=positive_int, metavar="N", help="send at most N requests")
    r.add_argument(
        "--target", type=Path, metavar="DIR", help="tokenizer for built prompts (default SmolLM2)"
    )
    r.add_argument("--label", help="the run's name in reports and comparisons")
    r.add_argument("--api-key", metavar="KEY", help="sent as Authorization: Bearer KEY")
    r.add_argument(
        "--model", metavar="NAME", help="the model to ask for (default: the server's first)"
    )
    r.add_argument(
        "--rate", type=positive_float, metavar="R", help="requests/s of a ShareGPT trace"
    )
    r.add_argument("--seed", type=int, default=0, help="for arrivals and built prompts")
    r.add_argument(
        "--request-timeout",
        type=positive_float,
        default=600.0,
        metavar="S",
        help="a request without its whole answer after S seconds fails (default 600)",
    )
    r.add_argument(
        "--health-timeout",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="wait at most S seconds for GET /health to answer 200 (default 60)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--no-plots", action="store_true", help="no PNG plots in the report")
    r.add_argument(
        "--allow-failures",
        action="store_true",
        help="exit 0 even when requests failed (default: exit 1)",
    )

    e = commands.add_parser("export", help="write recorded traffic as a JSONL trace")
    e.set_defaults(handler=export)
    e.add_argument(
        "--redis", required=True, metavar="URL", help="redis://host:6379/0 (or unix://...)"
    )
    e.add_argument(
        "--stream", metavar="NAME", help="default: ?stream= of the URL, else augury:<cell>:recorded"
    )
    e.add_argument(
        "--out", type=Path, required=True, metavar="PATH", help="the .jsonl file to write"
    )
    e.add_argument(
        "--count", type=positive_int, metavar="N", help="the first N recorded requests only"
    )

    c = commands.add_parser("compare", help="compare the reports of several runs")
    c.set_defaults(handler=compare_runs)
    c.add_argument("dirs", type=Path, nargs="+", help="run directories (tools.replay run --out)")
    c.add_argument(
        "--out", type=Path, metavar="DIR", help="also write compare.md and compare.png here"
    )
    return top


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        return int(args.handler(args, argv))
    except (CLIError, TraceError, ReplayError) as error:
        message = " ".join(str(error).split())  # one line, whatever the message held
        print(f"tools.replay: error: {message}", file=sys.stderr)
    return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
