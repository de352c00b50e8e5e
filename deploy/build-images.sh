#!/usr/bin/env bash
# Builds the Compose deployment's images on a Docker engine that reaches no
# registry (docs: deploy/README.md "Images"):
#
#   aqswarm-base:bookworm        Debian 12 minbase, made by mmdebstrap from the
#                                machine's configured Debian mirror and loaded
#                                with `docker import`; reused when present
#   aqswarm-runtime-base:latest  deploy/Dockerfile's runtime-base stage: runtime
#                                libraries, examples/, data/, no binary
#   aqswarm:latest               the binary compiled from source in the image
#                                (deploy/Dockerfile, ~12 min on 2 cores), or with
#                                --prebuilt, a binary built outside Docker on
#                                Debian 12 (deploy/prebuilt.Dockerfile, seconds)
#   aqswarm-prometheus:latest    Prometheus from Debian's package
#                                (deploy/prometheus.Dockerfile)
#
#   deploy/build-images.sh                         # everything, binary from source
#   deploy/build-images.sh --prebuilt build/aqswarm
#   deploy/build-images.sh --rebuild-base          # make the base image again
#
# Needs: a running engine (`dockerd &` as root), mmdebstrap for the base image,
# and data/ (run scripts/fetch_data.sh first; this script runs it when data/ is
# missing). Grafana has no Debian package: its service in the Compose file
# takes grafana/grafana-oss from a registry (`--profile grafana`).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=aqswarm-base:bookworm
prebuilt=""
rebuild_base=0
while (($#)); do
  case "$1" in
    --prebuilt) [[ $# -ge 2 ]] || { echo "build-images: --prebuilt needs a binary" >&2; exit 2; }
                prebuilt="$2"; shift 2 ;;
    --rebuild-base) rebuild_base=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-images: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -n $prebuilt && ! -x $prebuilt ]]; then
  echo "build-images: --prebuilt $prebuilt is not an executable file" >&2; exit 2
fi
if ! docker info >/dev/null 2>&1; then
  echo "build-images: no Docker engine answers (start one: dockerd &)" >&2; exit 1
fi

say() { echo "build-images: $*"; }
# The classic builder: Debian's engine (20.10) has no buildx plugin.
export DOCKER_BUILDKIT=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
build() { docker build -q "$@" >/dev/null 2>"$tmp/err" || { grep -v "legacy builder\|BuildKit\|environment-variable" "$tmp/err" >&2; return 1; }; }

if ((rebuild_base)) || ! docker image inspect "$BASE" >/dev/null 2>&1; then
  command -v mmdebstrap >/dev/null || { echo "build-images: mmdebstrap is missing (apt-get install mmdebstrap)" >&2; exit 1; }
  say "base image $BASE (mmdebstrap)"
  mmdebstrap --quiet --variant=minbase bookworm "$tmp/base.tar"
  docker import "$tmp/base.tar" "$BASE" >/dev/null
  rm -f "$tmp/base.tar"
fi

if [[ ! -f data/gpt2/encoder.json || ! -d data/sotu ]]; then
  say "fetching data/ (scripts/fetch_data.sh)"
  scripts/fetch_data.sh
fi

say "aqswarm-runtime-base:latest"
build -f deploy/Dockerfile --target runtime-base --build-arg DEBIAN_IMAGE="$BASE" \
  -t aqswarm-runtime-base:latest .

if [[ -n $prebuilt ]]; then
  say "aqswarm:latest from $prebuilt"
  mkdir -p "$tmp/ctx/lib"
  strip --strip-debug -o "$tmp/ctx/aqswarm" "$prebuilt" 2>/dev/null || cp "$prebuilt" "$tmp/ctx/aqswarm"
  # Libraries the binary links that no Debian package owns (CUDA, NCCL).
  while read -r lib; do
    dpkg -S "$(realpath "$lib")" >/dev/null 2>&1 || dpkg -S "$lib" >/dev/null 2>&1 ||
      cp -L "$lib" "$tmp/ctx/lib/"
  done < <(ldd "$prebuilt" | awk '/=> \//{print $3}')
  cp deploy/prebuilt.Dockerfile "$tmp/ctx/Dockerfile"
  build -t aqswarm:latest "$tmp/ctx"
else
  say "aqswarm:latest from source (deploy/Dockerfile; ~12 min on 2 cores)"
  build -f deploy/Dockerfile --build-arg DEBIAN_IMAGE="$BASE" -t aqswarm:latest .
fi

say "aqswarm-prometheus:latest"
mkdir -p "$tmp/prom"
cp deploy/prometheus.Dockerfile "$tmp/prom/Dockerfile"
build --build-arg DEBIAN_IMAGE="$BASE" -t aqswarm-prometheus:latest "$tmp/prom"
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^aqswarm' | sed 's/^/build-images: /'
