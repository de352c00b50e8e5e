#!/usr/bin/env bash
# The aqswarm demo: a GPT split over 4 stage processes on this machine,
# links shaped to 100 Mbit/s + 5 ms, trained with AQ-SGD (3-bit activation
# deltas forward, 6-bit gradients back) on State of the Union speeches.
# Watch the per-link MB and the forward compression ratio: the first pass over
# each sample is sent in full, later passes as deltas.
#   scripts/demo.sh            # the pipeline demo (~1-2 minutes)
#   scripts/demo.sh bench      # the compression benchmark instead
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
if [[ "${1:-}" == bench ]]; then
  exec build/aqswarm bench compression --mib "${AQSWARM_DEMO_MIB:-16}"
fi
# A small corpus (the first 3 speeches) so epochs are short and deltas start early.
mkdir -p runs/demo-corpus
ls data/sotu/*.txt | sort | head -n 3 | while read -r f; do cp "$f" runs/demo-corpus/; done
exec build/aqswarm pipeline --job examples/demo.json --out_dir runs/demo "$@"
