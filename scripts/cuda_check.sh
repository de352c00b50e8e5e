#!/usr/bin/env bash
# The CUDA build path, checked on a GPU machine that has a CUDA PyTorch (its
# libtorch) but none of Debian's dev packages and no network (the device
# machines this project is sometimes lent). Two halves:
#
#   scripts/cuda_check.sh bundle DIR   # here, on Debian 12: the .debs (our
#                                      # build deps) and the test data into DIR
#   scripts/cuda_check.sh run DIR      # there, as root: unpack DIR/debs into
#                                      # /opt/deb, build with
#                                      # -DAQSWARM_WITH_CUDA=ON against the
#                                      # python3 torch, run the GPU tests
#
# `run` writes its logs to $OUT (default /tmp/cuda_check) and goes on after a
# failing step, under a deadline (DEADLINE seconds, default 540). After the GPU
# tests it runs scripts/model_sizes.sh --device cuda:0 (bf16, then fp32 if the
# deadline allows; tables in $OUT/model_sizes/*/table.md for docs/MODELS.md).
# FULL=1 then builds everything and runs ctest (CPU) on that libtorch too.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
dir=${2:-}
[[ ( $mode == bundle || $mode == run ) && -n $dir ]] || { echo "usage: $0 bundle|run DIR" >&2; exit 2; }

if [[ $mode == bundle ]]; then
  set -e
  mkdir -p "$dir/debs" "$dir/data/sotu"
  # The build dependencies' closure, less what any Linux image has (libc, gcc, perl...).
  pkgs="libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler librocksdb-dev prometheus-cpp-dev
        libssl-dev libabsl-dev libgtest-dev libgmock-dev libxxhash-dev nlohmann-json3-dev libgflags-dev
        libbenchmark-dev libpcre2-dev zlib1g"
  apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
      --no-enhances $pkgs | grep -v '^[ <]' | sort -u |
    grep -v -E '^(libc6|libc-bin|libc-dev|libc6-dev|linux-libc-dev|libgcc|libstdc|gcc|g\+\+|cpp|perl|debconf|dpkg|tar|base|coreutils|bash|dash|libcrypt|libselinux|binutils|libbinutils|libctf|libgprofng|lib(a|l|t|ub|hwa)san|libitm|libquadmath|libatomic|libgomp|libcc1|libisl|libmpc|libmpfr|libgmp|libjansson|libsframe|rpcsvc|libtirpc|libnsl|libkrb|libk5|libgssapi|libcom-err|libkeyutils|libtinfo|libdebconf|debianutils|libaudit|libcap|libacl|libattr|libpam|libdb5|libmd0|libdpkg|libsystemd|libudev|libgpg|libgcrypt|python|media-types|tzdata|libffi|netbase|ca-cert|openssl$)' \
    > "$dir/debs/packages.txt"
  (cd "$dir/debs" && apt-get download $(cat packages.txt) >/dev/null)
  cp -r data/gpt2 "$dir/data/"
  cp data/sotu/* "$dir/data/sotu/"  # the whole corpus (11 MB): with less, the swarm tests' 1-epoch job ends before their kills
  du -sh "$dir"
  exit 0
fi

OUT=${OUT:-/tmp/cuda_check}
mkdir -p "$OUT"
T0=$(date +%s)
DEADLINE=${DEADLINE:-540}
el() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
exec > >(tee "$OUT/log.txt") 2>&1

el probe
nvidia-smi -L; grep PRETTY /etc/os-release; g++ --version | head -1; cmake --version | head -1
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.is_available())'

el unpack
mkdir -p /opt/deb /opt/deblib
for f in "$dir"/debs/*.deb; do dpkg -x "$f" /opt/deb; done
[[ -d /opt/deb/lib/x86_64-linux-gnu ]] && cp -r --update=none /opt/deb/lib/x86_64-linux-gnu/. /opt/deb/usr/lib/x86_64-linux-gnu/
# On the loader path: only the Debian libraries the image lacks.
for f in /opt/deb/usr/lib/x86_64-linux-gnu/lib*.so.*; do
  ldconfig -p | grep -qF " $(basename "$f") " || ln -sf "$f" /opt/deblib/
done
# Debian's CMake files name some libraries by absolute path: add (never replace) those.
for f in /opt/deb/usr/lib/x86_64-linux-gnu/*; do
  [[ -f $f && ! -e /usr/lib/x86_64-linux-gnu/$(basename "$f") ]] && ln -s "$f" /usr/lib/x86_64-linux-gnu/
done
export LD_LIBRARY_PATH=/opt/deblib
[[ -d data ]] || cp -r "$dir/data" data

el configure
torch_cmake=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
nccl=$(python3 -c 'import glob, nvidia; print([d for p in nvidia.__path__ for d in glob.glob(p + "/nccl")][0])')
B=/tmp/cuda_check_build
# Debian's headers first (-I beats -isystem): the torch wheel ships its own google/protobuf.
cmake -S . -B $B -G Ninja -Wno-dev -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g0" \
  -DCMAKE_CXX_FLAGS="-I/opt/deb/usr/include -I/opt/deb/usr/include/x86_64-linux-gnu" \
  -DCMAKE_PREFIX_PATH="/opt/deb/usr;$torch_cmake" -DAQSWARM_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
  -DNCCL_INCLUDE_DIR="$nccl/include" -DNCCL_LIBRARY="$(ls "$nccl"/lib/libnccl.so* | head -1)" > "$OUT/configure.txt" 2>&1 ||
  { tail -40 "$OUT/configure.txt"; exit 1; }

el build
ninja -C $B -k 0 aqswarm aqswarm_events_python stage_nccl_test pipeline_integration_test schedule_integration_test \
  pipeline_model_test pipeline_training_test pipeline_hf_test > "$OUT/build.txt" 2>&1
rc=$?; grep -E "error|FAILED" "$OUT/build.txt" | head -40; el "build rc=$rc"
$B/aqswarm version

gtest() {  # name, timeout, binary...
  local name=$1 t=$2; shift 2
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1
  grep -E "^\[ *(OK|FAILED|SKIPPED|PASSED) *\]|Failure|^rank " "$OUT/$name.txt"
}
if [[ ${SKIP_E2E:-0} != 1 ]]; then  # SKIP_E2E=1: build, model tests and the sizes table only
el "NCCL transport"
gtest nccl 120 $B/stage/stage_nccl_test
el "pipeline end to end, stages on cuda:0"
AQSWARM_TEST_DEVICE=cuda:0 gtest pipeline_cuda $(( $(left) / 2 )) $B/tests/integration/pipeline_integration_test
el "schedules end to end, stages on cuda:0"
AQSWARM_TEST_DEVICE=cuda:0 gtest schedule_cuda $(( $(left) / 2 )) $B/tests/integration/schedule_integration_test
el "the 2x2 grid of the pipeline test, stages on cuda:0, under cuda-gdb (a crash prints its stack)"
speeches=(data/sotu/*.txt)  # a glob, not ls | sort | head (SIGPIPE under pipefail, see demo.sh)
mkdir -p /tmp/cuda_check_grid/corpus && cp "${speeches[0]}" /tmp/cuda_check_grid/corpus/
cat > /tmp/cuda_check_grid/job.json <<EOF
{"name":"grid","seed":5,"model":{"seqLen":32,"dModel":32,"nLayer":3,"nHead":2},
 "data":{"corpus":"/tmp/cuda_check_grid/corpus","tokenizer":"$PWD/data/gpt2","cacheDir":"/tmp/cuda_check_grid/cache"},
 "optimizer":{"lr":0.003,"warmupSteps":2,"gradClip":1.0},"microBatchSize":4,"microBatchesPerStep":2,
 "epochs":10,"maxSteps":4,"compression":{"mode":"aqsgd","fwBits":3,"bwBits":6,"warmupEpochs":0},
 "stages":2,"evalEverySteps":0,"evalBatches":1,"device":"cuda:0","dataParallel":2,
 "dp":{"optimizer":"quantized_adam","warmupSteps":3,"bits":4}}
EOF
timeout 120 cuda-gdb -q -batch -ex run -ex "bt 12" --args $B/aqswarm pipeline --job=/tmp/cuda_check_grid/job.json \
  --out_dir=/tmp/cuda_check_grid/run > "$OUT/grid_gdb.txt" 2>&1
grep -E "^step|exited|SIGSEGV|^#" "$OUT/grid_gdb.txt" | head -30
fi
el "model tests (CPU, and the CUDA cases) on this libtorch"
gtest model $(( $(left) / 2 )) $B/pipeline/pipeline_model_test
gtest training 60 $B/pipeline/pipeline_training_test
gtest hf 60 $B/pipeline/pipeline_hf_test
# Per-stage memory and step time of GPT-2 small on 4 stage processes sharing
# cuda:0 (docs/MODELS.md): bf16, then fp32 while the deadline allows; each
# leaves its table in $OUT/model_sizes/PRECISION/table.md.
for p in bf16 fp32; do
  (( $(left) > 90 )) || { el "model sizes $p: skipped, $(left) s left"; continue; }
  el "model sizes on cuda:0, $p"
  AQSWARM_BIN=$B/aqswarm AQSWARM_BUILD=$B timeout $(( $(left) - 15 )) scripts/model_sizes.sh --device cuda:0 \
    --precision $p --out "$OUT/model_sizes/$p" --no_doc > "$OUT/model_sizes_$p.txt" 2>&1
  echo "exit $?"; grep -E "^\| |done in|FAILED" "$OUT/model_sizes_$p.txt"
  rm -rf "$OUT/model_sizes/$p"/*/run/store-* "$OUT/model_sizes/$p"/*/run/checkpoints  # big, not needed back
done

if [[ ${FULL:-0} == 1 ]]; then
  el "build everything"
  timeout $(( $(left) - 120 )) ninja -C $B -k 0 > "$OUT/build_all.txt" 2>&1
  grep -E "error:|FAILED" "$OUT/build_all.txt" | head -30
  el "ctest (CPU) on this libtorch"
  (cd $B && timeout $(( $(left) - 10 )) ctest -j 12 --timeout 150 > "$OUT/ctest.txt" 2>&1)
  grep -E "tests passed|\*\*\*" "$OUT/ctest.txt" | head -40
fi
el done
