#!/usr/bin/env bash
# What a GPU machine lent for a session checks, in one run (the `device` tool's machines have torch and
# pytest, no vLLM and no network): the KV mover's unit tests and vLLM's seeded-sampling skip on CUDA,
# then bench/kv_mover.py at Llama-3.1-8B shapes. Results go to $OUT (or ./gpu-checks).
#   bash bench/gpu_checks.sh [kv_mover.py flags]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-checks}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/device.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' \
  | tee -a "$out/device.txt"
# llmesh's torch-only modules, importable without installing it (its package is shared/)
pkg=$(mktemp -d) && ln -s "$PWD/shared" "$pkg/llmesh"
PYTHONPATH=$pkg python3 -m pytest -q --noconftest -p no:cacheprovider -o addopts= tests/unit/test_kv_mover.py \
  "tests/unit/test_resumed.py::test_on_cuda_skipping_draws_equals_drawing_vllms_noise" 2>&1 | tee "$out/tests.log"
tests=$?
PYTHONUNBUFFERED=1 python3 bench/kv_mover.py --out "$out/kv_mover.json" "$@" 2>&1 | tee "$out/kv_mover.log"
bench=$?
echo "tests: exit $tests; benchmark: exit $bench"
exit $((tests || bench))
