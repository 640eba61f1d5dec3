#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (docs/gpu_checks.md says what they showed).
#
#   bash scripts/gpu_check.sh [OUT_DIR]      (default gpu_check_out/)
#
# Runs, each step under its own time limit so one hang does not cost the rest: the CUDA tests
# (tests/test_gpu.py) and the sensor/op tests on the device's Python; a calibration; a get_data run at
# Llama-2-7B's real size in bf16 (every op and the functional group, at s4096_b1) without and with
# CUDA-graph replay; the torch_profiler launcher; the nsys launcher if an nsys is found; and, where a
# second Megatron-Core is staged in .whl19/, the op tests and a tiny run on that version.
#
# A machine without our packages gets them from wheels staged beside the repo (see the README's
# "GPU checks"): .whl/*.whl are installed into a private target, .whl/pure/ holds pure-Python packages
# that have no wheel. Two files land in OUT_DIR: summary.txt (each step's exit status, time and
# last lines) and runs.tar.gz (the logs and run folders, the large traces left out).
set -u
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
RUNS="$OUT_DIR/runs"
LOGS="$RUNS/logs"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"

stage_wheels() {  # $1: wheel folder, $2: target
    [ -d "$1" ] || return 0
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl
}

# All steps together stop after GPU_CHECK_DEADLINE_S (a lent machine's time is short): a step gets what is
# left, and those after the deadline are skipped, so the summary and the archive are always written.
DEADLINE=${GPU_CHECK_DEADLINE_S:-330}
# GPU_CHECK_STEPS="pytest llama7b_bf16 ...": run only these steps (a rerun after a fix), else all.
STEPS=${GPU_CHECK_STEPS:-}

step() {  # step NAME SECONDS COMMAND...: run, log, record the exit status and the wall time
    local name=$1 limit=$2
    shift 2
    if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then
        return
    fi
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 10 ]; then
        printf '%-22s skipped (deadline)\n' "$name" | tee -a "$SUMMARY"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local begin=$SECONDS
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local status=$?
    printf '%-22s exit %-3s %4ss\n' "$name" "$status" "$((SECONDS - begin))" | tee -a "$SUMMARY"
}

stage_wheels .whl /tmp/autotuner-site
export PYTHONPATH="/tmp/autotuner-site:$PWD/.whl/pure:$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" - <<'EOF'
import sys, torch, megatron.core, transformers, hydra
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("megatron-core", megatron.core.__version__, "transformers", transformers.__version__, "hydra", hydra.__version__)
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))
try:
    import transformer_engine  # noqa: F401
    print("transformer_engine present")
except Exception as exc:  # noqa: BLE001
    print("transformer_engine absent:", type(exc).__name__)
EOF
} >"$LOGS/environment.txt" 2>&1
cat "$LOGS/environment.txt" >>"$SUMMARY"

RUN=("$PY" -m autotuner.main progress=false)
LLAMA=(case=llama7b device=cuda dtype=bf16 shapes.seq_len=[4096] shapes.micro_batch_size=[1] timing.budget_s=0.3)

step pytest 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_sensors.py tests/test_ops.py
step calibrate 45 "$PY" -m autotuner.calibrate --device cuda --out "$RUNS/calibration.json"
CAL=()
[ -f "$RUNS/calibration.json" ] && CAL=("calibration=$RUNS/calibration.json")
step llama7b_bf16 120 "${RUN[@]}" "${LLAMA[@]}" 'ops=[all,functional]' \
    "${CAL[@]}" "hydra.run.dir=$RUNS/llama7b_bf16"
step llama7b_bf16_graphs 90 "${RUN[@]}" "${LLAMA[@]}" shapes.seq_len=[512] timing.cuda_graph=true \
    "${CAL[@]}" "hydra.run.dir=$RUNS/llama7b_bf16_graphs"
step llama7b_bf16_graphs_all 90 "${RUN[@]}" "${LLAMA[@]}" shapes.seq_len=[512] timing.cuda_graph=true \
    timing.cuda_graph_below_us=1e9 "${CAL[@]}" "hydra.run.dir=$RUNS/llama7b_bf16_graphs_all"
step llama7b_bf16_eager512 90 "${RUN[@]}" "${LLAMA[@]}" shapes.seq_len=[512] \
    "${CAL[@]}" "hydra.run.dir=$RUNS/llama7b_bf16_eager512"
step torch_profiler 75 "${RUN[@]}" case=tiny device=cuda launcher=torch_profiler \
    'ops=[transformer_layer,linear_qkv,core_attention]' "hydra.run.dir=$RUNS/torch_profiler"

NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys /usr/local/cuda*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none found}" | tee -a "$SUMMARY"
if [ -n "$NSYS" ]; then
    step nsys 90 "${RUN[@]}" case=tiny device=cuda launcher=nsys "launcher.nsys_bin=$NSYS" \
        'ops=[transformer_layer,linear_qkv]' "hydra.run.dir=$RUNS/nsys"
fi

if [ -d .whl19 ]; then  # a newer Megatron-Core over the same code
    stage_wheels .whl19 /tmp/autotuner-site19
    NEW=(env "PYTHONPATH=/tmp/autotuner-site19:$PYTHONPATH")
    step megatron_new_ops 90 "${NEW[@]}" "$PY" -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_cases.py
    step megatron_new_run 60 "${NEW[@]}" "${RUN[@]}" case=tiny device=cuda "hydra.run.dir=$RUNS/megatron_new_tiny"
fi

for log in "$LOGS"/*.log; do  # the end of every step's log, for a first look without the archive
    printf '\n== %s\n' "$(basename "$log")" >>"$SUMMARY"
    tail -n 8 "$log" | cut -c1-300 >>"$SUMMARY"
done
tar -czf "$OUT_DIR/runs.tar.gz" -C "$OUT_DIR" --exclude='*.nsys-rep' --exclude='*.sqlite' --exclude='*.qdstrm' \
    --exclude='*.json.gz' --exclude='*.pt.trace.json' runs
rm -rf "$RUNS"
cat "$SUMMARY"
