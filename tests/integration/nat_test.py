#!/usr/bin/env python3
"""Peers behind NAT serve stages (`ctest -L netns`): two peers run in a network
namespace whose firewall drops every inbound TCP connection (iptables: new
SYNs dropped; what they dial out still works, as behind a home router), one
peer and the coordinator run on the host end of a veth pair.

Nobody tells the coordinator about the firewall: its reachability probe of
each joiner's StateTransfer address times out for the two namespaced peers.
The job is a single pipeline of 3 stages, so the only order that works puts
the reachable peer in the middle: its upstream (behind NAT) dials it as
usual, and its downstream (behind NAT too) dials it the other way round (a
reversed link). The test checks that placement, that the coordinator marked
the namespaced peers UNREACHABLE, and that training runs (step >= 5).

Needs root, `ip` (iproute2) and `iptables`; without them it says so and
exits 77 (ctest SKIP_RETURN_CODE). Everything it creates (namespace, veth,
processes, temp dir) is removed at the end; on failure the logs are printed.

usage: nat_test.py AQSWARM_BINARY [REPO_ROOT]
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

SKIP = 77
BIN = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else ""
ROOT = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", ".."))
TAG = "%d" % (os.getpid() % 100000)
NS = "aqnat" + TAG
HOST_IF, NS_IF = "aqh" + TAG, "aqn" + TAG
SUBNET = "10.231.%d" % (os.getpid() % 250 + 1)
HOST_IP, NS_IP = SUBNET + ".1", SUBNET + ".2"


def run(cmd, check=True, **kw):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (" ".join(cmd), r.returncode, r.stdout[-2000:]))
    return r


def skip_reason():
    if os.geteuid() != 0:
        return "not root (network namespaces and iptables need it)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return "no `%s` (Debian: apt-get install iproute2 iptables)" % tool
    if not os.path.isfile(os.path.join(ROOT, "data", "gpt2", "encoder.json")):
        return "no data/ (scripts/fetch_data.sh)"
    return None


def make_network():
    run(["ip", "netns", "add", NS])
    run(["ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF])
    run(["ip", "link", "set", NS_IF, "netns", NS])
    run(["ip", "addr", "add", HOST_IP + "/24", "dev", HOST_IF])
    run(["ip", "link", "set", HOST_IF, "up"])
    run(["ip", "-n", NS, "addr", "add", NS_IP + "/24", "dev", NS_IF])
    run(["ip", "-n", NS, "link", "set", NS_IF, "up"])
    run(["ip", "-n", NS, "link", "set", "lo", "up"])
    # Behind NAT: no connection can be opened to it; its own dials work.
    run(["ip", "netns", "exec", NS, "iptables", "-A", "INPUT", "-p", "tcp", "--syn", "-j", "DROP"])


def remove_network():
    run(["ip", "netns", "del", NS], check=False)
    run(["ip", "link", "del", HOST_IF], check=False)


def status(coordinator):
    r = run([BIN, "status", "--coordinator=" + coordinator, "--json"], check=False, timeout=30)
    if r.returncode != 0:
        return None
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    return None


def wait_for(what, bound_s, probe):
    start = time.monotonic()
    last = None
    while time.monotonic() - start < bound_s:
        last = probe()
        if last and last[0]:
            return last[1]
        time.sleep(0.5)  # polling interval of a bounded wait
    raise RuntimeError("timed out after %d s waiting for %s (last: %s)" % (bound_s, what, last and last[1]))


def main():
    if not BIN or not os.access(BIN, os.X_OK):
        sys.exit("usage: nat_test.py AQSWARM_BINARY [REPO_ROOT]")
    why = skip_reason()
    if why:
        print("SKIP: " + why)
        return SKIP
    work = tempfile.mkdtemp(prefix="aqswarm_nat_")
    procs, ok = {}, False
    job = {
        "name": "nat-it", "seed": 17,
        "model": {"seqLen": 32, "dModel": 32, "nLayer": 3, "nHead": 2},
        "data": {"corpus": os.path.join(ROOT, "data", "sotu"), "tokenizer": os.path.join(ROOT, "data", "gpt2"),
                 "cacheDir": os.path.join(work, "cache")},
        "optimizer": {"lr": 0.005, "minLr": 0.001, "warmupSteps": 2, "totalSteps": 400, "weightDecay": 0.0,
                      "gradClip": 1.0},
        "microBatchSize": 2, "microBatchesPerStep": 2, "epochs": 1, "maxSteps": 400,
        "compression": {"mode": "aqsgd", "fwBits": 3, "bwBits": 6, "warmupEpochs": 0, "mPrecision": "fp16"},
        "stages": 3, "dataParallel": 1, "threads": 1, "evalEverySteps": 0, "evalBatches": 1,
    }
    with open(os.path.join(work, "job.json"), "w") as fh:
        json.dump(job, fh)

    def spawn(name, argv, netns=False):
        out = open(os.path.join(work, name + ".log"), "w")
        cmd = (["ip", "netns", "exec", NS] if netns else []) + argv
        procs[name] = (subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=work), out)

    try:
        make_network()
        # Plaintext off loopback: --insecure (the TLS swarm tests cover mTLS).
        spawn("coordinator", [BIN, "coordinator", "--job=" + os.path.join(work, "job.json"), "--swarm=nat-it",
                              "--listen=0.0.0.0:0", "--insecure", "--state_dir=" + os.path.join(work, "coord"),
                              "--lease_s=5"])
        port = wait_for("the coordinator's port", 60, lambda: _listening_port(os.path.join(work, "coordinator.log")))
        coordinator = "%s:%d" % (HOST_IP, port)
        admin = "127.0.0.1:%d" % port  # a loopback caller gets Status's details (peer names)
        token = run([BIN, "certs", "token", "--tls_dir=" + os.path.join(work, "coord"), "--swarm=nat-it",
                     "--any_peer", "--ttl_s=3600"]).stdout.strip().splitlines()[-1]

        def peer(name, ip, base, netns):
            spawn(name, [BIN, "peer", "--coordinator=" + coordinator, "--join_token=" + token, "--name=" + name,
                         "--listen=%s:%d" % (ip, base), "--exchange_listen=%s:%d" % (ip, base + 1),
                         "--state_listen=%s:%d" % (ip, base + 2), "--work_dir=" + os.path.join(work, name),
                         "--insecure", "--link_timeout_s=30", "--seconds_per_layer=0.01"], netns=netns)

        peer("nat1", NS_IP, 17100, True)
        peer("nat2", NS_IP, 17200, True)
        peer("open", HOST_IP, _free_port_block(HOST_IP), False)

        def trained():
            st = status(admin)
            return (bool(st and st.get("grid_complete") and int(st.get("step", 0)) >= 5), st)

        st = wait_for("the grid to train 5 steps", 240, trained)
        where = {p["peer_name"]: (p["stage"], p["reachability"]) for p in st["peers"]}
        print("placed:", where, "step", st["step"], "loss", st["loss"])
        assert where.get("open") == (1, "REACHABLE"), where
        assert {where.get("nat1", (-1,))[0], where.get("nat2", (-1,))[0]} == {0, 2}, where
        assert where["nat1"][1] == "UNREACHABLE" and where["nat2"][1] == "UNREACHABLE", where
        ok = True
    finally:
        for name, (p, out) in procs.items():
            if p.poll() is None:
                p.terminate()
        for name, (p, out) in procs.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            out.close()
            if not ok:
                with open(os.path.join(work, name + ".log")) as fh:
                    print("--- %s:\n%s" % (name, fh.read()[-4000:]))
        remove_network()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _listening_port(log):
    try:
        with open(log) as fh:
            for line in fh:
                if line.startswith('{"listening"'):
                    return (True, json.loads(line)["listening"]["port"])
    except OSError:
        pass
    return (False, None)


def _free_port_block(ip):
    """A base port with base..base+2 free on `ip`."""
    import socket
    for base in range(27100, 40000, 10):
        socks = []
        try:
            for p in range(base, base + 3):
                s = socket.socket()
                s.bind((ip, p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block on " + ip)


if __name__ == "__main__":
    import script_test
    script_test.run(main)
