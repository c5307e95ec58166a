#!/usr/bin/env python3
"""A differential test: the same seeded stream of ZooKeeper operations to Apache
ZooKeeper and to Keel coord, through kazoo (the same unmodified client for both),
comparing every result and every watch event after masking what legitimately differs
(zxids, times, session ids).

usage: differential.py KEEL_HOSTS ZK_HOSTS [--ops N] [--seed S] [--plant]

--plant changes one result of Keel's before comparing: the run must then fail (the
check is shown able to fail). Exit 0: no mismatch; 1: a mismatch, printed.
"""
import argparse
import os
import random
import sys
import time

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException
from kazoo.security import OPEN_ACL_UNSAFE, READ_ACL_UNSAFE, make_acl, make_digest_acl

ROOT = "/d"  # made unique per run in main()
NAMES = ["a", "b", "c", "d", "e"]
# ACLs the operations choose from: open, read-only, alice's alone, alice's plus read for all.
ACLS = [
    OPEN_ACL_UNSAFE,
    READ_ACL_UNSAFE,
    [make_digest_acl("alice", "secret", all=True)],
    [make_digest_acl("alice", "secret", all=True), make_acl("world", "anyone", read=True)],
]


def masked_acls(acls):
    return sorted((a.perms, a.id.scheme, a.id.id) for a in acls)


def masked_stat(st):
    if st is None:
        return None
    return (st.version, st.cversion, st.aversion, st.dataLength, st.numChildren, st.ephemeralOwner != 0)


def outcome(fn):
    try:
        value = fn()
    except KazooException as e:
        return ("error", type(e).__name__)
    return ("ok", value)


class System:
    """One system under test: a main client, a second one whose session is closed and
    replaced now and then (its ephemerals go), and the watch events each received."""

    def __init__(self, name, hosts):
        self.name = name
        self.hosts = hosts
        self.events = []
        # The main client is alice (digest auth); the other one is nobody.
        self.main = self.connect(auth=True)
        self.other = self.connect()
        self.generation = 0

    def connect(self, auth=False):
        zk = KazooClient(hosts=self.hosts, timeout=10, randomize_hosts=False,
                         auth_data=[("digest", "alice:secret")] if auth else None)
        zk.start(timeout=30)
        return zk

    def replace_other(self):
        self.other.stop()
        self.other.close()
        self.other = self.connect()
        self.generation += 1

    def watcher(self, tag):
        def record(event):
            self.events.append((tag, event.type, event.path))
        return record


def random_path(rng, depth_max=3):
    depth = rng.randint(1, depth_max)
    return ROOT + "".join("/" + rng.choice(NAMES) for _ in range(depth))


def operation(rng, step):
    """A random operation as a function of a System, returning a comparable result."""
    kind = rng.choices(
        ["create", "create_seq", "create_eph", "create_eph_seq", "set", "delete", "get", "exists", "children",
         "multi", "get_watch", "children_watch", "exists_watch", "other_create_eph", "close_other",
         "create_acl", "set_acl", "get_acl", "other_get", "other_set", "create2", "children2", "sync"],
        weights=[10, 4, 3, 2, 10, 8, 8, 5, 6, 6, 4, 4, 4, 3, 1, 3, 3, 3, 4, 3, 3, 3, 2])[0]
    acl = ACLS[rng.randrange(len(ACLS))]
    path = random_path(rng)
    data = rng.choice([b"", b"x", b"yy", bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))])
    version = rng.choice([-1, -1, 0, 1, 2])
    tag = f"w{step}"

    def run(s):
        z = s.main
        if kind == "create":
            return outcome(lambda: z.create(path, data))
        if kind == "create_seq":
            return outcome(lambda: z.create(path + "-", data, sequence=True))
        if kind == "create_eph":
            return outcome(lambda: z.create(path, data, ephemeral=True))
        if kind == "create_eph_seq":
            return outcome(lambda: z.create(path + "-", data, ephemeral=True, sequence=True))
        if kind == "other_create_eph":
            return outcome(lambda: s.other.create(path, data, ephemeral=True))
        if kind == "create_acl":
            return outcome(lambda: z.create(path, data, acl=acl))
        if kind == "set_acl":
            return outcome(lambda: masked_stat(z.set_acls(path, acl, version=version)))
        if kind == "get_acl":
            return outcome(lambda: (lambda r: (masked_acls(r[0]), masked_stat(r[1])))(z.get_acls(path)))
        if kind == "other_get":
            return outcome(lambda: (lambda r: (r[0], masked_stat(r[1])))(s.other.get(path)))
        if kind == "other_set":
            return outcome(lambda: masked_stat(s.other.set(path, data, version=-1)))
        if kind == "close_other":
            s.replace_other()
            return ("ok", "replaced")
        if kind == "set":
            return outcome(lambda: masked_stat(z.set(path, data, version=version)))
        if kind == "delete":
            return outcome(lambda: z.delete(path, version=version))
        if kind == "get":
            return outcome(lambda: (lambda r: (r[0], masked_stat(r[1])))(z.get(path)))
        if kind == "get_watch":
            return outcome(lambda: (lambda r: (r[0], masked_stat(r[1])))(z.get(path, watch=s.watcher(tag))))
        if kind == "exists":
            return outcome(lambda: masked_stat(z.exists(path)))
        if kind == "exists_watch":
            return outcome(lambda: masked_stat(z.exists(path, watch=s.watcher(tag))))
        if kind == "children":
            return outcome(lambda: sorted(z.get_children(path)))
        if kind == "create2":
            return outcome(lambda: (lambda r: (r[0], masked_stat(r[1])))(z.create(path, data, include_data=True)))
        if kind == "children2":
            return outcome(lambda: (lambda r: (sorted(r[0]), masked_stat(r[1])))(z.get_children(path, include_data=True)))
        if kind == "sync":
            return outcome(lambda: z.sync(path))
        if kind == "children_watch":
            return outcome(lambda: sorted(z.get_children(path, watch=s.watcher(tag))))
        if kind == "multi":
            t = z.transaction()
            for _ in range(rng_multi.randint(1, 4)):
                p = random_path(rng_multi)
                op = rng_multi.choice(["create", "delete", "set", "check"])
                v = rng_multi.choice([-1, 0, 1])
                if op == "create":
                    t.create(p, b"m")
                elif op == "delete":
                    t.delete(p, version=v)
                elif op == "set":
                    t.set_data(p, b"m", version=v)
                else:
                    t.check(p, max(v, 0))
            def commit():
                results = t.commit()
                return [type(r).__name__ if isinstance(r, Exception) else
                        (masked_stat(r) if hasattr(r, "version") else r) for r in results]
            return outcome(commit)
        raise AssertionError(kind)

    # A multi's ops come from a generator of their own, seeded per step, so both
    # systems build the same transaction.
    global rng_multi
    seed = rng.randrange(1 << 30)

    def run_seeded(s):
        global rng_multi
        rng_multi = random.Random(seed)
        return run(s)

    return kind, path, run_seeded


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("keel")
    ap.add_argument("zk")
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plant", action="store_true")
    a = ap.parse_args()
    # A root of this run's own (earlier runs may have left nodes only alice can delete).
    global ROOT
    ROOT = f"/d{a.seed}-{os.getpid()}-{int(time.time())}"
    keel, zk = System("keel", a.keel), System("zookeeper", a.zk)
    for s in (keel, zk):
        s.main.create(ROOT, b"")
    rng = random.Random(a.seed)
    mismatches = 0
    plant_at = a.ops // 2
    for step in range(a.ops):
        kind, path, run = operation(rng, step)
        ours, theirs = run(keel), run(zk)
        if a.plant and step >= plant_at and ours[0] == "ok" and kind in ("get", "children", "exists"):
            ours = ("ok", ("planted", ours[1]))
            plant_at = a.ops + 1
        if ours != theirs:
            mismatches += 1
            print(f"MISMATCH at op {step} ({kind} {path}):\n  keel:      {ours}\n  zookeeper: {theirs}")
            if mismatches >= 10:
                break
    # Watch events: let the last ones arrive, then compare them as multisets.
    time.sleep(2)
    ev_ours, ev_theirs = sorted(map(str, keel.events)), sorted(map(str, zk.events))
    if ev_ours != ev_theirs:
        mismatches += 1
        only_ours = sorted(set(ev_ours) - set(ev_theirs))[:10]
        only_theirs = sorted(set(ev_theirs) - set(ev_ours))[:10]
        print(f"MISMATCH in watch events: keel {len(ev_ours)}, zookeeper {len(ev_theirs)}\n"
              f"  only keel: {only_ours}\n  only zookeeper: {only_theirs}")
    for s in (keel, zk):
        s.other.stop()
        s.main.stop()
    print(f"{a.ops} operations, {len(ev_ours)} watch events, seed {a.seed}: {mismatches} mismatches")
    sys.exit(1 if mismatches else 0)


rng_multi = None

if __name__ == "__main__":
    main()
