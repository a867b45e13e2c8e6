"""A tensor-parallel target as a group of ranks on torch.distributed: rank 0 drives, the others
follow.

Every rank loads the target, keeps its shard (`shared.model.tensor_parallel`) and builds its own
`ModelRunner`, whose paged KV cache holds the rank's KV heads. Rank 0 hands its callers a
`GroupRunner`: each call that changes the runner's state (add or free a request, a forward, a
commit, a swap, graph capture; any method not known to be read-only) is first broadcast to the
other ranks, which make the same call on their own runner (`follow`). The runners then stay in
step by construction: the same calls in the same order give the same block tables, the same
packed batch and the same collectives inside the forward. The broadcast carries a step's packed
batch as its description (token ids, tree parents, which rows to return); each rank lays it
out, which also mirrors every KV move a commit, a swap or a later cache feature makes without a
message of its own. Acceptance and sampling happen once, on rank 0, from the logits the vocab
head gathered.

Two process groups: the forward's collectives run on the device's backend (NCCL on CUDA, gloo on
a CPU); the control messages always on a gloo group with no practical timeout, since a follower
waits there for as long as the service is idle.

A rank that dies breaks its peers' next collective: a group is restarted as a whole (the
verifier's launcher, `services/verifier/group.py`), never repaired.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from shared.errors import AuguryError
from shared.model.kv_cache import SwappedKV
from shared.model.runner import ModelRunner
from shared.model.tensor_parallel import shard_model

log = logging.getLogger(__name__)

# Runner methods that change nothing: answered by rank 0 alone.
READ_ONLY = frozenset({"has_request", "num_cached", "tree_size", "blocks_needed"})
STOP = "__stop__"
GROUP_FAILED_EXIT = 70  # rank 0's exit status when the group broke under a call
# A follower waits on the control group while the service is idle: no timeout in practice.
CONTROL_TIMEOUT = timedelta(days=365)
COMPUTE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class RankGroup:
    rank: int
    size: int
    device: torch.device
    compute: dist.ProcessGroup | None  # None: the default group (the forward's collectives)
    control: dist.ProcessGroup  # gloo: the runner calls rank 0 broadcasts

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> torch.device:
    """A CUDA rank takes GPU `rank` of those it sees (CUDA_VISIBLE_DEVICES picks a cell's)."""
    if torch.device(device).type == "cuda":
        return torch.device("cuda", rank)
    return torch.device(device)


def init_rank_group(rank: int, size: int, init_method: str, device: str) -> RankGroup:
    """Join the group of `size` ranks at `init_method` ("tcp://host:port", "env://" under
    torchrun): NCCL for the forward on CUDA, gloo on a CPU; gloo for control either way."""
    dev = rank_device(device, rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=COMPUTE_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return RankGroup(rank, size, dev, None, control)


def close_rank_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def load_sharded_runner(
    group: RankGroup, path: str | Path, dtype: torch.dtype, **runner_options: Any
) -> ModelRunner:
    """Every rank: the target loaded on the host, sharded, its share moved to the rank's device,
    then the rank's runner. Ranks load one after another, so a host holds one whole checkpoint
    at a time (a 70B bf16 target: 140 GB) beside the shards."""
    from shared.model import load_model

    model = None
    for turn in range(group.size):
        if turn == group.rank:
            model = shard_model(
                load_model(path, dtype=dtype, device="cpu"), group.rank, group.size, group.compute
            )
            model = model.to(group.device)
            model.init_rope(group.device)
        dist.barrier(group=group.control)
    assert model is not None
    return ModelRunner(model, **runner_options)


class GroupRunner:
    """Rank 0's runner: a `ModelRunner` whose state-changing calls every rank makes alike.
    A call that fails other than with a client error ends this process (`_fail`).

    Attributes (the model, the cache) and read-only methods are the local runner's; `close()`
    releases the followers.
    """

    def __init__(self, runner: ModelRunner, group: RankGroup) -> None:
        if not group.is_driver:
            raise ValueError("only rank 0 drives a group")
        self.runner, self.group = runner, group
        # requests swapped out by every rank: each follower keeps its own share of the KV
        self._swapped: dict[str, SwappedKV] = {}
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.runner, name)
        if name.startswith("_") or name in READ_ONLY or not inspect.ismethod(value):
            return value
        return self._forwarded(name, value)

    def _forwarded(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._closed:
                raise RuntimeError("the rank group is closed")
            message = (name, self._outgoing(name, args), kwargs)
            try:
                self._broadcast(message)
                result = method(*args, **kwargs)
            except (AuguryError, ValueError):
                raise  # a client error: every rank raised it alike and stays in step
            except Exception as error:
                self._fail(name, error)
            if name == "swap_out":
                self._swapped[args[0]] = result
            elif name == "free_request":
                self._swapped.pop(args[0], None)
            return result

        return call

    def _fail(self, name: str, error: Exception) -> NoReturn:
        """A collective failed (a peer died) or rank 0 alone failed after the followers made the
        call: the ranks are out of step. Exit at once, answering nothing (a verifier would
        otherwise fail the step's requests), so that the launcher restarts the whole group and
        the scheduler recomputes what it held."""
        log.critical(
            "rank group: %s failed (%r); rank 0 exits with status %d so that the group restarts",
            name,
            error,
            GROUP_FAILED_EXIT,
        )
        logging.shutdown()
        os._exit(GROUP_FAILED_EXIT)

    def _outgoing(self, name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A swap-in names KV every rank swapped out: followers use their own share."""
        if name != "swap_in":
            return args
        request_id, swapped = args
        if self._swapped.pop(request_id, None) is swapped:
            return (request_id, None)
        if swapped.k.count_nonzero() or swapped.v.count_nonzero():
            raise ValueError("a rank group swaps in only KV it swapped out itself (or zeros)")
        return (request_id, tuple(swapped.k.shape))  # zeros of that shape (profiling)

    def _broadcast(self, message: tuple[Any, ...]) -> None:
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group.control)

    def close(self) -> None:
        """Release the followers (they return from `follow`)."""
        if not self._closed:
            self._closed = True
            self._broadcast((STOP, (), {}))


def follow(runner: ModelRunner, group: RankGroup) -> None:
    """A follower rank: make each call rank 0 broadcasts on the local runner, until it stops.

    A call that raises an `AuguryError` or `ValueError` (a bad request, no free KV) raised the
    same on rank 0, which answers it; the ranks stay in step. Anything else ends the rank and,
    through the launcher, the group."""
    swapped: dict[str, SwappedKV] = {}
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group.control)
        name, args, kwargs = box[0]
        if name == STOP:
            return
        if name == "swap_in":
            request_id, shape = args
            kv = swapped.pop(request_id) if shape is None else _zeros(runner, shape)
            args = (request_id, kv)
        try:
            result = getattr(runner, name)(*args, **kwargs)
        except (AuguryError, ValueError) as error:
            log.debug("rank %d: %s raised %r, as on rank 0", group.rank, name, error)
            continue
        if name == "swap_out":
            swapped[args[0]] = result
        elif name == "free_request":
            swapped.pop(args[0], None)


def _zeros(runner: ModelRunner, shape: tuple[int, ...]) -> SwappedKV:
    zeros = torch.zeros(shape, dtype=runner.dtype)
    return SwappedKV(k=zeros, v=zeros)


def tcp_init_method(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, size) when started by torchrun (its RANK and WORLD_SIZE variables), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _follower_main(
    rank: int,
    size: int,
    init_method: str,
    path: str,
    dtype: str,
    device: str,
    threads: int,
    runner_options: dict[str, Any],
) -> None:
    if threads:
        torch.set_num_threads(threads)
    group = init_rank_group(rank, size, init_method, device)
    try:
        follow(load_sharded_runner(group, path, getattr(torch, dtype), **runner_options), group)
    finally:
        close_rank_group()


@dataclass
class LocalGroup:
    """A rank group whose rank 0 is this process (`start_local_group`)."""

    runner: GroupRunner
    followers: list[Any]

    def close(self) -> None:
        try:
            self.runner.close()
            close_rank_group()
        finally:
            for process in self.followers:
                process.join(30)
                if process.is_alive():
                    process.kill()
                    process.join()


def start_local_group(
    path: str | Path,
    size: int,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int = 0,
    **runner_options: Any,
) -> LocalGroup:
    """This process as rank 0 of `size` ranks, the followers spawned here (`augury generate
    --tp N`, benchmarks). A follower that dies makes rank 0's next forward raise."""
    import multiprocessing

    init_method = tcp_init_method(free_port())
    spawn = multiprocessing.get_context("spawn")
    followers = [
        spawn.Process(
            target=_follower_main,
            args=(rank, size, init_method, str(path), dtype, device, threads, runner_options),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for process in followers:
        process.start()
    try:
        group = init_rank_group(0, size, init_method, device)
        runner = load_sharded_runner(group, path, getattr(torch, dtype), **runner_options)
    except BaseException:
        for process in followers:
            process.kill()
        raise
    return LocalGroup(GroupRunner(runner, group), followers)
