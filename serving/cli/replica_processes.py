"""The replica processes of ``serve --data-parallel-size``: started, watched, restarted
and stopped.

::

    start()      one ``hybridkv serve`` process per replica; each watches this process
                 (parallel/parent_watch.py), so a SIGKILLed front end leaves none behind
    watcher(r)   a task per replica: its exit takes it out of rotation at once (logged
                 once); with --restart-replicas it is started again, and back in
                 rotation once it answers /health
    stop()       SIGTERM to every replica, SIGKILL to any still running STOP_GRACE_S
                 later (its own workers watch it, and end with it)

A replica that keeps exiting before it serves is restarted after a pause that doubles
from 1 s to 30 s, so a replica that cannot start does not spin.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from hybridkv.errors import HybridKVError
from hybridkv.errors.events import get_logger
from hybridkv.parallel.parent_watch import PARENT_PID_VARIABLE
from hybridkv.serving.cli.flags.serve import API_KEY_ENV

log = get_logger(__name__)

_START = "import sys; from hybridkv.serving.cli.main import main; sys.exit(main())"
#: Seconds every replica is given to stop, all together, before it is killed.
STOP_GRACE_S = 8.0
#: The first and the longest pause before restarting a replica that exited.
RESTART_PAUSE_S = (1.0, 30.0)


class ReplicaStartError(HybridKVError):
    """A replica exited before it served."""


class ReplicaProcesses:
    """One ``hybridkv serve`` process per command line, the front end's children.

    Args:
        command_lines: Each replica's ``serve`` arguments.
        restart: Start a replica again when its process exits (``--restart-replicas``).
        api_key: The key every replica requires, passed in its environment
            (``HYBRIDKV_API_KEY``), so that no process listing shows it.
    """

    def __init__(
        self, command_lines: Sequence[Sequence[str]], *, restart: bool, api_key: str | None
    ) -> None:
        self.command_lines = [list(line) for line in command_lines]
        self.restart = restart
        self.api_key = api_key
        self.processes: list[subprocess.Popen[bytes]] = []
        self._is_stopping = False

    def start(self) -> None:
        """Start every replica (none waits for another)."""
        self.processes = [self._spawn(line) for line in self.command_lines]

    def _spawn(self, line: Sequence[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, PARENT_PID_VARIABLE: str(os.getpid())}
        env.pop(API_KEY_ENV, None)  # the front end's own, if it came from there
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key
        return subprocess.Popen([sys.executable, "-c", _START, *line], env=env)

    async def until_serving(self, routed: Any) -> None:
        """Probe until every replica serves; a replica whose process exits first fails
        it (its own log, above, says why)."""
        for rank in range(len(self.processes)):
            await self._until_serving(routed, rank)

    async def _until_serving(self, routed: Any, rank: int) -> None:
        import anyio

        replica = list(routed.replicas.values())[rank]
        process = self.processes[rank]
        delay = 0.05
        while not replica.healthy:
            code = process.poll()
            if code is not None:
                raise ReplicaStartError(
                    f"replica {replica.name} (pid {process.pid}) exited with code {code} "
                    "before it served; its log above says why"
                )
            await routed.probe(replica)
            if not replica.healthy:
                await anyio.sleep(delay)  # a poll of a starting process, not a test's wait
                delay = min(1.0, delay * 2)

    def watcher(self, rank: int) -> Any:
        """A companion task of the front end for replica ``rank``: out of rotation as
        soon as its process exits; restarted if asked."""

        async def watch(routed: Any) -> None:
            import anyio

            replica = list(routed.replicas.values())[rank]
            pause = RESTART_PAUSE_S[0]
            while True:
                process = self.processes[rank]
                code = await anyio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
                if self._is_stopping:
                    return
                routed.mark_down(
                    replica, f"its process (pid {process.pid}) exited with code {code}"
                )
                if not self.restart:
                    return
                await anyio.sleep(pause)  # a replica that cannot start must not spin
                new = self._spawn(self.command_lines[rank])
                self.processes[rank] = new
                replica.pid = new.pid
                log.warning("replica_restarted", replica=replica.name, pid=new.pid, exit_code=code)
                try:
                    await self._until_serving(routed, rank)
                    pause = RESTART_PAUSE_S[0]
                except ReplicaStartError as exc:
                    log.error("replica_restart_failed", replica=replica.name, reason=str(exc))
                    pause = min(RESTART_PAUSE_S[1], pause * 2)

        return watch

    def stop(self) -> None:
        """SIGTERM every replica (as Ctrl-C, it stops its own workers), then SIGKILL
        what still runs :data:`STOP_GRACE_S` seconds later."""
        self._is_stopping = True
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("replica_killed", pid=process.pid, grace_s=STOP_GRACE_S)
                process.kill()
                process.wait()
