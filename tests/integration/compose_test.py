#!/usr/bin/env python3
"""Runs the Compose deployment for real (`ctest -L docker`): builds the images
(deploy/build-images.sh, the --prebuilt fast path with this build's binary),
brings up deploy/docker-compose.yml (certs, coordinator, 5 peers of which one
is a standby, Prometheus; mutual TLS everywhere), and then:

  shape        a token bucket (tbf, 200 Mbit/s) on every peer's eth0, from inside
               the container (`docker exec -u 0 ... tc`), checked with `tc qdisc
               show` (this kernel has no netem, so no added delay)
  train        the grid is complete and the step advances
  prometheus   every scrape target is up (coordinator + 5 peers)
  kill a peer  `docker kill` a placed peer: the standby is placed in its stead
               (the planner may move others too), the step passes the step at
               the kill, and the loss keeps falling
  kill the coordinator
               `docker kill`, then `start` (docker kill is a manual stop, so
               the restart policy does not apply): it restarts from its volume
               (same assignment history, no new swarm) and training continues
  down         `down` keeps the named volumes

Prints one JSON line with the recovery times (kill -> training resumes). The
project name is unique per run; everything is removed at the end (`down -v`),
and on failure the containers' logs are printed first.

Without a Docker engine or a compose tool it says so and exits 77 (ctest
SKIP_RETURN_CODE): scripts/docker_engine.sh installs and starts Debian's.

usage: compose_test.py AQSWARM_BINARY [REPO_ROOT]
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

SKIP = 77
BIN = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else ""
ROOT = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", ".."))
PROJECT = "aqswarmci%d" % os.getpid()
PEERS = ["peer1", "peer2", "peer3", "peer4", "peer5"]
# Each phase's bound, in seconds: a failure says which one ran out.
UP_S, STEP_S, TARGETS_S, RECOVER_S = 300, 240, 90, 240

# The job: a small 2-stage GPT, 2 pipelines with QuantizedAdam, AQ-SGD links;
# enough steps that it is still training when the test ends.
JOB = {
    "name": "compose-ci", "seed": 5,
    "model": {"seqLen": 32, "dModel": 32, "nLayer": 2, "nHead": 2},
    "data": {"corpus": "data/sotu", "tokenizer": "data/gpt2"},
    "optimizer": {"lr": 0.005, "minLr": 0.001, "warmupSteps": 2, "totalSteps": 5000, "weightDecay": 0.0,
                  "gradClip": 1.0},
    "microBatchSize": 2, "microBatchesPerStep": 2, "epochs": 1, "maxSteps": 5000,
    "compression": {"mode": "aqsgd", "fwBits": 3, "bwBits": 6, "warmupEpochs": 0, "mPrecision": "fp16"},
    "stages": 2, "dataParallel": 2,
    "dp": {"optimizer": "quantized_adam", "warmupSteps": 3, "bits": 4, "bucketSize": 512},
    "threads": 1, "evalEverySteps": 0, "evalBatches": 1,
}
OVERRIDE = """services:
  coordinator:
    volumes:
      - ./job.json:/opt/aqswarm/jobs/compose-ci.json:ro
"""


def log(msg):
    print("[%7.1f s] %s" % (time.monotonic() - T0, msg), flush=True)


def run(cmd, check=True, timeout=600, **kw):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError("%s exited %d:\n%s" % (" ".join(cmd), r.returncode, r.stdout[-3000:]))
    return r


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Swarm:
    def __init__(self, tool, workdir, env):
        self.tool, self.workdir, self.env = tool, workdir, env

    def compose(self, *args, check=True, timeout=600):
        return run(self.tool + ["-p", PROJECT, "-f", "docker-compose.yml", "-f", "override.yml"] + list(args),
                   check=check, timeout=timeout, cwd=self.workdir, env=self.env)

    def container(self, service):
        cid = self.compose("ps", "-q", service).stdout.strip()
        if not cid:
            raise RuntimeError("no container for service %s" % service)
        return cid

    def status(self):
        """The coordinator's Status as a dict, or None while it does not answer."""
        try:
            r = run(["docker", "exec", self.container("coordinator"), "aqswarm", "status",
                     "--coordinator=127.0.0.1:7000", "--tls_dir=/tls", "--name=coordinator", "--json"],
                    check=False, timeout=30)
        except (RuntimeError, subprocess.TimeoutExpired):
            return None
        wait_for.seen = r.stdout[-2000:]
        if r.returncode != 0:
            return None
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                st = json.loads(line)
                wait_for.seen = {k: st.get(k) for k in ("step", "loss", "grid_complete", "assignment_version")}
                wait_for.seen["placed"] = placed(st)
                return st
        return None


def wait_for(what, bound_s, probe, every_s=1.0):
    """Polls probe() until it returns a true value; returns (value, seconds)."""
    start = time.monotonic()
    while time.monotonic() - start < bound_s:
        got = probe()
        if got:
            return got, time.monotonic() - start
        time.sleep(every_s)
    raise RuntimeError("timed out after %d s waiting for %s (last seen: %s)" % (bound_s, what, wait_for.seen))


wait_for.seen = None  # what the last probe saw, for the timeout's message


def placed(st):
    return {p["peer_name"]: (p["stage"], p["pipeline"]) for p in st.get("peers", [])
            if p.get("state") in ("ACTIVE", "WAITING") and p.get("stage", -1) >= 0}


def targets_up(prom_port):
    with urllib.request.urlopen("http://127.0.0.1:%d/api/v1/targets" % prom_port, timeout=5) as r:
        active = json.load(r)["data"]["activeTargets"]
    wait_for.seen = [(t["labels"]["instance"], t["health"], t.get("lastError")) for t in active]
    return {t["labels"]["instance"]: t["health"] for t in active}


def main():
    global T0
    T0 = time.monotonic()
    if not BIN or not os.access(BIN, os.X_OK):
        sys.exit("usage: compose_test.py AQSWARM_BINARY [REPO_ROOT]")
    if shutil.which("docker") is None or run(["docker", "info"], check=False, timeout=60).returncode != 0:
        print("SKIP: no Docker engine answers `docker info` (scripts/docker_engine.sh installs and starts one)")
        return SKIP
    if shutil.which("docker-compose"):
        tool = ["docker-compose"]
    elif run(["docker", "compose", "version"], check=False).returncode == 0:
        tool = ["docker", "compose"]
    else:
        print("SKIP: neither docker-compose nor `docker compose` is installed (Debian: docker-compose)")
        return SKIP
    if shutil.which("mmdebstrap") is None and run(["docker", "image", "inspect", "aqswarm-base:bookworm"],
                                                  check=False).returncode != 0:
        print("SKIP: no aqswarm-base:bookworm image and no mmdebstrap to make it (apt-get install mmdebstrap)")
        return SKIP

    log("images: deploy/build-images.sh --prebuilt %s" % BIN)
    r = run([os.path.join(ROOT, "deploy", "build-images.sh"), "--prebuilt", BIN], timeout=900)
    print(r.stdout.strip())
    images_s = time.monotonic() - T0

    work = tempfile.mkdtemp(prefix="aqswarm_compose_")
    for f in ("docker-compose.yml", "prometheus.yml", "prometheus.Dockerfile"):
        shutil.copy(os.path.join(ROOT, "deploy", f), work)
    with open(os.path.join(work, "job.json"), "w") as fh:
        json.dump(JOB, fh)
    with open(os.path.join(work, "override.yml"), "w") as fh:
        fh.write(OVERRIDE)
    os.chmod(work, 0o755)
    prom_port = free_port()
    env = dict(os.environ, AQSWARM_JOB="jobs/compose-ci.json", AQSWARM_SWARM="ci",
               AQSWARM_COORDINATOR_PORT=str(free_port()), AQSWARM_PROMETHEUS_PORT=str(prom_port))
    env.pop("DOCKER_BUILDKIT", None)
    swarm = Swarm(tool, work, env)
    result = {"images_s": round(images_s, 1)}
    ok = False
    try:
        log("up")
        t = time.monotonic()
        swarm.compose("up", "-d", "--no-build", timeout=UP_S)
        result["up_s"] = round(time.monotonic() - t, 1)

        # Links shaped inside each peer container (NET_ADMIN; tc from iproute2).
        for p in PEERS:
            cid = swarm.container(p)
            run(["docker", "exec", "-u", "0", cid, "tc", "qdisc", "replace", "dev", "eth0", "root",
                 "tbf", "rate", "200mbit", "burst", "64kb", "latency", "50ms"])
            shown = run(["docker", "exec", cid, "tc", "qdisc", "show", "dev", "eth0"]).stdout
            assert "tbf" in shown and "200Mbit" in shown, "%s: tc shows no tbf on eth0: %s" % (p, shown)
        log("shaped eth0 of %s: tbf rate 200mbit" % ", ".join(PEERS))

        st, secs = wait_for("a complete grid and step >= 5", STEP_S,
                            lambda: (lambda s: s if s and s.get("grid_complete") and int(s["step"]) >= 5
                                     and s.get("loss", 0) > 0 else None)(swarm.status()))
        result["first_steps_s"] = round(secs, 1)
        first_loss = st["loss"]
        where = placed(st)
        log("training: step %s loss %.4f placed %s" % (st["step"], first_loss, where))
        assert len(where) == 4, "4 peers placed: %s" % where
        standby = [p for p in PEERS if p not in where]
        assert len(standby) == 1, "one standby: %s" % standby

        # Every process's target: the coordinator, each peer daemon (9190), each placed
        # peer's stage (9090; a standby runs no stage).
        def live_targets(peers, where):
            return {"coordinator:9090"} | {"%s:9190" % p for p in peers} | {"%s:9090" % p for p in where}

        want = live_targets(PEERS, where)
        up, secs = wait_for("every Prometheus target up", TARGETS_S,
                            lambda: (lambda t: t if all(t.get(x) == "up" for x in want) else None)(
                                targets_up(prom_port)), every_s=2)
        assert len(up) == len(want) + 1, "Prometheus scrapes %s" % sorted(up)  # + the standby's stage
        log("prometheus: %d targets up (and the standby's stage target: %s)" % (len(want), up[standby[0] + ":9090"]))

        # A placed peer is killed: the standby is placed instead (the re-plan may move others).
        victim = sorted(where)[0]
        st = swarm.status()
        kill_step = int(st["step"])
        swarm.compose("kill", victim)
        t_kill = time.monotonic()
        log("killed %s (slot %s) at step %d" % (victim, where[victim], kill_step))
        st, _ = wait_for("the standby %s placed instead of %s" % (standby[0], victim), RECOVER_S,
                         lambda: (lambda s: s if s and s.get("grid_complete") and standby[0] in placed(s) and
                                  victim not in placed(s) else None)(swarm.status()))
        result["peer_kill_to_standby_placed_s"] = round(time.monotonic() - t_kill, 1)
        st, _ = wait_for("the step past %d after the peer kill" % kill_step, RECOVER_S,
                         lambda: (lambda s: s if s and s.get("grid_complete") and int(s["step"]) > kill_step
                                  else None)(swarm.status()))
        result["peer_kill_to_training_resumed_s"] = round(time.monotonic() - t_kill, 1)
        where = placed(st)
        log("standby %s placed; step %s (resumed %.1f s after the kill); placed %s" %
            (standby[0], st["step"], result["peer_kill_to_training_resumed_s"], where))

        # The coordinator is killed and started again from its volume.
        st = swarm.status()
        version, coord_kill_step = int(st["assignment_version"]), int(st["step"])
        swarm.compose("kill", "coordinator")
        t_kill = time.monotonic()
        swarm.compose("start", "coordinator")
        log("killed and started the coordinator at step %d (assignment version %d)" % (coord_kill_step, version))
        st, _ = wait_for("the coordinator answering again", RECOVER_S, swarm.status)
        result["coordinator_kill_to_status_s"] = round(time.monotonic() - t_kill, 1)
        assert int(st["assignment_version"]) >= version, "the restarted coordinator lost its assignment " \
            "history (version %s < %d)" % (st["assignment_version"], version)
        st, _ = wait_for("the step past %d after the coordinator restart" % coord_kill_step, RECOVER_S,
                         lambda: (lambda s: s if s and s.get("grid_complete") and
                                  int(s["step"]) > coord_kill_step + 5 else None)(swarm.status()))
        result["coordinator_kill_to_training_resumed_s"] = round(time.monotonic() - t_kill, 1)
        assert placed(st) == where, "the placement survived the restart: %s, was %s" % (placed(st), where)
        result["first_loss"], result["last_loss"], result["last_step"] = first_loss, st["loss"], int(st["step"])
        log("coordinator back; step %s loss %.4f" % (st["step"], st["loss"]))
        assert st["loss"] < first_loss, "the loss fell: %.4f at the start, %.4f now" % (first_loss, st["loss"])

        live = live_targets([p for p in PEERS if p != victim], placed(st))
        wait_for("every live Prometheus target up again", TARGETS_S,
                 lambda: (lambda t: t if t and all(t.get(x) == "up" for x in live) else None)(targets_up(prom_port)),
                 every_s=2)
        log("prometheus: every live target up (%d)" % len(live))

        # `down` keeps the volumes.
        swarm.compose("down")
        vols = run(["docker", "volume", "ls", "-q", "--filter", "label=com.docker.compose.project=" + PROJECT])
        vols = set(vols.stdout.split())
        for v in ("coordinator-state", "peer1-store", "prometheus-data"):
            assert "%s_%s" % (PROJECT, v) in vols, "down kept volume %s: %s" % (v, sorted(vols))
        log("down kept %d volumes" % len(vols))
        ok = True
    finally:
        if not ok:
            r = swarm.compose("logs", "--no-color", "--tail=40", check=False, timeout=120)
            print(r.stdout[-20000:])
        swarm.compose("down", "-v", "--remove-orphans", check=False, timeout=300)
        shutil.rmtree(work, ignore_errors=True)
    result["total_s"] = round(time.monotonic() - T0, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    import script_test
    script_test.run(main)
