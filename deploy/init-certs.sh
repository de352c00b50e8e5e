#!/bin/sh
# TLS material for a swarm whose processes all run on one Docker host (the
# `certs` service of deploy/docker-compose.yml; installed in the image as
# /usr/local/bin/aqswarm-init-certs). Uses only `aqswarm certs ...`.
#
#   aqswarm-init-certs OUT_DIR COORDINATOR PEER...
#
# Writes one directory per machine, as docs/SECURITY.md lays out:
#   OUT_DIR/ca/            the issuing dir: ca.pem, ca.key, join.secret and every
#                          certificate issued (never mounted into a service)
#   OUT_DIR/COORDINATOR/   ca.pem, COORDINATOR.pem/.key, join.secret
#   OUT_DIR/PEER/          ca.pem, PEER.pem/.key, join.token (--join_token=@FILE)
# Each certificate names its process (DNS SAN = the compose service name,
# which is what other containers dial) plus IP 127.0.0.1 (health checks);
# AQSWARM_COORDINATOR_IPS / AQSWARM_COORDINATOR_DNS add the host's addresses
# to the coordinator's certificate so peers on other machines can join it.
#
# Idempotent: the CA and existing certificates are kept (delete OUT_DIR to
# start over); join tokens are issued again on every run because they expire
# (AQSWARM_TOKEN_TTL_S, default 7 days). Files end up owned by AQSWARM_UID
# (default 10001, the image's `aqswarm` user), keys 0600.
set -eu

usage() { echo "usage: aqswarm-init-certs OUT_DIR COORDINATOR PEER..." >&2; exit 2; }
[ $# -ge 3 ] || usage
out="$1"; coordinator="$2"; shift 2
swarm="${AQSWARM_SWARM:-demo}"
ttl="${AQSWARM_TOKEN_TTL_S:-604800}"
uid="${AQSWARM_UID:-10001}"
ca="$out/ca"

mkdir -p "$ca"
[ -f "$ca/ca.pem" ] || aqswarm certs init --tls_dir "$ca"

issue() {  # issue NAME IPS DNS
  if [ ! -f "$ca/$1.pem" ]; then
    aqswarm certs issue --tls_dir "$ca" --name "$1" --ip "$2" ${3:+--dns "$3"}
  fi
  mkdir -p "$out/$1"
  cp "$ca/ca.pem" "$ca/$1.pem" "$ca/$1.key" "$out/$1/"
  chmod 0600 "$out/$1/$1.key"
}

issue "$coordinator" "127.0.0.1${AQSWARM_COORDINATOR_IPS:+,$AQSWARM_COORDINATOR_IPS}" "${AQSWARM_COORDINATOR_DNS:-}"

for peer in "$@"; do
  issue "$peer" "127.0.0.1" ""
  # The first token creates $ca/join.secret.
  aqswarm certs token --tls_dir "$ca" --swarm "$swarm" --peer "$peer" --ttl_s "$ttl" \
    >"$out/$peer/join.token.tmp" 2>/dev/null
  chmod 0600 "$out/$peer/join.token.tmp"
  mv "$out/$peer/join.token.tmp" "$out/$peer/join.token"
done

# The coordinator verifies join tokens with the join.secret in its --tls_dir.
cp "$ca/join.secret" "$out/$coordinator/join.secret"
chmod 0600 "$out/$coordinator/join.secret"

# Only the process that owns a directory reads it (the image runs as $uid).
chown -R "$uid:$uid" "$out" 2>/dev/null || true
echo "aqswarm-init-certs: swarm '$swarm': CA in $ca; $coordinator and $# peer(s) ready under $out" >&2
