#!/usr/bin/env bash
# GPU smoke check (at most ~5 minutes) for a CUDA machine with no network and its own
# Python and PyTorch. Uses the torch already installed; installs only small pure-Python
# wheels it lacks, from $WHEELS (default bench/gpu-wheels, filled on a networked machine by
# `make gpu-wheels`). Runs the CUDA-marked tests, then bench/gpu_smoke.py (step costs on a
# random model of SmolLM2's shape, eager vs CUDA graphs, speculation on vs off projected).
# Figures go to $OUT (default bench/results/gpu).
#
#     bash bench/gpu_smoke.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/results/gpu}
WHEELS=${WHEELS:-bench/gpu-wheels}
mkdir -p "$OUT"
export PYTHONPATH=".:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

$PY - <<'EOF' || { echo "gpu_smoke: no CUDA device visible to torch"; exit 2; }
import torch
assert torch.cuda.is_available()
print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
EOF

# Only what is missing, only from local wheels (no network here).
for mod in pytest grpc_health grpc_reflection google.protobuf; do
  if ! $PY -c "import $mod" 2>/dev/null; then
    if [ -d "$WHEELS" ]; then
      pkg=${mod/grpc_health/grpcio-health-checking}; pkg=${pkg/grpc_reflection/grpcio-reflection}
      pkg=${pkg/google.protobuf/protobuf}
      $PY -m pip install -q --no-index --find-links "$WHEELS" "$pkg" || echo "gpu_smoke: could not install $pkg"
    else
      echo "gpu_smoke: $mod missing and no $WHEELS"
    fi
  fi
done

status=0
if $PY -c "import pytest" 2>/dev/null; then
  timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_placement.py -k "cuda" \
    --junitxml="$OUT/cuda-tests.xml" 2>&1 | tee "$OUT/cuda-tests.txt" || status=1
  # (the TP 2 over NCCL test among them runs where there are 2 GPUs and deepspeed)
else
  echo "gpu_smoke: pytest unavailable; CUDA tests skipped" | tee "$OUT/cuda-tests.txt"
  status=1
fi
timeout 200 $PY -m bench.gpu_smoke --out "$OUT" 2>&1 | tee "$OUT/gpu_smoke.txt" || status=1
exit $status
