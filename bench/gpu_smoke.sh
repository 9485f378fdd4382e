#!/usr/bin/env bash
# The GPU check, in one run of at most 8 minutes, for a CUDA machine with no network, its
# own Python 3.12, torch and transformers, and no DeepSpeed:
#   1. installs the wheels in $WHEELS (default bench/gpu-wheels, `make gpu-wheels` on a
#      networked machine: this repository's pins of what such an image lacks) into $SITE,
#      ahead of the image's own packages;
#   2. bench/gpu_smoke.py: SmolLM2-135M's shape with random weights, bfloat16, eager vs
#      CUDA graphs vs transformers `generate` at batch 1, 8 and 32, 16- and 64-node trees,
#      speculative = plain decoding on the device, row invariance, seeded sampling, capture
#      time (at most 270 s);
#   3. the CUDA-marked tests (at most 150 s);
#   4. prints one table, and the tests' summary under it.
# Files go to $OUT (default bench/results/gpu): gpu_smoke.json, gpu_smoke_table.txt,
# gpu_smoke.log, cuda-tests.txt, cuda-tests.xml. Exit status: 0 when both parts passed.
#
#     make gpu-wheels                          # here, once (needs the network)
#     bash bench/gpu_smoke.sh                  # there; with the device tool:
#       run(command="bash bench/gpu_smoke.sh", carry=["bench/gpu-wheels"], timeout_s=540)
#     DEVICE=cpu bash bench/gpu_smoke.sh       # a dry run of every part on the CPU
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/results/gpu}
WHEELS=${WHEELS:-bench/gpu-wheels}
SITE=${SITE:-/tmp/specinfer-site}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONPATH=".:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
began=$(date +%s)

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl 2>&1 | grep -v -i warning
  export PYTHONPATH="$SITE:$PYTHONPATH"
else
  echo "gpu_smoke: no wheels in $WHEELS: using the packages installed here"
fi

DEVICE=$DEVICE $PY - <<'EOF' || exit 2
import os, sys
import torch
if os.environ["DEVICE"] == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_smoke: no CUDA device visible to torch")
import transformers
where = torch.cuda.get_device_name() if os.environ["DEVICE"] == "cuda" else "the CPU (dry run)"
print(f"gpu_smoke: Python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, on {where}")
# What the engine and the tests import: fail here, with the module's name, not later.
import grpc_health.v1.health, llguidance, opentelemetry.sdk.trace, scipy  # noqa
import services.verifier.factory, specinfer.client  # noqa
EOF

SMOKE_ARGS=()
if [ "$DEVICE" = cpu ]; then  # a small model and few repetitions: the logic, not the figures
  SMOKE_ARGS=(--layers 2 --prefix 32 --batches 1,4 --new-tokens 6 --prompts 3
              --exact-tokens 12 --reps 3)
fi
timeout 270 $PY -m bench.gpu_smoke --out "$OUT" --device "$DEVICE" "${SMOKE_ARGS[@]}" \
  >"$OUT/gpu_smoke.log" 2>&1
smoke=$?
[ $smoke = 0 ] || tail -n 30 "$OUT/gpu_smoke.log"

# -k cuda: every CUDA-marked test (skipped without a GPU); graph: the graphs' buckets and
# padding, uncaptured (CPU). The TP 2 one runs only with 2 GPUs and DeepSpeed.
timeout 150 $PY -m pytest -q -p no:cacheprovider -o addopts= -rs \
  tests/test_placement.py tests/test_speculative_sampling.py -k "cuda or graph" \
  --junitxml="$OUT/cuda-tests.xml" >"$OUT/cuda-tests.txt" 2>&1
tests=$?
[ $tests = 0 ] || grep -E "^(FAILED|ERROR)|Error" "$OUT/cuda-tests.txt" | head -n 30

echo
cat "$OUT/gpu_smoke_table.txt" 2>/dev/null || echo "gpu_smoke: no table (exit $smoke)"
echo "CUDA-marked tests: $(tail -n 1 "$OUT/cuda-tests.txt") (exit $tests)"
echo "gpu_smoke: $(( $(date +%s) - began )) s; smoke exit $smoke, tests exit $tests"
[ $smoke = 0 ] && [ $tests = 0 ]
