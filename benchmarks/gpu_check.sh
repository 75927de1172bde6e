#!/usr/bin/env bash
# The prepared device check of issue 40 (benchmarks/gpu_check.py): the GPU benchmarks and the cifar10 preset at a
# reduced size in at most 8 minutes, every number printed at once; outputs under $OUT when it is set.
#   bash benchmarks/gpu_check.sh PATH/TO/cifar10-jpg.tar.gz [more gpu_check.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:?usage: bash benchmarks/gpu_check.sh PATH/TO/cifar10-jpg.tar.gz (or a folder with train/ and test/)}"
shift
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec python3 benchmarks/gpu_check.py --device cuda --data "$data" --budget 480 "$@"
