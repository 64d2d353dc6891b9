"""Child processes and loopback ports for the simulated fleet and the local S3 server.

Every child runs in its own session/process group, so stop/kill also reaches
anything it spawns, and logs to a file. Probes use urllib so devfleet itself
needs no HTTP client.
"""

from __future__ import annotations

import ctypes
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

LOOPBACK = "127.0.0.1"

_given_ports: set[int] = set()
_ports_lock = threading.Lock()


# DYN_SYSTEM_PORT is parsed as an i16 by the Dynamo runtime ("expected i16 for key
# SYSTEM_PORT"), so metrics ports must be <= 32767 -- below Linux's ephemeral range,
# which is where bind(0) picks from. Such ports are drawn from this range instead.
SYSTEM_PORT_RANGE = (20000, 32767)


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK, port_range: tuple[int, int] | None = None) -> int:
    """A currently free TCP port, never the same one twice in this process.

    The port is released before the child binds it, so a foreign process could
    grab it in between; remembering what we handed out at least avoids
    self-collisions when many ports are picked back to back. With `port_range`
    (inclusive) the port is drawn at random from that range instead of bind(0).
    """
    rng = random.Random()  # seeded from os.urandom: parallel test processes diverge
    with _ports_lock:
        for _ in range(500):
            if port_range:
                port = rng.randint(*port_range)
                if port in _given_ports or not _bindable(port, host):
                    continue
            else:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, 0))
                    port = s.getsockname()[1]
            if port not in _given_ports:
                _given_ports.add(port)
                return port
    raise RuntimeError("could not find a free port")


# Loopback probes must never go through an http_proxy from the environment.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET returning (status, body); (0, b"") when nothing answers."""
    try:
        with _opener.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read() if e.fp else b""
    except (OSError, ValueError):
        return 0, b""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Dynamo colours its logs even into files


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return _ANSI.sub("", "".join(text.splitlines(True)[-lines:]))


try:  # loaded in the parent: the child between fork and exec should do as little as possible
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


def _set_parent_death_signal() -> None:
    """In the child before exec: SIGKILL it when the parent goes away (Linux).

    Caveat (why it is opt-in): the kernel fires this when the *thread* that
    forked exits, so only use it when the fleet is started from a long-lived
    thread (e.g. the main thread of a CLI or a test session).
    """
    if _LIBC is not None:
        _LIBC.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class ManagedProcess:
    """One child process in its own session/process group, logging to a file."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ):
        self.name = name
        self.die_with_parent = die_with_parent
        self.cmd = [str(c) for c in cmd]
        self.env = dict(env)
        self.log_path = Path(log_path)
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def start(self) -> None:
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== devfleet: starting {self.name}: {' '.join(self.cmd)}\n".encode())
            log.flush()
            # start_new_session: own process group, so killpg reaches grandchildren
            # and a Ctrl-C in the parent's terminal is not delivered to it twice.
            self.popen = subprocess.Popen(
                self.cmd,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_set_parent_death_signal if self.die_with_parent else None,
            )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)  # pgid == pid thanks to start_new_session
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the whole group and reap it."""
        self.signal_group(signal.SIGKILL)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)


def stop_processes(procs: Sequence[ManagedProcess], grace: float = 8.0) -> None:
    """SIGTERM every group, wait up to `grace` seconds in total, then SIGKILL.

    The group is signalled even when the leader already exited, so stragglers it
    left behind are not orphaned.
    """
    started = [(p, p.popen) for p in procs if p.popen is not None]
    for p, _ in started:
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for _, popen in started:
        try:
            popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p, popen in started:
        p.signal_group(signal.SIGKILL)  # no-op for groups that are fully gone
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
