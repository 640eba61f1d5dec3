#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (docs/gpu_validation.md says what they showed).
#
#   bash scripts/gpu_check.sh [OUT_DIR]      (default gpu_check_out/)
#
# Runs, each step under its own time limit so one hang does not cost the rest: the CUDA tests
# (tests/test_gpu.py) and the sensor/op tests on the device's Python; a calibration; a get_data run at
# Llama-2-7B's real size in bf16 (every op and the functional group, at s4096_b1) without and with
# CUDA-graph replay; the torch_profiler launcher; the nsys launcher if an nsys is found; where a
# second Megatron-Core is staged in .whl19/, the op tests and a tiny run on that version; and last the
# three launchers on the same Llama-2-7B layer ops at s2048_b1, compared by autotuner.launcher_agreement
# (agreement.txt and agreement.json beside the summary).
#
# nsys: NSYS_BUNDLE=<an archive of a minimal Nsight Systems, nsys-min/>, for a GPU image without a
# working Nsight Systems (docs/gpu_validation.md), is unpacked into a temporary folder and its nsys given to
# the launcher; without it the launcher finds nsys itself (PATH, the project's .tools/, CUDA folders).
#
# A machine without our packages gets them from wheels staged beside the repo (docs/gpu_validation.md,
# "Rerunning the checks"): .whl/*.whl are installed into a private target, .whl/pure/ holds pure-Python packages
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
# GPU_CHECK_STEPS="pytest llama7b_bf16 ...": run only these steps (a rerun after a fix), else all. A
# word may be a pattern: GPU_CHECK_STEPS='agree_*' runs the three-launcher comparison alone.
STEPS=${GPU_CHECK_STEPS:-}

selected() {  # selected NAME: whether GPU_CHECK_STEPS asks for this step (every step when it is empty)
    [ -z "$STEPS" ] && return 0
    local word words
    read -ra words <<<"$STEPS"  # not $STEPS unquoted: a pattern must not expand to file names
    for word in "${words[@]}"; do
        # shellcheck disable=SC2053  # $word is a pattern on purpose
        [[ $1 == $word ]] && return 0
    done
    return 1
}

step() {  # step NAME SECONDS COMMAND...: run, log, record the exit status and the wall time
    local name=$1 limit=$2
    shift 2
    selected "$name" || return 0
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
# sdpa on the GPU: the default without Transformer-Engine, a fused kernel, no s x s scores saved.
step sdpa_test 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_sdpa_attention.py -m gpu
# The peak-memory estimate against max_memory_allocated over a llama-shaped point (docs/memory_and_fit.md).
step memory_fit 90 "$PY" -m pytest -q -s -p no:cacheprovider tests/test_memory_fit.py -k gpu
# The CUDA timer alone (events, hide_launch), for a session that runs only the three-launcher check.
step timer_test 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py -k 'hide_launch or launch_bound or events'
step calibrate 45 "$PY" -m autotuner.calibrate device=cuda "out=$RUNS/calibration.json"
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
# A forward timed after its backward (timing.forward_after_backward) beside llama7b_bf16_eager512's, back to
# back: on the CPU the two bracket a step's forward (autotuner.measure.timer); on a GPU, whose layer
# exceeds its L2, they should agree.
step forward_after_backward 60 "${RUN[@]}" "${LLAMA[@]}" shapes.seq_len=[512] timing.forward_after_backward=true \
    'ops=[transformer_layer,linear_fc1,core_attention]' "${CAL[@]}" "hydra.run.dir=$RUNS/forward_after_backward"
step torch_profiler 75 "${RUN[@]}" case=tiny device=cuda launcher=torch_profiler \
    'ops=[transformer_layer,linear_qkv,core_attention]' "hydra.run.dir=$RUNS/torch_profiler"

# MoE and MLA layers on the GPU path: the all-to-all dispatcher, grouped-GEMM experts where
# Transformer-Engine imports (the rows' token_dispatcher and experts_impl say which ran), and MLA's
# attention ops, one layer each at real sizes.
step moe_mixtral_bf16 120 "${RUN[@]}" case=mixtral_8x7b device=cuda dtype=bf16 shapes.seq_len=[2048] \
    shapes.micro_batch_size=[1] moe.routing=balanced \
    'ops=[transformer_layer,moe_layer,router,token_dispatch,experts,token_combine]' \
    "hydra.run.dir=$RUNS/moe_mixtral_bf16"
step mla_deepseek_bf16 120 "${RUN[@]}" case=deepseek_v2_lite device=cuda dtype=bf16 shapes.seq_len=[2048] \
    shapes.micro_batch_size=[1] \
    'ops=[self_attention,mla_q_proj,kv_down_proj,kv_layernorm,kv_up_proj,rope,core_attention,linear_proj,moe_layer,shared_experts,experts]' \
    "hydra.run.dir=$RUNS/mla_deepseek_bf16"

# The predictor against real steps on a GPU: a Llama-2-7B-shaped model, bf16, its stage ops
# profiled cold-cached as a step runs them (per layer: the profiled model's depth does not matter), then
# predicted and validated against Megatron's schedule running the whole model (autotuner.validate.steps)
# with as many layers as the prediction fits in the GPU's memory (num_layers=fit, up to Llama's 32); and
# with full recompute, where Adam's step, not the activations, sets the peak (docs/gpu_validation.md:
# 29 layers).
GPU_GB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 |
    awk '{ printf "%.1f", $1 * 1048576 / 1e9 }')
step predict_profile 120 "${RUN[@]}" case=llama7b hf.num_hidden_layers=4 device=cuda dtype=bf16 \
    shapes.seq_len=[2048] shapes.micro_batch_size=[1] timing.flush_cache=true report=false \
    'ops=[embedding,transformer_layer,core_attention,final_layernorm,output_layer]' "${CAL[@]}" \
    "hydra.run.dir=$RUNS/predict_profile"
step predict_validate 180 "$PY" -m autotuner.validate "$RUNS/predict_profile" seq_len=2048 \
    micro_batch_size=1 global_batch_size=8 dtype=bf16 repeats=5 report=false \
    ${GPU_GB:+num_layers=fit "gpu_memory_gb=$GPU_GB"} \
    "json=$RUNS/predict_validate.json"
step predict_validate_full 120 "$PY" -m autotuner.validate "$RUNS/predict_profile" seq_len=2048 \
    micro_batch_size=1 global_batch_size=8 dtype=bf16 recompute=full repeats=5 report=false \
    ${GPU_GB:+num_layers=fit "gpu_memory_gb=$GPU_GB"} \
    "json=$RUNS/predict_validate_full.json"

# The H100 fixture of Megatron-LM's published weak-scaling runs (benchmarks.megatron_published,
# docs/cluster_model.md): for each GPT of the table, one layer of one emulated rank at the run's TP
# (tf.tensor_model_parallel_size without torchrun: the rank's shapes, its collectives recorded, not run;
# sequence parallelism at TP > 1), bf16, attention=sdpa, cold caches, s4096 at micro-batches 1 and 2,
# the ops the prediction reads (the layer, core attention for selective recompute and context
# parallelism, its four GEMMs for tp_comm_overlap, the embedding, final norm and output layer), each
# run keeping the device calibration. OUT_DIR/h100_megatron_gpt is the fixture: copy it to
# tests/fixtures/. Then the benchmark from it. scripts/make_h100_fixture.sh runs these steps alone.
FIXTURE="$OUT_DIR/h100_megatron_gpt"
FIXTURE_OPS='ops=[embedding,transformer_layer,core_attention,linear_qkv,linear_proj,linear_fc1,linear_fc2,final_layernorm,output_layer]'
for spec in 1_7b:1 7_1b:2 16b:4 32b:8; do
    name=${spec%:*} tp=${spec#*:}
    SP=()
    [ "$tp" -gt 1 ] && SP=(tf.sequence_parallel=true)
    step "fixture_$name" 150 "${RUN[@]}" "case=megatron_gpt_$name" hf.num_hidden_layers=1 device=cuda \
        dtype=bf16 attention=sdpa "tf.tensor_model_parallel_size=$tp" "${SP[@]}" shapes.seq_len=[4096] \
        shapes.micro_batch_size=[1,2] timing.flush_cache=true timing.budget_s=0.3 report=false \
        "$FIXTURE_OPS" "${CAL[@]}" "hydra.run.dir=$FIXTURE/megatron_gpt_$name"
done
if [ -d "$FIXTURE" ]; then
    [ -f "$RUNS/calibration.json" ] && cp "$RUNS/calibration.json" "$FIXTURE/"
    step fixture_benchmark 120 "$PY" -m benchmarks.megatron_published --fixture "$FIXTURE"
    cp "$LOGS/fixture_benchmark.log" "$OUT_DIR/megatron_published.txt" 2>/dev/null
fi

# Which nsys: the bundle's when NSYS_BUNDLE names one, else the launcher's own lookup (no nsys_bin given).
# Nsight Compute's bundled nsys is not tried: it writes a .qdstrm but no report (docs/gpu_validation.md).
NSYS_ARGS=()
NSYS_USABLE=yes
if [ -n "${NSYS_BUNDLE:-}" ]; then
    NSYS_DIR=$(mktemp -d)
    trap 'rm -rf "$NSYS_DIR"' EXIT
    NSYS_BIN="$NSYS_DIR/nsys-min/target-linux-x64/nsys"
    NSYS_IMPORTER="$NSYS_DIR/nsys-min/host-linux-x64/QdstrmImporter"
    # Python's tarfile reads .tar.xz and .tar.gz alike, also on an image without xz; its "data" filter
    # (where Python has one) keeps every file inside the folder.
    UNPACK='import sys, tarfile
with tarfile.open(sys.argv[1]) as archive:
    archive.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))'
    if ! "$PY" -c "$UNPACK" "$NSYS_BUNDLE" "$NSYS_DIR" >"$LOGS/nsys_bundle.txt" 2>&1; then
        NSYS_USABLE=
        echo "nsys: NSYS_BUNDLE=$NSYS_BUNDLE could not be unpacked (logs/nsys_bundle.txt): no nsys steps" \
            | tee -a "$SUMMARY"
    elif ! "$NSYS_BIN" --version >>"$LOGS/nsys_bundle.txt" 2>&1; then
        NSYS_USABLE=
        echo "nsys: the bundle's nsys does not start (logs/nsys_bundle.txt): no nsys steps" \
            | tee -a "$SUMMARY"
    elif ! "$NSYS_IMPORTER" --version >>"$LOGS/nsys_bundle.txt" 2>&1; then
        # Without its importer nsys exits 0 having written only a .qdstrm (GBs for a CUDA trace).
        NSYS_USABLE=
        echo "nsys: the bundle's report importer does not start (logs/nsys_bundle.txt): no nsys steps" \
            | tee -a "$SUMMARY"
    else
        echo "nsys: from NSYS_BUNDLE, $("$NSYS_BIN" --version 2>&1 | tail -n 1)" | tee -a "$SUMMARY"
        NSYS_ARGS=("launcher.nsys_bin=$NSYS_BIN")
    fi
else
    echo "nsys: the launcher's own lookup (the nsys steps' logs name the nsys used, or that none was found)" \
        | tee -a "$SUMMARY"
fi
if [ -n "$NSYS_USABLE" ]; then
    step nsys 90 "${RUN[@]}" case=tiny device=cuda launcher=nsys "${NSYS_ARGS[@]}" \
        'ops=[transformer_layer,linear_qkv]' "hydra.run.dir=$RUNS/nsys"
fi

if [ -d .whl19 ]; then  # a newer Megatron-Core over the same code
    stage_wheels .whl19 /tmp/autotuner-site19
    NEW=(env "PYTHONPATH=/tmp/autotuner-site19:$PYTHONPATH")
    step megatron_new_ops 90 "${NEW[@]}" "$PY" -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_cases.py
    step megatron_new_run 60 "${NEW[@]}" "${RUN[@]}" case=tiny device=cuda "hydra.run.dir=$RUNS/megatron_new_tiny"
fi

# The three launchers on the same ops and shape point: get_data, torch_profiler and nsys times
# and their ratios to nsys's GPU time, its kernels, memsets and copies (to torch_profiler's without an
# nsys run). Default timing: the point is what a user gets. Only the rows' times are needed (the traces stay out of the archive): no
# report, and a lean detailed profiler session.
AGREE=("${RUN[@]}" report=false case=llama7b device=cuda dtype=bf16 shapes.seq_len=[2048]
    shapes.micro_batch_size=[1] 'ops=[transformer_layer,linear_qkv,core_attention,mlp,linear_fc1]')
step agree_get_data 120 "${AGREE[@]}" "hydra.run.dir=$RUNS/agree_get_data"
# The same without the spin kernel before each sample (timing.hide_launch): what the host's launch delay
# adds to get_data's samples. Its table (agreement_nohide.txt) is the "before" of agreement.txt.
step agree_get_data_nohide 120 "${AGREE[@]}" timing.hide_launch=false "hydra.run.dir=$RUNS/agree_get_data_nohide"
step agree_torch_profiler 150 "${AGREE[@]}" launcher=torch_profiler launcher.active=10 \
    launcher.with_stack=false launcher.record_shapes=false launcher.profile_memory=false \
    "hydra.run.dir=$RUNS/agree_torch_profiler"
if [ -n "$NSYS_USABLE" ]; then
    step agree_nsys 180 "${AGREE[@]}" launcher=nsys launcher.iterations=10 "${NSYS_ARGS[@]}" \
        "hydra.run.dir=$RUNS/agree_nsys"
fi
rm -f "$OUT_DIR/agreement.txt" "$OUT_DIR/agreement.json"  # never a table left from an earlier run
if [ -f "$RUNS/agree_get_data/results.jsonl" ] && [ -f "$RUNS/agree_torch_profiler/results.jsonl" ]; then
    AGREE_RUNS=("$RUNS/agree_get_data" "$RUNS/agree_torch_profiler")
    if [ -f "$RUNS/agree_nsys/results.jsonl" ]; then
        AGREE_RUNS+=("$RUNS/agree_nsys")
        NSYS_NOTE="with nsys"
    else
        NSYS_NOTE="no nsys column: no usable nsys, or its run left no results (logs/agree_nsys.log)"
    fi
    # It reads two or three results files, a second's work: it runs even past the deadline.
    {
        printf '\n== three launchers, Llama-2-7B layer, bf16, s2048_b1 (%s)\n' "$NSYS_NOTE"
        timeout 60 "$PY" -m autotuner.launcher_agreement "${AGREE_RUNS[@]}" "json=$OUT_DIR/agreement.json"
        echo "launcher_agreement exit $?"
    } >"$OUT_DIR/agreement.txt" 2>&1
    cp "$OUT_DIR/agreement.txt" "$RUNS/"
    [ -f "$OUT_DIR/agreement.json" ] && cp "$OUT_DIR/agreement.json" "$RUNS/"
    cat "$OUT_DIR/agreement.txt" >>"$SUMMARY"
    if [ -f "$RUNS/agree_get_data_nohide/results.jsonl" ]; then
        {
            printf '\n== the same, get_data with timing.hide_launch=false\n'
            timeout 60 "$PY" -m autotuner.launcher_agreement "$RUNS/agree_get_data_nohide" "${AGREE_RUNS[@]:1}"
            echo "launcher_agreement exit $?"
        } >"$RUNS/agreement_nohide.txt" 2>&1
        cat "$RUNS/agreement_nohide.txt" >>"$SUMMARY"
    fi
elif selected agree_get_data || selected agree_torch_profiler; then
    echo "three-launcher table: not made (the get_data or torch_profiler run left no results)" \
        | tee -a "$SUMMARY"
fi

for log in "$LOGS"/*.log; do  # the end of every step's log, for a first look without the archive
    printf '\n== %s\n' "$(basename "$log")" >>"$SUMMARY"
    tail -n 8 "$log" | cut -c1-300 >>"$SUMMARY"
done
tar -czf "$OUT_DIR/runs.tar.gz" -C "$OUT_DIR" --exclude='*.nsys-rep' --exclude='*.sqlite' --exclude='*.qdstrm' \
    --exclude='*.json.gz' --exclude='*.pt.trace.json' runs
rm -rf "$RUNS"
cat "$SUMMARY"
