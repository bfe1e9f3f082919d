"""Start-up barrier and liveness side channel of a multi-process job (no JAX here).

Why a channel of our own: JAX's coordination service ends a process from C++ (SIGABRT, exit 134,
a C++ stack) both when not every process joins within its init timeout and, most of a heartbeat
timeout later, when a peer died; it names no process, and no Python code runs. A timer racing
JAX's deadline could say that someone is missing but not who (JAX does not tell who registered).
So before `jax.distributed.initialize`, process 0 listens on a second TCP port
(`distributed.liveness_port`, default: the coordinator's port + 1) and every other process
connects and says who it is (process id, host, process count). When
`distributed.initialization_timeout_s` passes, process 0 knows exactly who is missing and tells
the others; every process prints the same one line and exits 2. JAX's own deadline starts only
after this barrier, so its abort never comes first. Before the go, process 0 checks that JAX's
coordinator can listen on its port: a taken one is that same one line (exit 2), not gRPC's
`Failed to add port` and a crash that differs from run to run. A plain TCP port is what a TPU
pod's internal network already allows between workers (as for the coordinator's port); the hub is
a star around process 0 (8 hosts: 7 connections), which is where JAX's coordinator lives too.

The same connections then stay open as the liveness channel, with heartbeats every
`timeout_s / 6` both ways: a process that dies has its sockets closed by the kernel at once; a
host that vanishes goes silent and is declared lost after `distributed.liveness_timeout_s`.
Process 0 tells the survivors; each prints one line naming the lost process and its own step, and
leaves with os._exit(EXIT_PEER_LOST): a normal exit would wait in JAX's shutdown barrier for the
dead peer, and an async checkpoint cut short stays an incomplete step, which Orbax never lists.

A process that ends on purpose says goodbye first (`leave(code)`): exit 0 ends the watching; a
failure gives the others LEAVE_GRACE_S to fail on their own (the same NaN, the same error) before
they stop with EXIT_PEER_LOST naming it. Process 0 waits for them to go before it goes, since its
exit takes JAX's coordination service down and with it every process still attached. A process
that fails right when a peer dies (a collective or a checkpoint barrier breaks) calls `failing()`
first, so the lost peer is what it reports, in one line, not the echo.

Limit: when process 0's process dies abruptly (SIGKILL, OOM kill, segfault) while its host lives,
the others' JAX clients see the service's socket close at the same moment as this channel does,
and JAX may log its fatal line (`Terminating process because the JAX distributed service detected
fatal errors`) before our line and exit 7; rarely its abort (exit 134) wins the race (jaxlib 0.10's
`missed_heartbeat_callback` cannot call Python, so it cannot be handed to us).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from runtime import events
from runtime.errors import EXIT_PEER_LOST, UserError

log = logging.getLogger(__name__)

LEAVE_GRACE_S = 5.0  # after a peer fails on purpose, time for this process to fail the same way itself
_SEND_TIMEOUT_S = 5.0
_DEPARTED = "departed"  # a link's state after a goodbye with exit code 0


@dataclass(eq=False)
class Link:
    """One connection of the star: process 0 holds one per peer, a peer holds one to process 0."""

    id: int
    host: str
    sock: socket.socket
    last_seen: float = field(default_factory=time.monotonic)
    state: object = None  # None: alive; _DEPARTED; or the exit code it failed with
    inbox: list[dict] = field(default_factory=list)
    _buffer: bytes = b""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, **message) -> bool:
        try:
            with self._lock:
                self.sock.sendall((json.dumps(message) + "\n").encode())
            return True
        except OSError:
            return False

    def receive(self) -> bool:
        """Read what arrived (call when readable) into `inbox`; False once the connection is closed."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, socket.timeout):
            return True
        except OSError:
            return False
        if not data:
            return False
        self.last_seen = time.monotonic()
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:  # not one of ours (a port scanner): ignore
                continue
            if isinstance(message, dict):
                self.inbox.append(message)
        return True

    def next_message(self, deadline: float) -> Optional[dict]:
        """Block for the next message until `deadline`; None on timeout or a closed connection."""
        while not self.inbox:
            left = deadline - time.monotonic()
            if left <= 0 or not _readable(self.sock, left) or not self.receive():
                return None
        return self.inbox.pop(0)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _readable(sock: socket.socket, timeout: float) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        return bool(selector.select(timeout))


def _names(ids: Sequence[int], hosts: dict[int, str]) -> str:
    parts = [f"{i} (host {hosts[i]})" if hosts.get(i) else str(i) for i in ids]
    return ("process " if len(parts) == 1 else "processes ") + ", ".join(parts)


def _bind(port: int) -> socket.socket:
    """A socket listening on `port` on every interface (as JAX's coordinator binds); OSError if taken."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=1024)
    return socket.create_server(("", port), backlog=1024)


def _why(e: OSError) -> str:
    """"Address already in use", without create_server's "(while attempting to bind ...)"."""
    return os.strerror(e.errno) if e.errno else str(e)


def listen(port: int) -> socket.socket:
    """Process 0's listening socket for the barrier and the liveness channel."""
    try:
        return _bind(port)
    except OSError as e:
        raise UserError(f"process 0 cannot listen on liveness port {port} ({_why(e)}); free it or set "
                        "distributed.liveness_port to a free port, the same on every worker")


def check_coordinator_port(port: int) -> None:
    """UserError when process 0 cannot listen on JAX's coordinator port: gRPC's own failure to
    bind it is a crash that differs from run to run (a segfault, or another process's echo first)."""
    try:
        _bind(port).close()
    except OSError as e:
        raise UserError(f"process 0 cannot start JAX's coordinator on port {port} ({_why(e)}); free it or set "
                        "distributed.port (launch.py --port) to a free port, the same on every worker")


def gather(listener: socket.socket, count: int, timeout_s: float, known_hosts: dict[int, str],
           coordinator_port: Optional[int] = None) -> list[Link]:
    """Process 0's side of the barrier: wait until processes 1..count-1 said hello, check that JAX's
    coordinator can take `coordinator_port`, then tell them to go. On a timeout, an inconsistency
    or a taken port, tell the ones that joined why (each says the same line), and raise UserError."""
    deadline = time.monotonic() + timeout_s
    joined: dict[int, Link] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    try:
        while len(joined) < count - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [i for i in range(1, count) if i not in joined]
                names = {**known_hosts, **{i: link.host for i, link in joined.items()}}
                raise UserError(
                    f"{_names(missing, names)} did not join within {timeout_s:g}s ({len(joined) + 1} of {count} "
                    f"joined: {', '.join(map(str, [0, *sorted(joined)]))}); start every worker with the same command, or "
                    "set distributed.num_processes / JAX_NUM_PROCESSES to the number of workers started "
                    "(distributed.initialization_timeout_s)")
            for key, _ in selector.select(min(left, 1.0)):
                if key.data is None:
                    conn, _ = listener.accept()
                    conn.settimeout(_SEND_TIMEOUT_S)
                    selector.register(conn, selectors.EVENT_READ, Link(-1, "", conn))
                else:
                    _hear_hello(key.data, selector, joined, count, deadline)
        if coordinator_port is not None:  # now, just before JAX binds it (every port the pod needs, before JAX)
            check_coordinator_port(coordinator_port)
    except UserError as e:
        for link in joined.values():
            link.send(fail=str(e))
        raise
    finally:
        for key in list(selector.get_map().values()):
            if key.data is not None and key.data not in joined.values():
                key.data.close()
        selector.close()
    for link in joined.values():
        link.send(go=True)
    return list(joined.values())


def _hear_hello(link: Link, selector, joined: dict[int, Link], count: int, deadline: float) -> None:
    if not link.receive():  # gone before or after its hello: it counts as missing again
        selector.unregister(link.sock)
        link.close()
        if joined.get(link.id) is link:
            del joined[link.id]
        return
    while link.inbox:
        message = link.inbox.pop(0)
        try:
            pid, host, theirs = int(message["hello"]), str(message.get("host", "?")), message.get("count")
        except (KeyError, TypeError, ValueError):  # not a hello of ours
            continue
        problem = _inconsistency(pid, host, theirs, count, joined, link)
        if problem:
            link.send(fail=problem)  # the others hear it from gather
            raise UserError(problem)
        link.id, link.host = pid, host
        joined[pid] = link
        link.send(welcome=round(deadline - time.monotonic(), 3), host=socket.gethostname())


def _inconsistency(pid: int, host: str, theirs, count: int, joined: dict[int, Link], link: Link) -> str:
    if theirs != count:
        return (f"process {pid} (host {host}) was started for {theirs} processes but process 0 for {count}; give "
                "every worker the same distributed.num_processes / JAX_NUM_PROCESSES")
    if pid == 0 or (pid in joined and joined[pid] is not link):
        other = socket.gethostname() if pid == 0 else joined[pid].host
        return (f"two workers say they are process {pid} (hosts {other} and {host}); give each worker a distinct "
                "distributed.process_id / JAX_PROCESS_ID")
    return ""


def join(host: str, port: int, process_id: int, count: int, timeout_s: float, coordinator: str) -> Link:
    """A peer's side of the barrier: say hello to process 0 and wait for its verdict."""
    deadline = time.monotonic() + timeout_s
    sock = _connect(host, port, deadline, timeout_s, coordinator)
    link = Link(0, host, sock)
    link.send(hello=process_id, host=socket.gethostname(), count=count)
    welcome = link.next_message(time.monotonic() + max(timeout_s, 30.0))
    if welcome is not None and "welcome" in welcome:
        link.host = str(welcome.get("host", host))
        verdict = link.next_message(time.monotonic() + float(welcome["welcome"]) + 10)
    else:
        verdict = welcome
    if verdict is not None and "go" in verdict:
        return link
    link.close()
    if verdict is not None and "fail" in verdict:
        raise UserError(verdict["fail"])
    raise UserError(f"process 0 (coordinator {coordinator}) took the connection on liveness port {port} but gave no "
                    "start-up verdict; see process 0's log, and check distributed.liveness_port is not another "
                    "program's port")


def _connect(host: str, port: int, deadline: float, timeout_s: float, coordinator: str) -> socket.socket:
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=2)
            sock.settimeout(_SEND_TIMEOUT_S)
            return sock
        except OSError as e:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"process 0 (coordinator {coordinator}) did not answer within {timeout_s:g}s on liveness port "
                    f"{port} ({e.strerror or e}); start process 0 with the others, check the address is worker 0's "
                    "and both ports are open between workers (distributed.coordinator_address, distributed.port, "
                    "distributed.liveness_port, distributed.initialization_timeout_s)")
            time.sleep(0.5)


class _Lost(Exception):
    def __init__(self, pid: int, host: str, what: str, why: str):
        super().__init__(pid, host, what, why)
        self.pid, self.host, self.what, self.why = pid, host, what, why


_exit_hooks: list[Callable[[int], None]] = []


def on_abrupt_exit(hook: Callable[[int], None]) -> Callable[[], None]:
    """Have `hook(exit code)` run before this process ends through this module (a lost peer,
    `stop`), where no `finally` runs: the trainer records how the run ended. Each hook gets
    EXIT_HOOK_BUDGET_S in a daemon thread (a write to a dead bucket must not hold the exit);
    errors are swallowed. Returns the function that removes it."""
    _exit_hooks.append(hook)
    return lambda: _exit_hooks.remove(hook) if hook in _exit_hooks else None


EXIT_HOOK_BUDGET_S = 10.0


def _run_exit_hooks(code: int) -> None:
    for hook in list(_exit_hooks):
        def call(hook=hook):
            try:
                hook(code)
            except Exception:  # noqa: BLE001 - the exit line is already out; nothing to add
                pass
        worker = threading.Thread(target=call, name="abrupt-exit-hook", daemon=True)
        worker.start()
        worker.join(EXIT_HOOK_BUDGET_S)


def _exit_peer_lost(line: str) -> None:
    print(f"error: {line}", file=sys.stderr, flush=True)
    events.failed(EXIT_PEER_LOST, line)
    sys.stdout.flush()
    _run_exit_hooks(EXIT_PEER_LOST)
    os._exit(EXIT_PEER_LOST)  # not sys.exit: JAX's shutdown barrier would wait for the lost peer


class Pod:
    """The liveness channel once everyone joined: a thread that beats, listens and, when a peer is
    lost, reports it through `on_lost(line)` (by default: print `error: line`, exit EXIT_PEER_LOST)."""

    def __init__(self, process_id: int, links: Sequence[Link], timeout_s: float, progress: Callable[[], str],
                 on_lost: Callable[[str], None] = _exit_peer_lost):
        self.process_id, self.timeout_s, self.progress, self.on_lost = process_id, timeout_s, progress, on_lost
        self.links = {link.id: link for link in links}
        self.interval = max(timeout_s / 6, 0.05)
        self._failed: dict[int, tuple[str, int, float]] = {}  # peers that left with an error: (host, code, deadline)
        self._leaving = threading.Event()
        self._all_closed = threading.Event()
        self._lost = threading.Event()  # the watcher found a lost peer and is reporting it
        self._one_report = threading.Lock()  # either that report or this process's own failure: one line
        self._own_failure = False
        self._thread = threading.Thread(target=self._watch, name="pod-liveness", daemon=True)

    def start(self) -> "Pod":
        self._thread.start()
        return self

    def leave(self, code: Optional[int] = 0) -> None:
        """Say goodbye before this process exits. Process 0, failing, waits for the others to stop first."""
        if self._leaving.is_set():
            return
        self._leaving.set()
        for link in list(self.links.values()):
            link.send(bye=code or 0)
        if code and self.process_id == 0:
            self._all_closed.wait(LEAVE_GRACE_S + 3)

    def failing(self, wait_s: float) -> None:
        """Call before reporting a failure of this process: when a peer dies, this process may fail
        at once in a collective or a checkpoint barrier, an echo of the real cause. Wait briefly for
        the watcher to name the lost peer; if it does, it ends the process (this call never returns)."""
        if self._own_failure:  # already decided: this process reports its own failure
            return
        if self._lost.wait(wait_s) or not self._one_report.acquire(blocking=False):
            threading.Event().wait()  # the watcher's report and exit are under way
        self._own_failure = True

    def _watch(self) -> None:
        selector = selectors.DefaultSelector()
        for link in self.links.values():
            selector.register(link.sock, selectors.EVENT_READ, link)
        try:
            self._loop(selector)
        except _Lost as lost:
            self._lost.set()
            self._report(lost, selector)
        except Exception as e:  # noqa: BLE001 - the channel is a safety net; never take the run down itself
            log.warning("the liveness watcher stopped: %s", e)
        finally:
            for link in self.links.values():
                link.close()
            selector.close()
            self._all_closed.set()

    def _loop(self, selector) -> None:
        next_beat = 0.0
        while self.links or (self._failed and not self._leaving.is_set()):
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.interval
                for link in list(self.links.values()) if not self._leaving.is_set() else ():
                    if link.state is None and not link.send(beat=1):
                        self._closed(link, selector)
            wake = min([next_beat, *(deadline for _, _, deadline in self._failed.values())])
            for key, _ in selector.select(max(0.01, min(self.interval, wake - time.monotonic()))):
                link = key.data
                if not link.receive():
                    self._closed(link, selector)
                while link.inbox:
                    self._heard(link, link.inbox.pop(0))
            if not self._leaving.is_set():
                self._check_silence()

    def _closed(self, link: Link, selector) -> None:
        if self.links.pop(link.id, None) is None:
            return
        selector.unregister(link.sock)
        link.close()
        if not self._leaving.is_set() and link.state is None:
            raise _Lost(link.id, link.host, "stopped answering", "its connection closed, the process ended")

    def _heard(self, link: Link, message: dict) -> None:
        if self._leaving.is_set():
            return
        if "bye" in message:
            code = int(message["bye"] or 0)
            link.state = code or _DEPARTED
            if code:
                self._failed[link.id] = (link.host, code, time.monotonic() + LEAVE_GRACE_S)
            elif link.id == 0:  # process 0 ends normally: nothing left to watch
                self._leaving.set()
        elif "lost" in message:  # process 0 relays who was lost
            raise _Lost(int(message["lost"]), str(message["host"]), str(message["what"]), str(message["why"]))

    def _check_silence(self) -> None:
        now = time.monotonic()
        for pid, (host, code, deadline) in self._failed.items():
            if now >= deadline:
                raise _Lost(pid, host, f"stopped with exit code {code}", "its log says why")
        for link in self.links.values():
            if link.state is None and now - link.last_seen > self.timeout_s:
                raise _Lost(link.id, link.host, "stopped answering",
                            f"nothing heard from it for {self.timeout_s:g}s: host down or network cut "
                            "(distributed.liveness_timeout_s)")

    def _report(self, lost: _Lost, selector) -> None:
        line = (f"process {lost.pid} (host {lost.host}) {lost.what} {self.progress()}: {lost.why}; this process "
                "stops too. Fix or replace that worker, then relaunch the same command to resume from the last "
                "checkpoint")
        if self.process_id == 0:  # tell the others, and let them go before JAX's service goes with this process
            gone = self.links.pop(lost.pid, None)
            if gone is not None:  # silent, not closed
                selector.unregister(gone.sock)
                gone.close()
            for link in self.links.values():
                link.send(lost=lost.pid, host=lost.host, what=lost.what, why=lost.why)
            self._leaving.set()
            deadline = time.monotonic() + 2.0
            while self.links and time.monotonic() < deadline:
                for key, _ in selector.select(0.1):
                    if not key.data.receive():
                        self._closed(key.data, selector)
        if self._one_report.acquire(blocking=False):  # else this process is already reporting its own failure
            self.on_lost(line)


_current: Optional[Pod] = None


def rendezvous(coordinator_host: str, port: int, process_id: int, count: int, *, join_timeout_s: float,
               liveness_timeout_s: float, progress: Callable[[], str], coordinator: str,
               hosts: Sequence[str] = ()) -> Pod:
    """Wait until all `count` processes joined (UserError naming the missing ones if not within
    `join_timeout_s`), then watch them until this process leaves. `hosts`: each process's host
    where known beforehand (TPU worker metadata), to name the missing ones."""
    global _current
    if process_id == 0:
        listener = listen(port)
        coordinator_port = coordinator.rpartition(":")[2]
        try:
            links = gather(listener, count, join_timeout_s, dict(enumerate(hosts)),
                           int(coordinator_port) if coordinator_port.isdigit() else None)
        finally:
            listener.close()
    else:
        links = [join(coordinator_host, port, process_id, count, join_timeout_s, coordinator)]
    _current = Pod(process_id, links, liveness_timeout_s, progress).start()
    atexit.register(_current.leave, None)  # a normal end (runs before JAX's own shutdown barrier)
    return _current


def failing(wait_s: float = 2.0) -> None:
    """Before this process reports its own failure: let a lost peer, the likelier cause, be named
    instead (nothing outside a pod). See Pod.failing."""
    if _current is not None:
        _current.failing(wait_s)


def stop(line: str, code: int) -> None:
    """End this process now with `error: line` and `code`, from any thread; the others hear of it
    (process 0 waits for them to go first). Quiet if a lost peer is being reported already."""
    if _current is not None and not _current._one_report.acquire(blocking=False):
        return
    print(f"error: {line}", file=sys.stderr, flush=True)
    events.failed(code, line)
    sys.stdout.flush()
    _run_exit_hooks(code)
    leave(code)
    os._exit(code)


def leave(code: Optional[int]) -> None:
    """Tell the other processes that this one exits with `code` (nothing outside a pod)."""
    if _current is not None:
        _current.leave(code)
