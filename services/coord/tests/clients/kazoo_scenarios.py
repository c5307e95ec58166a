#!/usr/bin/env python3
"""kazoo (an unmodified ZooKeeper client from PyPI) against a Keel coord cluster.

usage: kazoo_scenarios.py HOSTS [KILL_PID]

HOSTS is host:port,... with the first the node the client talks to first. With
KILL_PID, that process (the first node, which the test started) is killed with -9 in
the middle of the recipes: the session must survive the reconnect to another node, its
ephemerals must stay, and the recipes must go on. Every check raises on failure; the
exit status is what the test reads.
"""
import os
import signal
import sys
import threading
import time

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, LockTimeout, NoNodeError, NodeExistsError, NotEmptyError, NoAuthError
from kazoo.protocol.states import EventType, KazooState


# A root of this run's own: runs against one cluster do not meet.
R = f"/kazoo-{os.getpid()}-{int(time.time())}"


def client(hosts, **kw):
    zk = KazooClient(hosts=hosts, timeout=10, randomize_hosts=False, **kw)
    zk.start(timeout=30)
    return zk


def wait_for(what, check, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def basics(zk):
    zk.ensure_path(R + "/basics")
    zk.create(R + "/basics/a", b"1")
    try:
        zk.create(R + "/basics/a", b"1")
        raise AssertionError("created twice")
    except NodeExistsError:
        pass
    data, stat = zk.get(R + "/basics/a")
    assert data == b"1" and stat.version == 0, (data, stat)
    zk.set(R + "/basics/a", b"2", version=0)
    try:
        zk.set(R + "/basics/a", b"3", version=0)
        raise AssertionError("stale version accepted")
    except BadVersionError:
        pass
    try:
        zk.delete(R + "/basics")
        raise AssertionError("deleted a node with children")
    except NotEmptyError:
        pass
    seqs = [zk.create(R + "/basics/s-", b"", sequence=True) for _ in range(3)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3, seqs
    assert zk.exists(R + "/basics/missing") is None
    try:
        zk.get(R + "/basics/missing")
        raise AssertionError("read a missing node")
    except NoNodeError:
        pass
    assert sorted(zk.get_children(R + "/basics")) == sorted(["a"] + [s.split("/")[-1] for s in seqs])
    # A failed transaction changes nothing and reports each operation.
    t = zk.transaction()
    t.create(R + "/basics/t1", b"")
    t.check(R + "/basics/a", 99)
    results = t.commit()
    assert type(results[1]).__name__ == "BadVersionError", results
    assert zk.exists(R + "/basics/t1") is None
    t = zk.transaction()
    t.create(R + "/basics/t1", b"")
    t.set_data(R + "/basics/a", b"txn")
    assert zk.exists(R + "/basics/t1") is None
    t.commit()
    assert zk.get(R + "/basics/a")[0] == b"txn"
    print("basics ok")


def watches(zk, other):
    events = []
    zk.ensure_path(R + "/w")
    zk.get(R + "/w", watch=events.append)
    zk.get_children(R + "/w", watch=events.append)
    zk.exists(R + "/w/new", watch=events.append)
    other.create(R + "/w/new", b"")
    other.set(R + "/w", b"changed")
    wait_for("three watch events", lambda: len(events) >= 3)
    kinds = sorted((e.type, e.path) for e in events)
    assert kinds == sorted([(EventType.CHANGED, R + "/w"), (EventType.CHILD, R + "/w"), (EventType.CREATED, R + "/w/new")]), kinds
    # One-shot: nothing more fires.
    other.set(R + "/w", b"again")
    time.sleep(0.5)
    assert len(events) == 3, events
    print("watches ok")


def ephemerals(hosts, zk):
    short = client(hosts)
    short.create(R + "/eph", b"", ephemeral=True, makepath=True)
    seen = []
    zk.exists(R + "/eph", watch=seen.append)
    short.stop()
    short.close()
    wait_for("the ephemeral's deletion event", lambda: seen)
    assert seen[0].type == EventType.DELETED, seen
    assert zk.exists(R + "/eph") is None
    print("ephemerals after closeSession ok")


def acls(hosts):
    owner = client(hosts, auth_data=[("digest", "alice:secret")])
    from kazoo.security import make_digest_acl
    owner.create(R + "/private", b"s", acl=[make_digest_acl("alice", "secret", all=True)], makepath=True)
    assert owner.get(R + "/private")[0] == b"s"
    stranger = client(hosts)
    try:
        stranger.get(R + "/private")
        raise AssertionError("read without auth")
    except NoAuthError:
        pass
    owner.stop()
    stranger.stop()
    print("acls ok")


def recipes(zk, hosts, kill_pid):
    # Election: one leader among three contenders.
    leaders = []
    contenders = [client(hosts) for _ in range(3)]
    stop = threading.Event()

    def lead(i):
        leaders.append(i)
        stop.wait(120)

    elections = []
    for i, c in enumerate(contenders):
        e = c.Election(R + "/election", f"c{i}")
        threading.Thread(target=e.run, args=(lead, i), daemon=True).start()
        elections.append(e)
    wait_for("a leader", lambda: leaders)
    time.sleep(0.5)
    assert len(leaders) == 1, leaders

    # Lock held across the kill of the client's node.
    lock = zk.Lock(R + "/lock", "me")
    assert lock.acquire(timeout=15)
    ours = zk.get_children(R + "/lock")
    states = []
    zk.add_listener(states.append)
    if kill_pid:
        os.kill(kill_pid, signal.SIGKILL)
        print(f"killed node pid {kill_pid}")
        wait_for("a suspended connection", lambda: KazooState.SUSPENDED in states, timeout=20)
        wait_for("the session back", lambda: states and states[-1] == KazooState.CONNECTED, timeout=30)
        assert KazooState.LOST not in states, f"the session was lost: {states}"
        assert zk.get_children(R + "/lock") == ours, "the lock's ephemeral stayed"
        # Every contender kept its session through the kill: still one leader, three entries.
        time.sleep(1)
        assert len(leaders) == 1, f"a second leader after the kill: {leaders}"
        entries = zk.get_children(R + "/election")
        assert len(entries) == 3, f"the election lost an entry: {entries}"
    other = client(hosts)
    contender = other.Lock(R + "/lock", "other")
    try:
        got = contender.acquire(timeout=1)
    except LockTimeout:
        got = False
    assert not got, "two holders of one lock"
    lock.release()
    assert contender.acquire(timeout=15)
    contender.release()

    # Counter, queue, barrier.
    counter = zk.Counter(R + "/counter")
    for _ in range(5):
        counter += 1
    other_counter = other.Counter(R + "/counter")
    other_counter += 10
    assert counter.value == 15 and other_counter.value == 15, (counter.value, other_counter.value)
    q = zk.Queue(R + "/queue")
    for item in [b"a", b"b", b"c"]:
        q.put(item)
    assert [other.Queue(R + "/queue").get() for _ in range(3)] == [b"a", b"b", b"c"]
    barrier = zk.Barrier(R + "/barrier")
    barrier.create()
    released = []
    waiter = threading.Thread(target=lambda: released.append(other.Barrier(R + "/barrier").wait(15)), daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert not released
    barrier.remove()
    waiter.join(20)
    assert released == [True], released
    # Leadership passes on: as each leader ends, the next contender leads, one at a time.
    stop.set()
    wait_for("every contender to lead in turn", lambda: len(leaders) == 3, timeout=30)
    assert sorted(leaders) == [0, 1, 2], leaders
    for e in elections:
        e.cancel()
    for c in contenders:
        c.stop()
    other.stop()
    print("recipes ok" + (" across a kill -9 of the client's node" if kill_pid else ""))


def main():
    hosts = sys.argv[1]
    kill_pid = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    zk = client(hosts)
    other = client(",".join(reversed(hosts.split(","))))
    basics(zk)
    watches(zk, other)
    ephemerals(hosts, zk)
    acls(hosts)
    other.stop()
    recipes(zk, hosts, kill_pid)
    zk.stop()
    print("all kazoo scenarios passed")


if __name__ == "__main__":
    main()
