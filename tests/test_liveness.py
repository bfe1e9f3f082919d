"""The start-up barrier and the liveness channel on their own: processes are threads on loopback
sockets (no JAX), a dead process is a closed socket, a dead host a silent one."""

from __future__ import annotations

import queue
import socket
import threading

import pytest

from runtime import liveness
from runtime.errors import UserError

HOST = socket.gethostname()


def barrier(count: int, peers: dict[int, int], timeout_s: float = 5.0, hosts: dict[int, str] | None = None):
    """Process 0 and the given peers ({process id: the count it was started with}) meet; returns
    {process id: its links or the UserError it raised}."""
    listener = liveness.listen(0)
    port = listener.getsockname()[1]
    results: dict[int, object] = {}

    def attempt(pid: int, action) -> None:
        try:
            results[pid] = action()
        except UserError as e:
            results[pid] = e

    threads = [threading.Thread(target=attempt, args=(0, lambda: liveness.gather(listener, count, timeout_s,
                                                                                 hosts or {})))]
    threads += [threading.Thread(target=attempt, args=(pid, lambda pid=pid, n=n: [liveness.join(
        "127.0.0.1", port, pid, n, timeout_s, "127.0.0.1:1234")])) for pid, n in peers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 20)
    listener.close()
    return results


def watch(pid: int, links, timeout_s: float = 10.0):
    """A Pod whose reports land in a queue instead of ending the process."""
    reports: queue.Queue = queue.Queue()

    def record(line: str) -> None:
        reports.put(line)

    return liveness.Pod(pid, links, timeout_s, lambda: "at step 8 (step 7 done; train)", record).start(), reports


def test_a_dead_process_is_named_by_every_survivor():
    joined = barrier(3, {1: 3, 2: 3})
    assert sorted(link.id for link in joined[0]) == [1, 2] and [link.id for link in joined[1]] == [0]
    hub, hub_reports = watch(0, joined[0])
    peer, peer_reports = watch(1, joined[1])
    joined[2][0].close()  # process 2 dies: the kernel closes its sockets
    expected = f"process 2 (host {HOST}) stopped answering at step 8 (step 7 done; train): its connection closed"
    assert hub_reports.get(timeout=10).startswith(expected)
    assert peer_reports.get(timeout=10).startswith(expected)  # relayed by process 0


def test_processes_that_never_join_are_named_by_all_who_did():
    joined = barrier(3, {1: 3}, timeout_s=1, hosts={2: "10.0.0.7"})
    message = "process 2 (host 10.0.0.7) did not join within 1s (2 of 3 joined: 0, 1)"
    assert all(isinstance(joined[i], UserError) and message in str(joined[i]) for i in (0, 1)), joined


@pytest.mark.parametrize("peers,message", [
    ({1: 2}, "process 1 (host {HOST}) was started for 2 processes but process 0 for 3"),
    ({0: 3}, "two workers say they are process 0"),
])
def test_inconsistent_workers_fail_everyone_at_once(peers, message):
    joined = barrier(3, peers, timeout_s=30)
    for pid in (0, *peers):
        assert isinstance(joined[pid], UserError) and message.format(HOST=HOST) in str(joined[pid]), joined


def test_no_process_0():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(UserError, match=r"process 0 \(coordinator 127.0.0.1:1234\) did not answer within 1s"):
            liveness.join("127.0.0.1", port, 1, 2, 1, "127.0.0.1:1234")


def test_a_silent_host_is_lost_after_the_timeout():
    joined = barrier(2, {1: 2})
    hub, reports = watch(0, joined[0], timeout_s=0.5)  # process 1's link stays open but says nothing
    assert "process 1 (host" in (line := reports.get(timeout=10)) and "nothing heard from it for 0.5s" in line
    joined[1][0].close()


def test_a_process_that_dies_first_is_named_by_process_0():
    joined = barrier(2, {1: 2})
    peer, reports = watch(1, joined[1])
    for link in joined[0]:
        link.close()
    assert reports.get(timeout=10).startswith(f"process 0 (host {HOST}) stopped answering")


def test_goodbyes(monkeypatch):
    monkeypatch.setattr(liveness, "LEAVE_GRACE_S", 0.3)
    joined = barrier(3, {1: 3, 2: 3})
    hub, hub_reports = watch(0, joined[0], timeout_s=0.6)
    peers = {pid: watch(pid, joined[pid], timeout_s=0.6) for pid in (1, 2)}
    peers[2][0].leave(0)  # a normal end: nobody is alarmed, not even when it then goes silent
    with pytest.raises(queue.Empty):
        hub_reports.get(timeout=1.2)
    peers[1][0].leave(3)  # a failure: the others stop too, naming it
    assert "process 1 (host" in (line := hub_reports.get(timeout=10)) and "stopped with exit code 3" in line
    assert peers[2][1].empty()


def test_process_0_failing_waits_for_the_others(monkeypatch):
    monkeypatch.setattr(liveness, "LEAVE_GRACE_S", 0.3)
    joined = barrier(2, {1: 2})
    hub, _ = watch(0, joined[0])
    peer, reports = watch(1, joined[1])
    hub.leave(2)  # returns once process 1 went (it stops after the grace), before JAX's service would go
    assert f"process 0 (host {HOST}) stopped with exit code 2" in reports.get_nowait()


def test_one_line_either_a_lost_peer_or_this_process_own_failure():
    joined = barrier(2, {1: 2})
    hub, reports = watch(0, joined[0])
    joined[1][0].close()  # the peer dies; this process fails too (a collective), an echo
    failing = threading.Thread(target=hub.failing, args=(5,), daemon=True)
    failing.start()
    assert reports.get(timeout=10).startswith("process 1 (host")
    failing.join(1)
    assert failing.is_alive()  # the echo is never reported: the watcher's report ends the process

    joined = barrier(2, {1: 2})
    hub, reports = watch(0, joined[0])
    hub.failing(0.1)  # no peer lost: this process reports its own failure, alone
    joined[1][0].close()
    with pytest.raises(queue.Empty):
        reports.get(timeout=1)
