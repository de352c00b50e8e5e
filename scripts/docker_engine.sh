#!/usr/bin/env bash
# Makes a Docker engine answer for the `docker` tests (ctest -L docker:
# tests/integration/compose_test.py) and deploy/build-images.sh: installs
# Debian's docker.io, docker-compose and mmdebstrap when missing (as root),
# then starts dockerd in the background when no engine answers `docker info`.
#
#   scripts/docker_engine.sh      # .ci/run calls it before scripts/test.sh
#
# Best effort: when it cannot (not root, no package, the daemon does not come
# up), it says why and exits 0; the docker tests then skip and say so.
# dockerd's log: /tmp/aqswarm-dockerd.log.
set -uo pipefail

say() { echo "docker_engine: $*"; }
if docker info >/dev/null 2>&1; then
  say "an engine answers already"
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  say "not root: cannot install or start dockerd; the docker tests will skip"
  exit 0
fi
missing=()
for p in docker.io docker-compose mmdebstrap; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
    say "could not install ${missing[*]}; the docker tests will skip"
    exit 0
  fi
fi
command -v dockerd >/dev/null || { say "no dockerd after the install; the docker tests will skip"; exit 0; }
say "starting dockerd (log: /tmp/aqswarm-dockerd.log)"
nohup dockerd >/tmp/aqswarm-dockerd.log 2>&1 &
for _ in $(seq 60); do
  if docker info >/dev/null 2>&1; then
    say "engine up: $(docker version --format 'server {{.Server.Version}}' 2>/dev/null)"
    exit 0
  fi
  sleep 1
done
say "dockerd did not answer within 60 s (tail of its log below); the docker tests will skip"
tail -5 /tmp/aqswarm-dockerd.log
exit 0
