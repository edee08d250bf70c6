#!/usr/bin/env bash
# The cuda backend on a real GPU, offline: its tests natively (not under Triton's interpreter), then
# `mindspec bench --backend cuda`. Logs and the benchmark's JSON/PNG go to $OUT.
#
#   OUT=benchmarks/out/gpu bash scripts/gpu_check.sh [tests|bench|all] [extra bench args...]
#   bash scripts/gpu_check.sh compare [extra bench args...]   # the MTP/transformers comparison
#   bash scripts/gpu_check.sh shapes [extra bench args...]    # published model shapes, simulated acceptance
#   DTYPE=bfloat16 bash scripts/gpu_check.sh profile          # one decode step through the engine: host vs device
#   bash scripts/gpu_check.sh trees [extra bench args...]     # draft trees and Medusa against chains (shipped model)
#   bash scripts/gpu_check.sh py SCRIPT [ARGS...]
#   bash scripts/gpu_check.sh session                          # a 15-minute device budget's first call
#
# `session` is what a session lent a GPU runs first, in one call of about 8 minutes (9-10 with the
# machine's start), returning 8 files: the tests natively (~3.5 minutes on a fresh H200: Triton
# compiles every kernel first), draft trees and chains against MTP off at batch 1 (float32), the
# engine step profile in bf16 (MTP off and eagle K=3, sync and async: wall, device and host time
# per step, ops outside graphs by name, the eagle step's host cProfile), and DeepSeek-V2-Lite's
# shape at batch 1 with simulated acceptance (bf16); the bench JSONs hold each request's TTFT and
# TPOT. (2026-11-28 on an H200: 352 s before the V2-Lite run, which took ~60 s more alone.)
#
# `all` runs every GPU measurement: tests, the kernel benchmarks, the comparison on the shipped
# model (batch 1 and 16, MTP off against K=3, sync and async) and DeepSeek-V2-Lite with random
# weights (27 layers, bf16, 33 GB per configuration: an H200 or an 80 GB card), within 25 minutes.
# Timings on one H100 (2026-11-24): tests ~95 s; `bench` ~4 min; `compare` with
# --batches 1,16,32 --ks 1,3 --rounds 3 --no-async ~6-8 min (one device call allows 10).
#
# Needs python3 with a CUDA torch, triton, transformers, safetensors, tokenizers, numpy, pytest and
# matplotlib already installed (no package is fetched), and gguf, which the device image lacks:
# carry its wheel (`pip download --no-deps -d .whl gguf`, `.whl` in the call's carry, installed with
# --target into PYTHONPATH first). mindspec itself runs from this checkout.
set -u
OUT=${OUT:-benchmarks/out/gpu}
WHAT=${1:-all}
shift || true
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}

# mindspec from this checkout without pip: backends/, plugins/ and models/ live in the mindspec
# namespace (setup.py's package_dir). The checkout's mindspec/ comes first on sys.path (pytest's
# rootdir, python -c's cwd), so link them into it for this run and remove the links afterwards.
LINKS=()
for top in backends plugins models; do
  if [[ ! -e mindspec/$top ]]; then ln -s "../$top" "mindspec/$top"; LINKS+=("mindspec/$top"); fi
done
trap 'rm -f "${LINKS[@]}"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  $PY -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  $PY -c "import mindspec.backends.cuda, mindspec.models.deepseekv2; print('mindspec imports from', mindspec.__path__)"
} 2>&1 | tee "$OUT/env.log"
# mindspec's runtime dependencies beyond a CUDA image's usual packages: carry them as wheels
# (the device tool's README: .whl/ in carry, installed with --target into PYTHONPATH)
if ! $PY -c "import gguf" 2>/dev/null; then
  echo "gpu_check: python package 'gguf' is missing (mindspec imports it at start): carry its wheel" | tee -a "$OUT/env.log"
  exit 2
fi

if [[ $WHAT == tests || $WHAT == all ]]; then
  # SIGINT, not TERM: pytest then still prints which tests failed before the limit
  timeout -s INT -k 30 "${TEST_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider --timeout 150 -o addopts="" -rfE \
    tests/backends/cuda tests/modeling/test_graph_runner.py ${TEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -80
fi
if [[ $WHAT == bench || $WHAT == all ]]; then
  timeout "${BENCH_TIMEOUT:-300}" $PY -c "import sys; from mindspec.cli import main; sys.exit(main(sys.argv[1:]))" \
    bench --backend cuda --out "$OUT/cuda_bench" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
if [[ $WHAT == compare ]]; then
  timeout "${BENCH_TIMEOUT:-540}" $PY -m mindspec.cli bench --backend cuda --compare --out "$OUT/compare" "$@" 2>&1 \
    | grep -v "^model\.\|^Key \|UNEXPECTED\|^Notes\|^- \|Loading weights\|LOAD REPORT" | tee "$OUT/compare.log" | tail -40
fi
if [[ $WHAT == all ]]; then  # the shipped model: MTP off against K=3 at batch 1 and 16, sync and async
  timeout "${BENCH_TIMEOUT:-300}" $PY -m mindspec.cli bench --backend cuda --compare --out "$OUT/compare" \
    --batches 1,16 --ks 3 --rounds 3 --no-hf --configs "mtp off,vanilla K=3,eagle K=3,mtp off +async,vanilla K=3 +async" \
    2>&1 | tee "$OUT/compare.log" | tail -20
fi
if [[ $WHAT == trees ]]; then  # draft trees (eager tree steps) against chains (graphs) on the shipped model
  timeout "${BENCH_TIMEOUT:-540}" $PY -m mindspec.cli bench --backend cuda --compare --trees --out "$OUT/trees" \
    --batches 1,16 --ks 3 --rounds 3 --no-hf --no-async --no-profile \
    --configs "mtp off,vanilla K=3,eagle K=3,eagle tree d4 k2 n6,eagle tree d5 k3 n12,vanilla tree d3 k3 n8,medusa tree" \
    "$@" 2>&1 | tee "$OUT/trees.log" | tail -20
fi
if [[ $WHAT == shapes || $WHAT == all ]]; then  # realistic sizes: random weights, simulated acceptance
  EXTRA=(); [[ $WHAT == shapes ]] && EXTRA=("$@")
  timeout "${BENCH_TIMEOUT:-420}" $PY -m mindspec.cli bench --backend cuda --compare --model-shape "${SHAPE:-deepseek-v2-lite}" \
    --dtype bfloat16 --batches 1,16 --rounds 3 --no-async --configs "mtp off,eagle K=3" \
    --out "$OUT/shape_${SHAPE:-deepseek-v2-lite}" "${EXTRA[@]}" 2>&1 | tee "$OUT/shapes.log" | tail -20
fi
if [[ $WHAT == profile || $WHAT == all ]]; then  # where a step's time goes: MTP off, vanilla and eagle K=3
  OUT="$OUT" timeout "${PROFILE_TIMEOUT:-240}" $PY scripts/gpu_step_profile.py 2>&1 | tee "$OUT/profile.log" | grep '^{'
fi
if [[ $WHAT == session ]]; then
  TEST_TIMEOUT=${TEST_TIMEOUT:-330} bash "$0" tests
  BENCH_TIMEOUT=120 bash "$0" trees --batches 1
  mkdir -p "$OUT/profile"
  DTYPE=bfloat16 CONFIGS=off,eagle3,off_async,eagle3_async OUT="$OUT/profile" timeout 160 $PY scripts/gpu_step_profile.py 2>&1 \
    | grep '^{' | tee "$OUT/profile.log"
  BENCH_TIMEOUT=150 bash "$0" shapes --batches 1  # the realistic-size target: V2-Lite, batch 1
  # at most 8 files come back: the JSON and logs (TTFT/TPOT per request inside), one host cProfile
  rm -rf "$OUT"/*-random "$OUT"/*.png "$OUT"/profile/*_kernels.txt "$OUT"/profile/off*_cprofile.txt \
    "$OUT"/profile/*_async_cprofile.txt "$OUT"/profile/step_profile.json
fi
if [[ $WHAT == py ]]; then  # any script against this checkout: gpu_check.sh py SCRIPT ARGS...
  $PY "$@" 2>&1 | tee "$OUT/py.log" | tail -120
fi
