"""A ``hybridkv`` server in a real process for the tests: started, its stderr followed
line by line, stopped; and waits on processes that are not ours to wait for."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading

RUN_CLI = "import sys; from hybridkv.serving.cli.main import main; sys.exit(main(sys.argv[1:]))"
WAIT_S = 120.0  # a bound on each answer on a busy machine, never a pause


class Server:
    """A ``hybridkv`` server process; its stderr is read by a thread into ``lines``."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", RUN_CLI, *argv],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        ready = "routing at " if "-dp" in argv else "serving "
        address = self.wait_for_line(ready, start=True).split("http://")[1].split()[0]
        self.url = "http://" + address.removesuffix("/v1")

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()
        with self._seen:
            self.lines.append("")  # the end of its output
            self._seen.notify_all()

    def wait_for_line(self, text: str, after: int = 0, *, start: bool = False) -> str:
        """The first line from index ``after`` that holds ``text`` (or starts with it)."""

        def found() -> str | None:
            for line in self.lines[after:]:
                if line == "":
                    raise AssertionError("the server exited:\n" + "".join(self.lines[-30:]))
                if line.startswith(text) if start else text in line:
                    return line
            return None

        with self._seen:
            assert self._seen.wait_for(lambda: found() is not None, WAIT_S), "".join(self.lines)
            line = found()
        assert line is not None
        return line

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(WAIT_S)
        self._reader.join(WAIT_S)
        if self.process.stderr is not None:
            self.process.stderr.close()


def gone_within(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (not a child of ours) exits within ``timeout`` seconds:
    a wait on its pidfd, which becomes readable when it exits."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def is_free(url: str) -> bool:
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
