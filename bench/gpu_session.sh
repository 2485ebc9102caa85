#!/usr/bin/env bash
# The prepared run for a lent GPU machine (see /work/.library/device/README.md where it exists):
# the image's python3 with this project's numerics pinned from carried wheels, then the CUDA
# kernels against their CPU twins on the card, then the decode bench (ours against transformers
# eager and compiled, per-kernel profile), optionally also for an older tree (an A/B).
#
#   bench/gpu_session.sh [BASELINE_DIR]        # writes logs under $OUT (or /tmp/gpu-session)
#
# Wheels: .whl/ (git-ignored through .git/info/exclude; name it in the device call's carry) holds
# numpy 2.4.6 (the image's numpy 2.5 lacks np.row_stack, which numba-cuda 0.30.4 calls),
# numba-cuda 0.30.4, orjson 3.13.0 and llguidance 1.9.1 (the image has neither), made on the
# development machine with `pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux_2_28_x86_64 ... -d .whl NAME==VERSION` (llguidance's
# abi3 wheel needs `--abi abi3 --platform manylinux_2_31_x86_64`). The image's numba (0.68.0)
# and llvmlite are used as they are: their wheels are too large to carry (llvmlite 60 MB).
# The whole run took ~4.5 minutes of device time with a baseline, ~4 without.
set -u -o pipefail
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
python3 -c "import numba, numba.cuda, numpy, torch, transformers; print('numba', numba.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
# Kernel tests on the card (no pytest.ini: the image has no pytest-django).
# GPU_TESTS (default: every kernel test) picks a subset, e.g. "tests/x.py -k attention".
ENGINES_TEST_GPU=1 timeout 300 python3 -m pytest -c /dev/null --rootdir . -q -p no:cacheprovider -x \
    ${GPU_TESTS:-tests/runtime/model/test_kernels.py} 2>&1 | tee "$out/kernel-tests.log" | tail -5
bench="python3 bench/decode.py --backend cuda --torch-device cuda --dtype float16 --random-llama /tmp/llama-1b --threads 16 --results $out/decode.jsonl"
if [ $# -ge 1 ]; then
    echo "== baseline: $1"
    timeout 300 $bench --profile --engines-from "$1" 2>&1 | tee "$out/decode-baseline.log" | grep -v "^\s*$" | tail -48
fi
echo "== this tree"
timeout 300 $bench --profile 2>&1 | tee "$out/decode.log" | grep -v "^\s*$" | tail -48
if [ -n "${TORCH_COMPILE:-}" ]; then
    echo "== torch.compile, batch 1"
    timeout "${TORCH_COMPILE}" $bench --batch-sizes 1 --torch-compile 2>&1 | tee "$out/decode-compiled.log" | tail -4
fi
