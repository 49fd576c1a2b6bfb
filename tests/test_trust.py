"""Trust boundaries (docs/trust.md): a local run listens on loopback only, store values the run acts
on must carry the job secret's signature, a rank without the secret is refused, and values read from
the store or a peer are bounds-checked before anything is sized from them. Real stores and processes."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from hpcrl.run.checkpoint import store_agree
from hpcrl.comm import DistContext, DistSetupError, spawn
from hpcrl.comm.bootstrap import _devices
from hpcrl.comm.local import _loopback_store
from hpcrl.comm.secret import (SignedStore, UntrustedKeyError, UntrustedPeerError, load_secret, new_secret,
                               no_secret_policy)
from hpcrl.ppo.channels import ChannelError, Schema
from hpcrl.comm.heartbeat import Heartbeat, PeerLost, Watcher
from tests.comm_workers.trust import listening, report_listeners

REPO = Path(__file__).resolve().parents[1]
SECRET = new_secret().encode()


@pytest.fixture
def server():
    store = _loopback_store(1)
    yield store
    del store


def client(server, secret=SECRET, scope="attempt0/world2"):
    raw = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))
    return SignedStore(dist.PrefixStore("hpcrl", raw), secret, scope), dist.PrefixStore("hpcrl", raw)


def _loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


# ------------------------------------------------------------------------- local runs: loopback only


def test_loopback_store_listens_on_loopback_only(server):
    mine = listening(os.getpid())
    assert ("127.0.0.1", server.port) in mine
    # torch's own TCPStore(host="127.0.0.1") binds every interface: the reason spawn binds the socket itself
    assert all(_loopback(a) for a, p in mine if p == server.port)


@pytest.mark.slow
def test_local_spawn_opens_no_port_beyond_loopback():
    before = {p for _, p in listening(os.getpid())}  # earlier tests' stores in this process are not spawn's
    ranks = spawn(report_listeners, 2, timeout_s=90)
    parent = listening(os.getpid())
    for r in ranks:
        assert r["signed"] and r["ifname"] == "lo"
        assert r["self"], f"rank {r['rank']}: no listener found at all (the /proc reading is broken)"
        assert r["parent"], "the spawn parent hosts the store: it must listen somewhere"
        bad = [(a, p) for a, p in r["self"] + r["parent"] + r["server"] if not _loopback(a)]
        assert not bad, f"rank {r['rank']}: listening beyond loopback: {bad}"
    store_ports = {p for _, p in ranks[0]["parent"]} - before
    assert store_ports, "the spawn's store was not among the parent's listeners while the ranks ran"
    deadline = time.monotonic() + 10  # the store's server thread closes its socket as it shuts down
    while store_ports & {p for _, p in parent} and time.monotonic() < deadline:
        time.sleep(0.1)
        parent = listening(os.getpid())
    assert not store_ports & {p for _, p in parent}, "the store must be gone once spawn returned"


# ------------------------------------------------------------------------------- signed store values


def test_signed_values_round_trip_and_forgeries_are_refused(server):
    store, raw = client(server)
    store.set("ppo/done/1", "1")
    assert store.get("ppo/done/1") == b"1"
    store.wait(["ppo/done/1"], timedelta(seconds=2))
    assert store.check(["ppo/done/1"])
    raw.set("ppo/done/2", "1")  # a forger: reaches the store, does not know the secret
    for call in (lambda: store.get("ppo/done/2"), lambda: store.wait(["ppo/done/2"], timedelta(seconds=2)),
                 lambda: store.check(["ppo/done/2"]), lambda: store.multi_get(["ppo/done/1", "ppo/done/2"])):
        with pytest.raises(UntrustedKeyError, match=r"'ppo/done/2'.*no signature") as err:
            call()
        assert err.value.key == "ppo/done/2"
    # a signed value copied to another key, or replayed into another attempt, does not verify
    raw.set("ppo/done/3", raw.get("ppo/done/1"))
    with pytest.raises(UntrustedKeyError, match="does not verify"):
        store.get("ppo/done/3")
    other_attempt, _ = client(server, scope="attempt1/world2")
    with pytest.raises(UntrustedKeyError, match="does not verify"):
        other_attempt.get("ppo/done/1")
    wrong, _ = client(server, secret=new_secret().encode())
    with pytest.raises(UntrustedKeyError, match="HPCRL_JOB_SECRET"):
        wrong.get("ppo/done/1")
    assert store.clone().get("ppo/done/1") == b"1"


def _ctx(store, rank=0, world=2, timeout_s=5.0) -> DistContext:
    import torch

    return DistContext(rank, world, rank, torch.device("cpu"), "gloo", True, "torchrun",
                       timedelta(seconds=timeout_s), f"host{rank}", store=store)


def test_forged_checkpoint_agreement_is_refused_naming_the_rank(server):
    store, raw = client(server)
    # An impostor plays rank 1: posts "its" restore reason and arrives at the barrier, unsigned.
    raw.set("ckpt-restore/0/1", "corrupt: use the older checkpoint")
    raw.set("barrier/ckpt-restore/0/1", "1")
    agree = store_agree(_ctx(store))
    with pytest.raises(UntrustedPeerError, match=r"barrier 'ckpt-restore' on rank 0.*rank 1.*job secret"):
        agree("")
    # the genuine two-rank agreement works through the same store
    a, b = client(server)[0], client(server)[0]
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(b=store_agree(_ctx(b, 1), name="ok")("bad file")))
    t.start()
    got = store_agree(_ctx(a, 0), name="ok")("")
    t.join(10)
    assert got == out["b"] == {1: "bad file"}


def test_store_agree_rejects_ranks_outside_the_world(server):
    with pytest.raises(ValueError, match="ranks of the world"):
        store_agree(_ctx(client(server)[0]), ranks=[0, 5])


def test_forged_heartbeat_cannot_keep_a_rank_alive(server):
    store, raw = client(server)
    beat = Heartbeat(store.clone(), 0, interval_s=0.05)
    try:
        watch = Watcher(store.clone(), [0, 1], timeout_s=0.3)
        raw.set("hb/1", "12345")  # forged beats for rank 1, which has none
        with pytest.raises(UntrustedKeyError, match="'hb/1'"):
            watch.dead()
    finally:
        beat.stop()
    # a replayed (older or equal) signed count is not a beat: rank 0, stopped, is declared dead
    watch = Watcher(store.clone(), [0], timeout_s=0.3)
    old = raw.get("hb/0")
    import time

    deadline = time.monotonic() + 3
    while not watch.dead():
        raw.set("hb/0", old)
        assert time.monotonic() < deadline, "a replayed heartbeat kept a stopped rank alive"
        time.sleep(0.05)


class _LateAnswers:
    """A real store whose ``multi_get`` answers, then holds the answer ``hold_s`` before returning: a
    watcher frozen (SIGSTOP) right after the store answered it."""

    def __init__(self, store) -> None:
        self.store, self.hold_s = store, 0.0

    def check(self, keys):
        return self.store.check(keys)

    def multi_get(self, keys):
        values = self.store.multi_get(keys)
        time.sleep(self.hold_s)
        return values


def test_a_watcher_frozen_after_reading_does_not_declare_a_live_peer_dead(server):
    store, _ = client(server)
    store.set("hb/0", "1")
    late = _LateAnswers(store.clone())
    watch = Watcher(late, [0], timeout_s=1.0)
    assert watch.dead() == []  # beat 1 seen at t0
    time.sleep(0.3)
    late.hold_s = 0.8  # the next answer (still beat 1) comes back 0.8 s after the store gave it...
    beat = threading.Timer(0.5, lambda: store.clone().set("hb/0", "2"))  # ...and the peer beats meanwhile
    beat.start()
    try:
        # counts are as of when they were asked for (t0 + 0.3 s: silent 0.3 s, not 1.1 s); pairing them with
        # the clock after the pause declared the live peer dead (the chaos test's frozen maker, woken, once
        # named the live trainer this way)
        assert watch.dead() == []
    finally:
        beat.join()
    late.hold_s = 0.0
    assert watch.dead() == []  # beat 2


def test_malformed_heartbeat_is_refused_in_unsigned_mode(server):
    store, raw = client(server, secret=None)
    raw.set("hb/4", "x" * 10_000)
    with pytest.raises(PeerLost, match="'hb/4'.*malformed"):
        Watcher(store, [4], timeout_s=1.0).dead()


# ------------------------------------------------------------------------- bounds on what peers say


def test_device_records_are_bounds_checked(server):
    store, raw = client(server, secret=None)
    store.set("device/0", "1|node1|GPU-abc")
    raw.set("device/1", "9|" + "x" * 5000)
    with pytest.raises(DistSetupError, match=r"'device/1'.*malformed device record"):
        _devices(store, 2)


@pytest.mark.parametrize("text,match", [
    ('{"fields": [["obs", [1048576, 1048576, 1024], "float32"]], "stats": []}', "bytes per batch"),
    ('{"fields": [["obs", [-1], "float32"]], "stats": []}', "bad dtype"),
    ('{"fields": [["obs", [4], "Tensor"]], "stats": []}', "bad dtype"),
    ('{"fields": 7}', "malformed"),
    ("not json", "malformed"),
    ("[" * 100_000, "characters"),
])
def test_forged_schema_is_refused_before_sizing_anything(text, match):
    with pytest.raises(ChannelError, match=f"from maker rank 3.*{match}"):
        Schema.from_json(text, source="maker rank 3")


# ------------------------------------------------------------------------------------ the secret


def test_secret_sources(tmp_path):
    assert load_secret({}) is None
    assert load_secret({"HPCRL_JOB_SECRET": "a" * 40}) == b"a" * 40
    with pytest.raises(DistSetupError, match="at least 32"):
        load_secret({"HPCRL_JOB_SECRET": "hunter2"})
    f = tmp_path / "secret"
    f.write_text(new_secret() + "\n")
    f.chmod(0o644)
    with pytest.raises(DistSetupError, match="chmod 600"):
        load_secret({"HPCRL_JOB_SECRET_FILE": str(f)})
    f.chmod(0o600)
    assert len(load_secret({"HPCRL_JOB_SECRET_FILE": str(f)})) == 64
    with pytest.raises(DistSetupError, match="cannot open"):
        load_secret({"HPCRL_JOB_SECRET_FILE": str(tmp_path / "missing")})
    with pytest.raises(UntrustedPeerError, match="HPCRL_REQUIRE_SECRET"):
        no_secret_policy({"HPCRL_REQUIRE_SECRET": "1"}, 0, "slurm")


def _rank(port: int, rank: int, secret: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCRL_", "SLURM_", "RANK", "WORLD_SIZE"))}
    env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_USE_AGENT_STORE="True", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO), TRUST_TIMEOUT_S="20")
    if secret is not None:
        env["HPCRL_JOB_SECRET"] = secret
    return subprocess.Popen([sys.executable, "-m", "tests.comm_workers.trust"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("second", [None, "other"])
def test_rank_without_the_job_secret_is_refused(server, second):
    job = new_secret()
    procs = [_rank(server.port, 0, job), _rank(server.port, 1, None if second is None else new_secret())]
    outs = [p.communicate(timeout=60) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [2, 2], (codes, outs)
    for _, err in outs:
        assert "Traceback" not in err and err.count("\n") <= 2, err
    assert "rank 1" in outs[0][1] and "job secret" in outs[0][1]  # rank 0 names the impostor
    if second is None:
        assert "this rank has no job secret" in outs[1][1] and "HPCRL_JOB_SECRET" in outs[1][1]
    else:
        assert "rank 0" in outs[1][1] and "this rank's secret is the odd one" in outs[1][1]
