#!/usr/bin/env python3
"""Checks deploy/ (Dockerfile, docker-compose.yml, prometheus.yml, Grafana
provisioning) against the real `aqswarm` binary, without a Docker engine
(tests/integration/compose_test.py builds the images and runs the swarm
where one runs). What it checks:

  compose    `docker-compose config` / `docker compose config` when either
             works (else PyYAML + ${VAR:-default} interpolation); services,
             health checks, depends_on, volumes
  flags      every aqswarm service's command line and aqswarm health check is
             accepted by the binary (`aqswarm ... --dry_run`)
  ports      every --*listen port is exposed/published and every exposed or
             published port is listened on; --*advertise names the service
             itself and its listen port; --coordinator names the coordinator
             service's --listen port
  tls        deploy/init-certs.sh (the `certs` service), run for real with the
             compose command's arguments: every process's --tls_dir mount holds
             a certificate for its --name that chains to the CA and carries the
             name it is dialed by; peers' --join_token=@FILE exists; the
             coordinator's join.secret is the one the tokens were issued with
  live       the coordinator's compose command line (paths and ports mapped to
             a temp dir and free local ports) serves mTLS with that material,
             its compose health check passes, its metrics endpoint answers
  prometheus deploy/prometheus.yml (when present): promtool accepts it, its
             targets are exactly the aqswarm services' metrics ports
  grafana    deploy/grafana/provisioning (when present): the dashboards
             provider's path is where compose mounts dashboards/, the
             datasource URL is the prometheus service's port
  dockerfile Debian bookworm stages; the builder installs scripts/setup.sh's
             packages; the runtime stage installs the Debian packages owning
             every library the binary links (via dpkg), and no -dev packages;
             every COPY source exists and is not excluded by .dockerignore

usage: deploy_test.py AQSWARM_BINARY [REPO_ROOT]
"""
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

try:
    import yaml
except ImportError:  # ctest reports a skip (SKIP_RETURN_CODE 77), not a pass
    print("SKIP: deploy_test.py needs PyYAML (Debian package python3-yaml)")
    sys.exit(77)

BIN = os.path.abspath(sys.argv[1])
ROOT = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", ".."))
DEPLOY = os.path.join(ROOT, "deploy")
COMPOSE_FILE = os.path.join(DEPLOY, "docker-compose.yml")

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)
    return ok


def run(argv, **kw):
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


# ------------------------------------------------------------------ compose --
def clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AQSWARM_", "GRAFANA_", "COMPOSE_"))}
    return env


def interpolate(value, env):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, $VAR and $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m):
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        if m.group(2) is not None:
            op, default = m.group(2), m.group(3)
            if name in env and (op == "-" or env[name] != ""):
                return env[name]
            return default
        return env.get(name, "")

    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)", sub, value)


def load_compose():
    """Returns (config dict, how). Prefers the real tool's normalized config."""
    env = clean_env()
    tools = []
    if os.environ.get("DEPLOY_TEST_NO_COMPOSE") != "1":
        if shutil.which("docker-compose"):
            tools.append(["docker-compose"])
        if shutil.which("docker") and run(["docker", "compose", "version"], env=env).returncode == 0:
            tools.append(["docker", "compose"])
    for tool in tools:
        # --profile: include the optional Grafana.
        r = subprocess.run(tool + ["-f", COMPOSE_FILE, "--profile", "grafana", "config"], cwd=DEPLOY, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        check(r.returncode == 0, "%s config accepts deploy/docker-compose.yml%s" %
              (" ".join(tool), "" if r.returncode == 0 else ":\n" + r.stderr[-2000:]))
        if r.returncode == 0:
            return yaml.safe_load(r.stdout), " ".join(tool) + " config"
    with open(COMPOSE_FILE) as f:
        raw = yaml.safe_load(f)
    check(isinstance(raw, dict) and isinstance(raw.get("services"), dict), "compose file parses (PyYAML)")
    raw = {k: v for k, v in raw.items() if not k.startswith("x-")}
    return interpolate(raw, env), "PyYAML + own interpolation"


def as_argv(v):
    if v is None:
        return []
    return shlex.split(v) if isinstance(v, str) else [str(x) for x in v]


def container_ports(svc):
    """(published container ports, exposed container ports) as sets of ints."""
    published, exposed = set(), set()
    for p in svc.get("ports", []) or []:
        if isinstance(p, dict):
            published.add(int(p["target"]))
        else:
            spec = str(p).split("/")[0]
            published.add(int(spec.rsplit(":", 1)[-1]))
    for p in svc.get("expose", []) or []:
        exposed.add(int(str(p).split("/")[0]))
    return published, exposed


def mounts(svc):
    """[(source, target, read_only)]; relative host paths made absolute from deploy/."""
    out = []
    for v in svc.get("volumes", []) or []:
        if isinstance(v, dict):
            src, dst, ro = v.get("source", ""), v["target"], bool(v.get("read_only"))
        else:
            parts = str(v).split(":")
            src, dst = parts[0], parts[1]
            ro = len(parts) > 2 and "ro" in parts[2].split(",")
        if src.startswith((".", "/")):
            src = os.path.normpath(os.path.join(DEPLOY, src))
        out.append((src, dst, ro))
    return out


def flags_of(argv):
    flags = {}
    for a in argv:
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            flags[k] = v
    return flags


def hostport(s):
    host, port = s.rsplit(":", 1)
    return host, int(port)


def dry_run(argv, what):
    r = run([BIN] + argv + ["--dry_run"])
    if r.returncode == 0 and "dry run: flags accepted" in r.stdout:
        return check(True, "%s: `aqswarm %s` is accepted" % (what, " ".join(argv)))
    return check(False, "%s: the binary rejects its command line (rc %d): %s\n     `aqswarm %s`" %
                 (what, r.returncode, r.stdout.strip()[-600:], " ".join(argv)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------- the checks --
def main():
    cfg, how = load_compose()
    print("compose config via", how)
    services = cfg.get("services", {})
    named_volumes = set((cfg.get("volumes") or {}).keys())

    # The aqswarm services: those running the image the `certs` service builds.
    builders = [s for s in services.values() if s.get("build") and str(s.get("image", "")).startswith("aqswarm:")]
    check(len(builders) == 1, "exactly one service builds the aqswarm image")
    image = builders[0].get("image") if builders else None
    aq = {n: s for n, s in services.items() if s.get("image") == image and not s.get("entrypoint")}
    init = {n: s for n, s in services.items() if s.get("image") == image and s.get("entrypoint")}
    if builders:
        b = builders[0]["build"]
        ctx = b if isinstance(b, str) else b.get("context", ".")
        ctx = os.path.normpath(os.path.join(DEPLOY, ctx))
        dockerfile = os.path.join(ctx, b.get("dockerfile", "Dockerfile") if isinstance(b, dict) else "Dockerfile")
        check(ctx == ROOT and os.path.samefile(dockerfile, os.path.join(DEPLOY, "Dockerfile")),
              "image built from deploy/Dockerfile with the repository root as context")

    commands = {n: as_argv(s.get("command")) for n, s in aq.items()}
    coords = [n for n, a in commands.items() if a[:1] == ["coordinator"]]
    peers = [n for n, a in commands.items() if a[:1] == ["peer"]]
    check(len(coords) == 1, "one coordinator service (%s)" % coords)
    always_peers = [n for n in peers if not services[n].get("profiles")]
    check(len(always_peers) >= 4, "at least 4 peers without a profile (2 stages x 2 pipelines): %s" % always_peers)
    for extra in ("prometheus", "grafana"):
        check(extra in services, "service %s present" % extra)

    # flags: the binary accepts every command line and aqswarm health check.
    for n, argv in commands.items():
        dry_run(argv, n)
        hc = as_argv((aq[n].get("healthcheck") or {}).get("test"))
        check(bool(hc) and hc[0] in ("CMD", "CMD-SHELL"), "%s: has a health check" % n)
        if hc[:1] == ["CMD"] and hc[1:2] == ["aqswarm"]:
            dry_run(hc[2:], n + " health check")
        check(bool(aq[n].get("init")), "%s: init: true (signals reach aqswarm, which leaves cleanly)" % n)
    for n, s in services.items():
        if n not in aq:
            check(bool((s.get("healthcheck") or {}).get("test")) or n in init, "%s: has a health check" % n)

    # ports and addresses.
    coord_name = coords[0] if coords else None
    coord_flags = flags_of(commands[coord_name]) if coord_name else {}
    metrics_ports = {}
    for n, argv in commands.items():
        f = flags_of(argv)
        published, exposed = container_ports(aq[n])
        listened = {}
        for flag in ("listen", "exchange_listen", "state_listen", "metrics_listen", "daemon_metrics_listen"):
            if flag in f:
                host, port = hostport(f[flag])
                check(host == "0.0.0.0", "%s: --%s binds all interfaces (%s)" % (n, flag, f[flag]))
                check(port != 0, "%s: --%s has a fixed port" % (n, flag))
                check(port in published | exposed, "%s: --%s port %d is exposed or published" % (n, flag, port))
                listened[flag] = port
        check(set(listened.values()) == published | exposed,
              "%s: exposed/published ports %s == listened ports %s" %
              (n, sorted(published | exposed), sorted(set(listened.values()))))
        check("metrics_listen" in f, "%s: serves metrics (--metrics_listen)" % n)
        # Every metrics endpoint: the process's (a peer's stage while placed) and a peer daemon's own.
        metrics_ports[n] = {listened[k] for k in ("metrics_listen", "daemon_metrics_listen") if k in listened}
        if argv[:1] == ["peer"]:
            check("daemon_metrics_listen" in f, "%s: serves its daemon's metrics (--daemon_metrics_listen), "
                  "which a standby does too" % n)
        for adv, lis in (("advertise", "listen"), ("exchange_advertise", "exchange_listen"),
                         ("state_advertise", "state_listen")):
            if adv in f:
                host, port = hostport(f[adv])
                check(host == n and port == listened.get(lis),
                      "%s: --%s=%s names the service and its --%s port" % (n, adv, f[adv], lis))
        if n in peers:
            for need in ("advertise", "exchange_advertise", "exchange_listen", "work_dir", "tls_dir", "name",
                         "join_token"):
                check(need in f, "%s: sets --%s" % (n, need))
            check(f.get("name") == n, "%s: --name is the service name" % n)
            if "coordinator" in f and coord_name:
                host, port = hostport(f["coordinator"])
                check(host == coord_name and port == hostport(coord_flags.get("listen", ":0"))[1],
                      "%s: --coordinator=%s is the coordinator service's --listen port" % (n, f["coordinator"]))
            dep = aq[n].get("depends_on") or {}
            check(isinstance(dep, dict) and (dep.get(coord_name) or {}).get("condition") == "service_healthy",
                  "%s: waits for a healthy coordinator" % n)
        for d in ("work_dir", "state_dir"):
            if d in f:
                check(any(src in named_volumes and (f[d] + "/").startswith(dst.rstrip("/") + "/")
                          for src, dst, _ in mounts(aq[n])), "%s: --%s=%s is on a named volume" % (n, d, f[d]))
        if init:
            dep = aq[n].get("depends_on") or {}
            check(all((dep.get(i) or {}).get("condition") == "service_completed_successfully" for i in init),
                  "%s: starts after the certs service completed" % n)

    # tls: run the certs service's script for real with its compose arguments.
    tmp = tempfile.mkdtemp(prefix="aqswarm-deploy-test.")
    try:
        check_tls_and_live(services, init, aq, commands, coord_name, tmp, metrics_ports)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    check_prometheus(services, metrics_ports)
    check_grafana(services)
    check_dockerfile()
    check_build_images_args()


def tls_mount(n, svc, tls_dir):
    for src, dst, ro in mounts(svc):
        if dst.rstrip("/") == tls_dir.rstrip("/"):
            return src, ro
    return None, None


def check_tls_and_live(services, init, aq, commands, coord_name, tmp, metrics_ports):
    if not check(len(init) == 1, "one init service creates the TLS material (%s)" % sorted(init)):
        return
    (iname, isvc), = init.items()
    entry = as_argv(isvc.get("entrypoint"))
    check(entry == ["aqswarm-init-certs"], "%s: runs aqswarm-init-certs (deploy/init-certs.sh)" % iname)
    args = as_argv(isvc.get("command"))
    out_in_container = args[0]
    host_out = None
    for src, dst, ro in mounts(isvc):
        if dst.rstrip("/") == out_in_container.rstrip("/"):
            host_out = src
            check(not ro, "%s: writes its output mount" % iname)
    check(host_out is not None, "%s: its output dir %s is a mount" % (iname, out_in_container))
    # A PATH where `aqswarm` is the binary under test and the script has its image name.
    bindir = os.path.join(tmp, "bin")
    os.makedirs(bindir)
    os.symlink(BIN, os.path.join(bindir, "aqswarm"))
    os.symlink(os.path.join(DEPLOY, "init-certs.sh"), os.path.join(bindir, "aqswarm-init-certs"))
    env = clean_env()
    env.update({k: str(v) for k, v in (isvc.get("environment") or {}).items()})
    env["AQSWARM_UID"] = str(os.getuid())
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    out = os.path.join(tmp, "tls")
    r = run(["aqswarm-init-certs", out] + args[1:], env=env)
    if not check(r.returncode == 0, "%s: deploy/init-certs.sh %s succeeds%s" %
                 (iname, " ".join(args[1:]), "" if r.returncode == 0 else ":\n" + r.stdout[-1500:])):
        return
    r2 = run(["aqswarm-init-certs", out] + args[1:], env=env)
    check(r2.returncode == 0, "%s: running it again keeps the CA (idempotent)" % iname)
    swarm = env.get("AQSWARM_SWARM", "")
    with open(os.path.join(out, "ca", "join.secret"), "rb") as f:
        secret = f.read()

    for n, argv in commands.items():
        f = flags_of(argv)
        tls_dir = f.get("tls_dir")
        if not check(bool(tls_dir), "%s: runs with --tls_dir (mutual TLS)" % n):
            continue
        src, ro = tls_mount(n, aq[n], tls_dir)
        name = f.get("name", "coordinator" if n == coord_name else "")
        want_src = os.path.join(host_out or "", name)
        check(src == want_src and ro, "%s: mounts %s read-only at --tls_dir=%s (got %s)" % (n, want_src, tls_dir, src))
        local = os.path.join(out, name)
        r = run([BIN, "certs", "show", "--tls_dir", local, "--name", name])
        check(r.returncode == 0 and "ok: " in r.stdout, "%s: certs show accepts %s/%s.pem%s" %
              (n, local, name, "" if r.returncode == 0 else ": " + r.stdout[-400:]))
        dns = re.search(r"%s\.pem:\n(?:.*\n)*?\s+dns\s+(\S+)" % re.escape(name), r.stdout)
        check(dns is not None and n in dns.group(1).split(","),
              "%s: its certificate names the service (DNS SAN %s)" % (n, dns.group(1) if dns else None))
        check(not os.path.exists(os.path.join(local, "ca.key")), "%s: the CA key is not in its TLS dir" % n)
        if n == coord_name:
            with open(os.path.join(local, "join.secret"), "rb") as fh:
                check(fh.read() == secret, "%s: join.secret is the one tokens are issued with" % n)
            check(f.get("swarm") == swarm, "coordinator --swarm=%s == the tokens' swarm %s" % (f.get("swarm"), swarm))
        tok = f.get("join_token", "")
        if tok.startswith("@"):
            rel = os.path.relpath(tok[1:], tls_dir)
            path = os.path.join(local, rel)
            ok = not rel.startswith("..") and os.path.isfile(path)
            check(ok, "%s: --join_token=%s is written by %s" % (n, tok, iname))
            if ok:
                with open(path) as fh:
                    check(fh.read().startswith("aqj1."), "%s: the token file holds a join token" % n)

    if coord_name:
        live_coordinator(aq[coord_name], commands[coord_name], out, tmp, next(iter(metrics_ports.get(coord_name) or []), None))


def live_coordinator(svc, argv, out, tmp, metrics_port):
    """Runs the coordinator's compose command line on local ports and temp dirs,
    then its compose health check against it."""
    f = flags_of(argv)
    port, mport = free_port(), free_port()
    mapping = {"listen": "127.0.0.1:%d" % port, "tls_dir": os.path.join(out, f.get("name", "coordinator")),
               "state_dir": os.path.join(tmp, "coordinator-state"), "metrics_listen": "127.0.0.1:%d" % mport}
    local = [a if not (a.startswith("--") and "=" in a and a[2:].split("=", 1)[0] in mapping)
             else "--%s=%s" % (a[2:].split("=", 1)[0], mapping[a[2:].split("=", 1)[0]]) for a in argv]
    proc = subprocess.Popen([BIN] + local, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not check(line.startswith("{") and "listening" in json.loads(line),
                     "live: the coordinator's compose command serves (%s)" % (line.strip() or proc.stderr.read()[-800:])):
            return
        hc = as_argv((svc.get("healthcheck") or {}).get("test"))[1:]
        hmap = {"coordinator": mapping["listen"], "tls_dir": mapping["tls_dir"]}
        hc = [a if not (a.startswith("--") and a[2:].split("=", 1)[0] in hmap)
              else "--%s=%s" % (a[2:].split("=", 1)[0], hmap[a[2:].split("=", 1)[0]]) for a in hc]
        if hc[:1] == ["aqswarm"]:
            r = run([BIN] + hc[1:])
            check(r.returncode == 0 and "job " in r.stdout,
                  "live: the coordinator's health check passes over mTLS (%s)" %
                  (r.stdout.strip().splitlines() or [""])[0][:300])
        if metrics_port:
            body = ""
            for _ in range(50):
                try:
                    body = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % mport, timeout=2).read().decode()
                    break
                except OSError:
                    time.sleep(0.1)
            check("# TYPE" in body, "live: the coordinator's metrics endpoint answers")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def check_prometheus(services, metrics_ports):
    path = os.path.join(DEPLOY, "prometheus.yml")
    if not os.path.exists(path):
        print("skip prometheus: deploy/prometheus.yml does not exist")
        return
    if shutil.which("promtool"):
        r = run(["promtool", "check", "config", path])
        check(r.returncode == 0, "promtool check config deploy/prometheus.yml%s" %
              ("" if r.returncode == 0 else ": " + r.stdout[-800:]))
    with open(path) as fh:
        prom = yaml.safe_load(fh)
    targets = set()
    for job in prom.get("scrape_configs", []):
        for sc in job.get("static_configs", []):
            targets.update(sc.get("targets", []))
    want = {"%s:%d" % (n, p) for n, ps in metrics_ports.items() if not services[n].get("profiles") for p in ps}
    optional = {"%s:%d" % (n, p) for n, ps in metrics_ports.items() if services[n].get("profiles") for p in ps}
    check(want <= targets, "prometheus.yml scrapes every aqswarm service's metrics port (missing: %s)" %
          sorted(want - targets))
    check(targets <= want | optional, "every prometheus.yml target is an aqswarm metrics port (unknown: %s)" %
          sorted(targets - want - optional))
    svc = services.get("prometheus", {})
    check(any(src == path for src, _, _ in mounts(svc)), "the prometheus service mounts deploy/prometheus.yml")
    listen = [a.split("=", 1)[1] for a in as_argv(svc.get("command")) if a.startswith("--web.listen-address=")]
    pport = hostport(listen[0])[1] if listen else 9090
    published, exposed = container_ports(svc)
    check(pport in published, "prometheus publishes its web port %d" % pport)
    for n, ps in metrics_ports.items():
        check(pport not in ps or n == "prometheus", "%s: metrics port differs from Prometheus's own" % n)
    check_prometheus.port = pport


def check_grafana(services):
    prov = os.path.join(DEPLOY, "grafana", "provisioning")
    if not os.path.isdir(prov):
        print("skip grafana: deploy/grafana/provisioning does not exist")
        return
    svc = services.get("grafana", {})
    ms = mounts(svc)
    check(any(src == prov and dst == "/etc/grafana/provisioning" for src, dst, _ in ms),
          "grafana mounts deploy/grafana/provisioning at /etc/grafana/provisioning")
    dash_src = os.path.join(ROOT, "dashboards")
    dash_dst = [dst for src, dst, _ in ms if src == dash_src]
    check(len(dash_dst) == 1, "grafana mounts dashboards/")
    for root, _, files in os.walk(os.path.join(prov, "dashboards")):
        for fn in files:
            if fn.endswith((".yml", ".yaml")):
                with open(os.path.join(root, fn)) as fh:
                    doc = yaml.safe_load(fh)
                for p in doc.get("providers", []):
                    path = (p.get("options") or {}).get("path")
                    check(path in dash_dst, "grafana provider %s reads %s, where compose mounts dashboards/" %
                          (p.get("name"), path))
    for root, _, files in os.walk(os.path.join(prov, "datasources")):
        for fn in files:
            if fn.endswith((".yml", ".yaml")):
                with open(os.path.join(root, fn)) as fh:
                    doc = yaml.safe_load(fh)
                for d in doc.get("datasources", []):
                    url = d.get("url", "")
                    m = re.match(r"https?://([^:/]+):(\d+)", url)
                    port = getattr(check_prometheus, "port", 9090)
                    check(m is not None and m.group(1) == "prometheus" and int(m.group(2)) == port,
                          "grafana datasource %s -> %s is the prometheus service's port %d" % (d.get("name"), url, port))
    for fn in os.listdir(dash_src) if os.path.isdir(dash_src) else []:
        if fn.endswith(".json"):
            try:
                with open(os.path.join(dash_src, fn)) as fh:
                    json.load(fh)
                check(True, "dashboards/%s is JSON" % fn)
            except ValueError as e:
                check(False, "dashboards/%s is JSON: %s" % (fn, e))


# --------------------------------------------------------------- Dockerfile --
def dockerfile_stages(text):
    text = re.sub(r"\\\n", " ", text)
    stages, cur = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            cur = m.group(2) or str(len(stages))
            stages[cur] = {"from": m.group(1), "lines": []}
        elif cur is not None:
            stages[cur]["lines"].append((word.upper(), rest))
    return stages


def apt_packages(lines):
    pkgs = set()
    for word, rest in lines:
        if word == "RUN" and "apt-get install" in rest:
            for cmd in rest.split("&&"):
                if "apt-get install" in cmd:
                    pkgs.update(t for t in shlex.split(cmd.split("apt-get install", 1)[1]) if not t.startswith("-"))
    return pkgs


CUDA_LIB = re.compile(r"^lib(cuda|cudart|nccl|nvrtc|nvToolsExt|cublas|cublasLt|cufft|curand|cusparse|cusolver|cudnn|"
                      r"c10_cuda|torch_cuda)\b")


def cuda_build(binary):
    """True when `binary`'s build tree was configured with -DAQSWARM_WITH_CUDA=ON."""
    d = os.path.dirname(binary)
    while True:
        cache = os.path.join(d, "CMakeCache.txt")
        if os.path.exists(cache):
            with open(cache) as fh:
                return re.search(r"^AQSWARM_WITH_CUDA:BOOL=(ON|TRUE|1)$", fh.read(), re.M | re.I) is not None
        parent = os.path.dirname(d)
        if parent == d:
            return False
        d = parent


def check_build_images_args():
    """deploy/build-images.sh refuses bad arguments with a clear error (exit 2) before it needs an engine."""
    script = os.path.join(DEPLOY, "build-images.sh")
    for args, want in ((["--bogus"], "unknown argument: --bogus"), (["--prebuilt"], "--prebuilt needs a binary"),
                       (["--prebuilt", "/nonexistent/aqswarm"], "is not an executable file")):
        r = run([script] + args)
        check(r.returncode == 2 and want in r.stdout, "build-images.sh %s: exit 2, says '%s' (got %d: %s)" %
              (" ".join(args), want, r.returncode, r.stdout.strip()[-200:]))
    r = run([script, "--help"])
    check(r.returncode == 0 and "--prebuilt" in r.stdout, "build-images.sh --help describes --prebuilt")


def check_dockerfile():
    with open(os.path.join(DEPLOY, "Dockerfile")) as fh:
        text = fh.read()
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    stages = dockerfile_stages(text)
    check(len(stages) >= 2, "Dockerfile is multi-stage (%s)" % list(stages))
    for name, st in stages.items():
        base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), st["from"])
        check(base in stages or base.startswith("debian:bookworm"), "stage %s is Debian bookworm (%s)" % (name, base))
    # scripts/setup.sh's packages are what the builder installs (tools excepted).
    with open(os.path.join(ROOT, "scripts", "setup.sh")) as fh:
        setup = fh.read()
    setup_pkgs = set(re.search(r"PACKAGES=\(([^)]*)\)", setup).group(1).split())
    not_for_building = {"prometheus", "gnuplot-nox", "iproute2", "iptables", "python3-yaml", "python3-protobuf",
                        "libclang-rt-14-dev"}  # tools, tests, scripts (the last: scripts/fuzz.sh)
    builder = stages.get("builder", {"lines": []})
    missing = setup_pkgs - not_for_building - apt_packages(builder["lines"])
    check(not missing, "the builder stage installs scripts/setup.sh's packages (missing: %s)" % sorted(missing))
    check(any(w == "RUN" and "cmake" in r and "--target aqswarm" in r and "Ninja" in r for w, r in builder["lines"]),
          "the builder builds the aqswarm target with CMake + Ninja")
    final = list(stages)[-1]
    # The runtime stage with the stages it is built FROM (runtime-base).
    rt = {"lines": []}
    name = final
    while name in stages:
        rt["lines"] = stages[name]["lines"] + rt["lines"]
        name = stages[name]["from"]
    rt_pkgs = apt_packages(rt["lines"])
    check(not [p for p in rt_pkgs if p.endswith("-dev") or p in ("build-essential", "cmake", "clang", "npm")],
          "the runtime stage (%s) installs no build tools or -dev packages" % final)
    check(any(w == "COPY" and "--from=builder" in r and "/usr/local/bin/aqswarm" in r for w, r in rt["lines"]),
          "the runtime stage copies the aqswarm binary from the builder")
    check(any(w == "COPY" and "--from=" not in r and re.search(r"\sdata/ data/$", r) for w, r in rt["lines"]),
          "the runtime stage copies data/ (scripts/fetch_data.sh's) from the build context")
    workdir = [r for w, r in rt["lines"] if w == "WORKDIR"]
    check(workdir == ["/opt/aqswarm"], "runtime WORKDIR /opt/aqswarm (jobs' relative data paths)")
    check(any(w == "ENTRYPOINT" and "aqswarm" in r for w, r in rt["lines"]), "ENTRYPOINT is aqswarm")
    # Every library the binary links comes from a runtime package.
    if shutil.which("dpkg") and shutil.which("readelf") and shutil.which("ldd"):
        needed = re.findall(r"\[(.+?)\]", run(["readelf", "-d", BIN]).stdout.split("Dynamic section", 1)[-1])
        needed = [n for n in needed if n.startswith("lib")]
        # The image builds its own binary without CUDA (the Dockerfile's cmake sets no AQSWARM_WITH_CUDA): a
        # CUDA build of this checkout also links CUDA's and NCCL's libraries, which the image's binary does not.
        if cuda_build(BIN):
            needed = [n for n in needed if not CUDA_LIB.match(n)]
        ldd = dict(re.findall(r"^\s*(\S+) => (\S+)", run(["ldd", BIN]).stdout, re.M))
        essential = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g"}  # in debian:bookworm-slim
        owners = {}
        for lib in needed:
            path = ldd.get(lib)
            if not path:
                continue
            r = run(["dpkg", "-S", os.path.realpath(path)])
            if r.returncode != 0:
                r = run(["dpkg", "-S", path])
            if r.returncode == 0:
                owners[lib] = r.stdout.split(":", 1)[0]
        lacking = {lib: p for lib, p in owners.items() if p not in rt_pkgs | essential}
        check(bool(owners) and not lacking,
              "the runtime stage installs the packages of every linked library (%d libs; lacking: %s)" %
              (len(owners), lacking))
    # COPY sources exist and survive .dockerignore.
    ignore = []
    di = os.path.join(ROOT, ".dockerignore")
    if os.path.exists(di):
        with open(di) as fh:
            ignore = [l.strip() for l in fh if l.strip() and not l.startswith("#")]
    import fnmatch
    for st in stages.values():
        for w, r in st["lines"]:
            if w == "COPY" and "--from=" not in r:
                srcs = [t for t in shlex.split(r) if not t.startswith("--")][:-1]
                for s in srcs:
                    ok = s == "." or os.path.exists(os.path.join(ROOT, s))
                    excluded = [p for p in ignore if s != "." and (fnmatch.fnmatch(s.rstrip("/"), p) or
                                                                   s.startswith(p.rstrip("/") + "/"))]
                    check(ok and not excluded, "Dockerfile COPY %s exists and is in the build context" % s)


if __name__ == "__main__":
    if not os.access(BIN, os.X_OK):
        sys.exit("usage: deploy_test.py AQSWARM_BINARY [REPO_ROOT]")
    main()
    print("\n%d failure(s)" % len(failures))
    for f in failures:
        print("  - " + f.splitlines()[0])
    sys.exit(1 if failures else 0)
