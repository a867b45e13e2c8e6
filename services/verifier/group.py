"""`python -m services verifier --tp N`: the verifier as a group of N ranks, one process each,
and the launcher that keeps the group up.

Rank 0 is the verifier service (it reads the verify stream, answers it, publishes the cost
profile and beats); ranks 1..N-1 follow it (`shared.model.rank_group.follow`). The launcher
starts the ranks, waits, and when any rank exits it kills the others and starts the whole group
again: a group is never repaired in place. The restarted rank 0 takes up the jobs its
predecessor left pending on the stream and holds no KV, so it answers `out_of_sync` and the
scheduler recomputes the requests (docs/reliability.md). SIGTERM or SIGINT stops rank 0 the
usual way (in-flight jobs finish), then the followers.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import signal
import sys
import time
from types import FrameType

from shared.settings import AugurySettings

log = logging.getLogger(__name__)

RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
STOP_TIMEOUT_S = 60.0


def rank_main(rank: int, size: int, init_method: str, url: str, threads: int, level: str) -> None:
    """One rank's process (the launcher's spawn target)."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("services").setLevel(level)
    if rank != 0:  # Ctrl-C reaches the whole process group: only rank 0 acts on it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from services.run import Stack, serve_until_signalled, start_verifier
    from services.runtime import resolve_models, run_async
    from shared.model.rank_group import (
        GroupRunner,
        close_rank_group,
        follow,
        init_rank_group,
        load_sharded_runner,
    )
    from shared.settings import load_settings

    if threads:
        torch.set_num_threads(threads)
    settings = load_settings()
    engine = settings.engine
    models = resolve_models(settings)
    group = init_rank_group(rank, size, init_method, engine.device)
    runner = load_sharded_runner(
        group,
        models.target,
        getattr(torch, engine.dtype),
        block_size=engine.block_size,
        kv_memory_bytes=engine.kv_memory_bytes,
        cuda_graph_max_tokens=engine.cuda_graph_max_tokens,
        cuda_graph_max_requests=engine.cuda_graph_max_requests,
    )
    if rank != 0:
        follow(runner, group)
        close_rank_group()
        return
    driver = GroupRunner(runner, group)
    driver.capture_graphs()  # every rank records the same graphs (their collectives included)

    async def serve() -> int:
        stack = Stack(settings, url)
        replica = settings.service.replica
        await start_verifier(stack, models, replica, runner=driver)  # type: ignore[arg-type]
        log.info("verifier rank group of %d running (cell %s)", size, settings.service.cell)
        return await serve_until_signalled(stack)

    code = run_async(serve())
    try:
        driver.close()
        close_rank_group()
    except Exception:  # a follower died meanwhile: the launcher ends the group anyway
        log.exception("releasing the followers failed")
        code = code or 1
    sys.exit(code)


class _Stop:
    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def run_verifier_group(
    settings: AugurySettings, url: str, size: int, *, threads: int = 0, level: str = "INFO"
) -> int:
    """Start the verifier's `size` ranks and keep them up until SIGTERM or SIGINT; returns
    rank 0's exit status then."""
    from services.runtime import read_model_config, resolve_models
    from shared.errors import UnsupportedModelError
    from shared.model.rank_group import free_port, tcp_init_method
    from shared.model.tensor_parallel import check_shardable

    try:  # refused at once, not by every restart of the group
        check_shardable(read_model_config(resolve_models(settings).target), size)
    except UnsupportedModelError as error:
        log.error("%s", error)
        return 2
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    spawn = multiprocessing.get_context("spawn")
    starts, delay = 0, RESTART_DELAY_S
    while True:
        started = time.monotonic()
        init_method = tcp_init_method(free_port())
        ranks = [
            spawn.Process(
                target=rank_main,
                args=(rank, size, init_method, url, threads, level),
                name=f"verifier-rank{rank}",
            )
            for rank in range(size)
        ]
        for process in ranks:
            process.start()
            log.info("verifier group start %d: rank %s pid %d", starts, process.name, process.pid)
        starts += 1
        while not stop.requested:
            if multiprocessing.connection.wait([p.sentinel for p in ranks], timeout=0.2):
                break
        if stop.requested:
            return _stop_group(ranks)
        for process in ranks:
            if process.exitcode is not None:
                log.error(
                    "%s (pid %d) exited with %s: restarting the whole group",
                    process.name,
                    process.pid,
                    process.exitcode,
                )
        for process in ranks:
            if process.is_alive():
                process.kill()
        for process in ranks:
            process.join()
        # a group that keeps failing at once (a broken checkpoint, a missing GPU) backs off
        lived = time.monotonic() - started
        quick = lived < MAX_RESTART_DELAY_S
        delay = min(2 * delay, MAX_RESTART_DELAY_S) if quick else RESTART_DELAY_S
        time.sleep(delay)


def _stop_group(ranks: list[multiprocessing.process.BaseProcess]) -> int:
    """SIGTERM rank 0 (it stops serving and releases the followers), then wait for all."""
    driver = ranks[0]
    if driver.is_alive():
        driver.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            log.error("%s did not stop within %.0f s: killed", process.name, STOP_TIMEOUT_S)
            process.kill()
            process.join()
    return 0 if driver.exitcode == 0 else 1
