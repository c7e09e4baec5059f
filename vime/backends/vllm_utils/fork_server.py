"""Start servers by forking them from a process that has imported them once.

Most of a CPU engine's start is Python importing vLLM's OpenAI server (8 of a tiny engine's ~12 CPU-s with bytecode
caches, 19 of ~22 without: torch, torch._dynamo, FastAPI, vLLM). ``python -m vime.backends.vllm_utils.fork_server SOCKET [MODULE]...`` imports the
``MODULE``\\ s once, then serves requests on the Unix socket ``SOCKET``: for each one it forks a process guard in a
session of its own (:func:`.process_guard.supervise`: the server dies with the process that asked for it, and the
group is ended when it stops), and the guard forks ``python -m MODULE ARGS...`` from the imports already in memory.

With ``VIME_FORK_SERVER=SOCKET`` in the environment, :class:`~.engine.ServerProcess` starts its ``python -m MODULE``
commands (vLLM's server on CPU: :mod:`.cpu_server`) through the fork server; the test suite does, each engine start
then costs 5 CPU-s instead of 12. The fork server exits when the process that started it dies.

A forked process's ``/proc/PID/environ`` is empty (the fork server gives that room to the process titles): the
environment each guard was given is in ``SOCKET.envs/PID.json`` while it runs (:func:`environ_of` reads it).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, NoReturn

import psutil

from vime.backends.vllm_utils import process_guard
from vime.utils.reaper import term_on_parent_death

SOCKET_ENV = "VIME_FORK_SERVER"
MAX_MESSAGE = 1 << 20  # one request: the command, its environment and working directory as JSON


def forkable(command: Sequence[str]) -> bool:
    """Whether ``command`` is a ``python -m MODULE`` of this interpreter and a fork server is set."""
    return (
        bool(os.environ.get(SOCKET_ENV)) and len(command) > 2 and list(command[:2]) == [sys.executable, "-m"]
    )


class ForkedProcess:
    """A guard the fork server forked for this process, with the part of :class:`subprocess.Popen` a server needs:
    ``pid``, ``returncode``, :meth:`poll` and :meth:`wait` (the fork server reports the exit on the connection)."""

    def __init__(self, connection: socket.socket, pid: int):
        self._connection = connection
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                message = self._connection.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            # no message: the fork server died, and its orphans' exit statuses went to init
            self.returncode = json.loads(message)["exit"] if message else 255
            self._connection.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"fork server child {self.pid}", timeout)
            select.select([self._connection], [], [], left)
        return self.returncode


def start(command: Sequence[str], env: Mapping[str, str], stdout: IO) -> ForkedProcess:
    """Have the fork server at ``$VIME_FORK_SERVER`` run ``command`` (``python -m MODULE ARGS...``) in ``env`` and
    the current directory, its output to ``stdout``, guarded to die with this process."""
    path = os.environ[SOCKET_ENV]
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(path)
        request = {
            "module": command[2], "argv": list(command[3:]), "env": dict(env), "cwd": os.getcwd(),
            "launcher": os.getpid(), "title": shlex.join(command),
        }  # fmt: skip
        socket.send_fds(connection, [json.dumps(request).encode()], [stdout.fileno()])
        reply = json.loads(
            connection.recv(MAX_MESSAGE) or b'{"error": "the fork server closed the connection"}'
        )
    except OSError as exc:
        connection.close()
        raise RuntimeError(f"the fork server at {path} ({SOCKET_ENV}) cannot be reached: {exc}") from exc
    if "error" in reply:
        connection.close()
        raise RuntimeError(f"the fork server at {path} refused {shlex.join(command)}: {reply['error']}")
    return ForkedProcess(connection, reply["pid"])


def environ_of(proc: psutil.Process) -> dict[str, str]:
    """The environment ``proc`` runs in: its ``/proc/PID/environ``, or for a process that this process's fork server
    (``$VIME_FORK_SERVER``) forked (a guard, its server and the server's children: the guard's process group) the
    environment the guard was given (their ``/proc/PID/environ`` is empty: the fork server gives its room to the
    process titles)."""
    if path := os.environ.get(SOCKET_ENV):
        try:
            return json.loads(Path(f"{path}.envs/{os.getpgid(proc.pid)}.json").read_text())
        except (OSError, ValueError):  # not forked, or just ended
            pass
    return proc.environ()


def command_of(proc: psutil.Process) -> list[str]:
    """``proc``'s command line as a list, also for a forked server (whose title is the command in one string)."""
    words = [word for word in proc.cmdline() if word]
    return words[0].split() if len(words) == 1 else words


class _ForkedModule:
    """``python -m MODULE ARGV...`` forked from this process, as :class:`.process_guard.Child`."""

    def __init__(self, module: str, argv: list[str], title: str):
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            _run_module(module, argv, title)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass


def _run_module(module: str, argv: list[str], title: str) -> NoReturn:
    """Run ``module`` as ``__main__`` with ``argv`` in this (forked) process, named ``title``; exit with its code."""
    code = 1
    try:
        term_on_parent_death()  # the guard's death ends the server, as a Popen'ed one under the guard
        if setproctitle := _title_setter():
            setproctitle(title)  # ps and psutil show the command, not the fork server's
        warnings.filterwarnings(
            "ignore", "'.*' found in sys.modules after import", RuntimeWarning
        )  # preloaded
        sys.argv = [module, *argv]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _guard(request: dict, log_fd: int, inherited: list[socket.socket]) -> NoReturn:
    """The forked guard: in a session of its own, with the request's output, directory and environment, run the
    module under :func:`.process_guard.supervise` until it exits or the launcher dies."""
    code = 1
    try:
        for sock in inherited:
            sock.close()
        os.setsid()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        launcher = os.pidfd_open(request["launcher"])
        watchdog = process_guard.start_watchdog()
        code = process_guard.supervise(
            lambda: _ForkedModule(request["module"], request["argv"], request["title"]),
            watchdog,
            lambda: bool(select.select([launcher], [], [], 0)[0]),
        )
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _title_setter() -> Callable[[str], None] | None:
    """``setproctitle.setproctitle`` (vLLM's own dependency), set up; None without it. Set up before the first fork:
    it takes its room from this process's original arguments and environment, which a fork's new environment
    leaves unlocatable."""
    try:
        import setproctitle
    except ImportError:
        return None
    setproctitle.getproctitle()
    return setproctitle.setproctitle


def start_server(
    path: str | Path, preload: Sequence[str] = (), env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.Popen:
    """Start a fork server listening on ``path`` (``preload``: modules it imports first) and wait for its socket;
    ``RuntimeError`` if it exits or is not listening within ``timeout`` seconds."""
    server = subprocess.Popen([sys.executable, "-m", __name__, str(path), *preload], env=env)
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"the fork server on {path} did not start (exit code {server.poll()})")
        time.sleep(0.05)
    return server


def serve(path: str, preload: Sequence[str]) -> NoReturn:
    """Import ``preload``, then fork a guarded server for each request on ``path`` until the parent dies."""
    term_on_parent_death()
    _title_setter()
    for module in preload:
        importlib.import_module(module)
    envs = Path(f"{path}.envs")
    envs.mkdir(exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    Path(path).unlink(missing_ok=True)
    listener.bind(path)
    listener.listen(16)
    clients: dict[int, socket.socket] = {}  # guard pid -> the connection its exit is reported on
    ended: set[int] = set()  # exited guards whose process group is not empty yet
    while True:
        if select.select([listener], [], [], 0.2)[0]:
            _fork_for(listener, clients, envs)
        _report_exits(clients, envs, ended)


def _fork_for(listener: socket.socket, clients: dict[int, socket.socket], envs: Path) -> None:
    """Take one request from ``listener``: fork its guard, record the guard's environment and answer its pid."""
    connection, _ = listener.accept()
    try:
        message, fds, _, _ = socket.recv_fds(connection, MAX_MESSAGE, 1)
        request = json.loads(message)
        if len(fds) != 1 or request.get("module") is None:
            raise ValueError("a request is a JSON command sent with one output file descriptor")
    except (OSError, ValueError) as exc:
        try:
            connection.send(json.dumps({"error": str(exc)}).encode())
        except OSError:
            pass
        connection.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _guard(request, fds[0], [listener, connection, *clients.values()])
    os.close(fds[0])
    (envs / f"{pid}.json").write_text(json.dumps(request["env"]))
    clients[pid] = connection
    try:
        connection.send(json.dumps({"pid": pid}).encode())
    except OSError:  # the launcher is gone: the guard sees that too, and stops the server
        pass


def _report_exits(clients: dict[int, socket.socket], envs: Path, ended: set[int]) -> None:
    """Reap the guards that exited and send each one's exit code (negative: the signal) to its launcher. A guard's
    environment record stays while anything of its process group lives (``ended``): a server left behind by a
    SIGKILLed guard still shows whose it is."""
    for group in list(ended):
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            (envs / f"{group}.json").unlink(missing_ok=True)
            ended.discard(group)
    while clients:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        ended.add(pid)
        connection = clients.pop(pid, None)
        if connection is not None:
            try:
                connection.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:  # the launcher is gone
                pass
            connection.close()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m vime.backends.vllm_utils.fork_server SOCKET [MODULE]...")
    serve(sys.argv[1], sys.argv[2:])
