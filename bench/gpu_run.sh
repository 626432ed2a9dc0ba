#!/bin/bash
# The GPU pass of issue 40, as one call of the device tool (docs/benchmarks.md, "On a GPU"):
#   bash bench/gpu_run.sh [tests] [kernels] [e2e] [some]    (no argument: the first three)
# The image there lacks trio, hypercorn, quart-trio, gguf, xgrammar, jsonschema-rs (the HTTP
# schema check imports it) and the rest of the engine's pure-Python stack: they travel as
# Python 3.12 wheels in .whl (carry: [".whl"]).
# Logs land in $OUT (the device tool brings them back).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
stages=${*:-tests kernels e2e}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/device.txt"
# The C kernels of the CPU path (cffi, from the wheels): the kernel tests compare against them.
timeout 150 python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || echo "C kernels not built"
for stage in $stages; do
  t0=$(date +%s)
  case $stage in
    tests)
      # Every test that runs its kernels on CUDA when a GPU is there (the Triton ones and
      # the engine end to end, whose device "auto" is then cuda). Warnings stay warnings:
      # this stack's torch/transformers versions are not the CI's.
      timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider -W default \
          tests/test_kernels.py tests/test_kv_quant_triton.py tests/test_quant_triton.py \
          tests/test_lora_kernels.py tests/test_cuda_graphs.py tests/test_engine_e2e.py \
          "tests/test_parity.py" "tests/test_gpt2_opt.py" "tests/test_moe.py" \
          -k "triton or not (test_parity or test_gpt2_opt or test_moe)" 2>&1 | tee "$OUT/tests.log" | tail -60 ;;
    some)
      # A rerun of chosen tests: PYTEST_ARGS; with INTERPRET=1 on the CPU in Triton's
      # interpreter instead (the same machine's transformers, without the GPU).
      if [ "${INTERPRET:-0}" = 1 ]; then
        CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 timeout 200 python3 -m pytest -q -p no:cacheprovider \
            -W default $PYTEST_ARGS 2>&1 | tee "$OUT/tests_cpu.log" | tail -30
      else
        timeout 200 python3 -m pytest -q -p no:cacheprovider -W default $PYTEST_ARGS 2>&1 \
            | tee "$OUT/tests_some.log" | tail -30
      fi ;;
    kernels) timeout 90 python3 bench/kernels.py 2>&1 | tee "$OUT/kernels.txt" ;;
    e2e) timeout 200 python3 bench/gpu.py --serve 2>&1 | tee "$OUT/gpu.txt" ;;
  esac
  echo "== $stage: $(( $(date +%s) - t0 )) s"
done
