#!/usr/bin/env bash
# The checks that need a CUDA GPU, in order of worth, inside one time budget: the CUDA tests,
# each side's gradient error against fp64 on ResNet-50, then the benchmarks with --device cuda (per call and per stage, whole models in one process,
# every sweep model's per-block F, B, I and W(n) for the simulator, torch.compile on Llama).
# Each step gets what is left of the budget; a step that fails or runs out leaves the others.
#
#     bash benchmarks/gpu_checks.sh [RESULTS_DIR] [BUDGET_SECONDS]
#
# Results (JSON, one log) land in RESULTS_DIR (default benchmarks/results/gpu). Where only a few
# files may come back from the machine, pack them after: tar czf results.tgz -C RESULTS_DIR .
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
budget=${2:-480}
deadline=$((SECONDS + budget))
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}

step() {  # step NAME MAX_SECONDS COMMAND...: runs it with min(MAX_SECONDS, what is left)
    local name=$1 limit=$2 left=$((deadline - SECONDS))
    shift 2
    ((left < limit)) && limit=$left
    if ((limit < 10)); then
        echo "== $name: skipped, the budget is spent"
        return
    fi
    echo "== $name (at most ${limit}s): $*"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@"
    echo "== $name: exit $? after $((SECONDS - start))s"
}

nvidia-smi -L
$python -c "import torch, transformers, torchvision; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name())"

# The CUDA cases only: the CPU ones run everywhere, and under older torch releases one of them
# crashes inside plain autograd's own backward, taking the whole run with it.
step tests 150 $python -m pytest -q -p no:cacheprovider -rfE tests/test_queue.py tests/test_random_training_steps.py \
    tests/ops tests/test_cuda_models.py tests/test_streams.py tests/test_offload.py tests/test_compile.py tests/test_fsdp.py \
    -k "cuda or test_cuda_models or test_streams or test_offload"
step cuda_precision 60 $python benchmarks/cuda_precision.py
step cuda_precision_nhwc 60 $python benchmarks/cuda_precision.py --memory-format channels_last
step per_call 120 $python benchmarks/per_call.py --device cuda --out "$out/per_call.json"
for raw in benchmarks/results/raw/*/bench.json; do
    model=$(basename "$(dirname "$raw")")
    model=${model%-*}
    sizes=$($python -c "import json,sys; print(*json.load(open(sys.argv[1]))['micro_sizes'])" "${raw%bench.json}costs.json")
    step "stage_costs $model" 60 $python benchmarks/stage_costs.py --device cuda --bench-json "$raw" \
        --out "$out/costs_$model.json" --micro-sizes $sizes --counts 1 2 4 8 --repeats 3
done
step overhead 90 $python benchmarks/overhead.py --device cuda --models resnet152 transformer llama \
    --out "$out/overhead.json"
step per_call_large 90 $python benchmarks/per_call.py --device cuda --no-layers --models transformer llama bert mlp \
    --width 1024 --seq-len 512 --micro-batch 8 --stage-rounds 20 --out "$out/per_call_large.json"
step compiled 150 $python benchmarks/compiled.py --device cuda --models llama --rounds 10 --out "$out/compiled.json"
