#!/usr/bin/env bash
# The GPU check, run ON the device machine: MLX's CUDA backend from the carried wheels,
# then (a) the token-exact tests, (b) bench.throughput, (c) bench.serving on burst and
# longmix (mlxd and mlx_lm.server), then bench.spec, (d) a markdown table, printed last.
#
#   bash bench/device_check.sh stage N             keep call N's wheels in /tmp/mlxd-wheels
#   bash bench/device_check.sh check               join and install them, then (a)-(d)
#   bash bench/device_check.sh check --cpu-smoke   no install, tiny sizes, this machine's CPU
#   bash bench/device_check.sh join                only join the parts and verify them
#   bash bench/device_check.sh list-tests [--cpu-smoke]
#
# bench/device_wheels.sh (run where there is network) makes the call folders and prints
# the calls to make; docs/PERFORMANCE.md, "GPU check", gives the whole sequence. The
# table, the raw logs and the benchmarks' JSON go to $OUT (the device tool brings that
# folder back; at most 8 files) or, without it, to /tmp/mlxd-check/out.
#
# Settings (environment): PYTHON (python3), MLXD_WHEELS_DIR (.whl), MLXD_WHEELS_STAGE
# (/tmp/mlxd-wheels), MLXD_SITE (/tmp/site), MLXD_CHECK_WORK (/tmp/mlxd-check), and each
# part's limit in seconds: MLXD_CHECK_TESTS_S, _THROUGHPUT_S, _BURST_S, _LONGMIX_S, _SPEC_S.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WHL=${MLXD_WHEELS_DIR:-$ROOT/.whl}
STAGE=${MLXD_WHEELS_STAGE:-/tmp/mlxd-wheels}
SITE=${MLXD_SITE:-/tmp/site}
WORK=${MLXD_CHECK_WORK:-/tmp/mlxd-check}
OUT=${OUT:-$WORK/out}

# (a) Token-exact against mlx_lm (greedy tokens, logprobs within 1e-3), most telling
# first, so that a run cut short by its limit still covers the core: the model runner
# in-process, the whole server, then the sliding-window and recurrent-state models.
TESTS=(
    tests/worker/test_model_runner.py::test_staggered_batch_matches_mlx_lm
    tests/worker/test_model_runner.py::test_prefix_from_pool_matches_full_prefill
    tests/worker/test_model_runner.py::test_pool_holds_the_kv_mlx_lm_computes
    tests/worker/test_model_runner.py::test_pool_writes_survive_compactions_and_joins
    tests/worker/test_model_runner.py::test_overlap_gives_the_tokens_of_no_overlap
    tests/worker/test_model_runner.py::test_released_rows_wait_for_the_next_join_and_every_output_stays_exact
    tests/worker/test_model_runner.py::test_seeded_sampling_ignores_batch_neighbours
    tests/worker/test_model_runner.py::test_penalised_rows_share_the_batch_and_decode_as_the_reference
    tests/server/test_server.py::test_concurrent_greedy_matches_mlx_lm
    tests/server/test_server.py::test_each_prompt_alone_matches_mlx_lm
    tests/server/test_server.py::test_seeded_sampling_is_reproducible_alone_and_in_a_batch
    tests/server/test_prefix_cache.py::test_chunked_prefill_matches_mlx_lm
    tests/server/test_penalised_requests.py::test_penalised_requests_batched_and_retracted_decode_as_the_reference
    tests/worker/test_hybrid_runner.py::test_staggered_batch_matches_mlx_lm
    tests/worker/test_hybrid_runner.py::test_each_prompt_alone_matches_mlx_lm
    tests/worker/test_hybrid_runner.py::test_chunked_prefill_matches_mlx_lm
    tests/worker/test_hybrid_runner.py::test_a_prefix_resumed_from_a_snapshot_matches_mlx_lm
    tests/worker/test_hybrid_runner.py::test_forward_pieces_within_one_prefill_match_mlx_lm
    tests/server/test_hybrid_models.py::test_concurrent_chunked_retracted_requests_match_mlx_lm
    tests/server/test_hybrid_models.py::test_a_shared_prefix_is_served_from_the_cache
)
SMOKE_TESTS=(
    "tests/worker/test_model_runner.py::test_staggered_batch_matches_mlx_lm[llama_model-paged]"
    "tests/server/test_server.py::test_concurrent_greedy_matches_mlx_lm[llama]"
)

# (b) and (c): sized so that the whole check ends inside one 10-minute device call.
THROUGHPUT=(--n 64 --prompt-len 128 --gen-len 256 --repeats 3)
SERVING=(--systems mlxd,mlx_lm --num-requests 64 --timeout 120)
LONGMIX=(--rate 2)
SMOKE_THROUGHPUT=(--n 4 --prompt-len 16 --gen-len 8 --repeats 1)
SMOKE_SERVING=(--systems mlxd,mlx_lm --num-requests 4 --prompt-median 32 --max-prompt 64
               --output-median 8 --max-output 16 --timeout 120)
SMOKE_LONGMIX=(--rate 4 --long-count 1 --long-len 256 --long-output 8)
# bench.spec: speculation off vs ngram, and the verify cost curve, on the bench model
# (the device machine reaches no registry to fetch smollm2 from)
SPEC=(--concurrency 1,8 --repeats 1 --gen-len 64)
SMOKE_SPEC=(--concurrency 1,2 --repeats 1 --gen-len 8 --cost-repeats 1)

die() { echo "device_check: $*" >&2; exit 2; }

stage() {
    local n=${1:?stage needs the call number} src
    src="$WHL/call$n"
    [[ -d $src ]] || die "no $src here: name it in this call's carry ([\".whl/call$n\"])"
    mkdir -p "$STAGE" && cp -f "$src"/* "$STAGE"/ || die "cannot copy $src to $STAGE"
    echo "staged call $n: $(ls "$src" | wc -l) files; $STAGE holds" \
         "$(du -sm "$STAGE" | cut -f1) MiB"
}

# Put every cut wheel back together (the parts stay, so that a join before the last
# stage call does no harm), then check all wheels against the manifest.
join_wheels() {
    local part wheel
    [[ -f $STAGE/MANIFEST.sha256 ]] || die "no wheels staged in $STAGE: make the stage calls first"
    for part in "$STAGE"/*.part-00; do
        [[ -e $part ]] || continue
        wheel=${part%.part-00}
        cat "$wheel".part-* >"$wheel.tmp" && mv "$wheel.tmp" "$wheel"
    done
    (cd "$STAGE" && sha256sum --quiet -c MANIFEST.sha256) || die "wheels missing or damaged" \
        "(above): a stage call was skipped, or the machine went cold between calls (it" \
        "stays warm 30 s); make every call again, from call 1"
    echo "wheels: $(ls "$STAGE"/*.whl | wc -l), all as downloaded"
}

install_wheels() {
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$STAGE"/*.whl || die "pip install failed"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    link_cuda_libraries
    find_cuda_home
    if ldd "$SITE/mlx/lib/libmlx.so" | grep "not found"; then
        echo "libmlx.so cannot find the libraries above"
    fi
    echo "installed into $SITE; CUDA_HOME=${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}"
}

# MLX's CUDA library looks for cuBLAS, cuDNN, NCCL, ... in ../../nvidia from its own
# folder (its RPATH), that is $SITE/nvidia: point that at the image's nvidia-* packages.
link_cuda_libraries() {
    local nv
    [[ -e $SITE/nvidia ]] && return 0
    nv=$(PYTHONPATH= "$PY" -c 'import nvidia, os
print(next(p for p in nvidia.__path__ if os.path.isdir(os.path.join(p, "cu13"))
           or os.path.isdir(os.path.join(p, "cublas"))))' 2>/dev/null)
    if [[ -n $nv ]]; then
        ln -s "$nv" "$SITE/nvidia" && echo "CUDA libraries: $nv"
    else
        echo "no nvidia-* packages found: MLX must find the CUDA libraries on the system path"
    fi
}

# NVRTC compiles some of MLX's kernels at run time against the headers under CUDA_HOME
# (else /usr/local/cuda): failing both, the toolkit of nvcc, or the nvidia-* packages'.
find_cuda_home() {
    local nvcc
    [[ -n ${CUDA_HOME:-}${CUDA_PATH:-} || -d /usr/local/cuda ]] && return 0
    nvcc=$(command -v nvcc)
    if [[ -n $nvcc ]]; then
        export CUDA_HOME=${nvcc%/bin/nvcc}
    elif [[ -d $SITE/nvidia/cu13/include ]]; then
        export CUDA_HOME=$SITE/nvidia/cu13
    fi
}

describe() {
    local gpu
    gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
          2>/dev/null | head -1)
    { echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
      echo "gpu: ${gpu:-none}"
      "$PY" -m bench.device_report info; } >"$WORK/device.txt"
    local rc=$?
    cat "$WORK/device.txt"
    return $rc
}

# Kill what a part left running (a server that a test cut short did not stop): every
# process whose environment carries this run's tag.
sweep() {
    local p pid left=()
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        ((pid == $$ || pid == BASHPID)) && continue
        grep -qxzF "MLXD_CHECK_TAG=$MLXD_CHECK_TAG" "$p/environ" 2>/dev/null && left+=("$pid")
    done
    ((${#left[@]})) || return 0
    echo "   stopping ${#left[@]} processes left running"
    kill -TERM "${left[@]}" 2>/dev/null
    sleep 3
    kill -KILL "${left[@]}" 2>/dev/null
    return 0
}

# run_part NAME LOG LIMIT_S COMMAND...: the output appended to $OUT/LOG, and
# "NAME RC SECONDS" to parts.tsv. SIGINT at the limit lets pytest print its summary.
run_part() {
    local name=$1 log=$2 limit=$3 start rc
    shift 3
    echo "== $name (limit ${limit} s): $*"
    echo "== $name: $*" >>"$OUT/$log"
    start=$SECONDS
    timeout -k 15 -s INT "$limit" "$@" >>"$OUT/$log" 2>&1
    rc=$?
    sweep
    echo "$name $rc $((SECONDS - start))" >>"$WORK/parts.tsv"
    echo "   exit $rc after $((SECONDS - start)) s"
    ((rc == 0)) || tail -5 "$OUT/$log" | sed 's/^/   | /'
}

run_parts() {
    local smoke=$1 tests throughput serving longmix t
    if [[ -n $smoke ]]; then
        tests=("${SMOKE_TESTS[@]}") throughput=("${SMOKE_THROUGHPUT[@]}")
        serving=("${SMOKE_SERVING[@]}") longmix=("${SMOKE_LONGMIX[@]}")
    else
        tests=("${TESTS[@]}") throughput=("${THROUGHPUT[@]}")
        serving=("${SERVING[@]}") longmix=("${LONGMIX[@]}")
    fi
    local slow=${smoke:+300}   # this CPU, shared: generous limits
    run_part tests tests.log "${MLXD_CHECK_TESTS_S:-${slow:-170}}" \
        "$PY" -m pytest -v -p no:cacheprovider --tb=short -rfE "${tests[@]}"
    run_part throughput throughput.log "${MLXD_CHECK_THROUGHPUT_S:-${slow:-100}}" \
        "$PY" -m bench.throughput "${throughput[@]}" --json "$WORK/throughput.json"
    # one run per trace, so that a run cut short loses one trace, not both
    run_part serving-burst serving.log "${MLXD_CHECK_BURST_S:-${slow:-80}}" \
        "$PY" -m bench.serving "${serving[@]}" --traces burst --out "$WORK/serving-burst"
    run_part serving-longmix serving.log "${MLXD_CHECK_LONGMIX_S:-${slow:-130}}" \
        "$PY" -m bench.serving "${serving[@]}" --traces longmix "${longmix[@]}" \
        --out "$WORK/serving-longmix"
    run_spec_part "$smoke"
    cp "$WORK/throughput.json" "$OUT/" 2>/dev/null
    for t in burst longmix; do
        cp "$WORK/serving-$t/results.json" "$OUT/serving-$t.json" 2>/dev/null
    done
}

# $OUT already holds its 8 files: bench.spec's table and JSON go into throughput.log.
# Until the launcher has --speculative, the part is left out, not failed.
run_spec_part() {
    local spec slow=${1:+300}
    if [[ -n $1 ]]; then spec=("${SMOKE_SPEC[@]}"); else spec=("${SPEC[@]}"); fi
    if ! "$PY" launch.py --help 2>/dev/null | grep -q -- --speculative; then
        echo "== spec: left out (launch.py has no --speculative)"
        return 0
    fi
    run_part spec throughput.log "${MLXD_CHECK_SPEC_S:-${slow:-90}}" \
        "$PY" -m bench.spec "${spec[@]}" --json "$WORK/spec.json"
    [[ -f $WORK/spec.json ]] && cat "$WORK/spec.json" >>"$OUT/throughput.log"
    return 0
}

check() {
    local smoke=
    [[ ${1:-} == --cpu-smoke ]] && smoke=1
    rm -rf "$WORK" && mkdir -p "$WORK" "$OUT" || die "cannot make $WORK and $OUT"
    # a pipeline, not exec > >(tee): the call must not end before the table is out
    check_steps "$smoke" 2>&1 | tee "$OUT/check.log"
    return "${PIPESTATUS[0]}"
}

check_steps() {
    local smoke=$1
    cd "$ROOT" || die "no $ROOT"
    export PYTHONUNBUFFERED=1 MLXD_CHECK_TAG="$$-$RANDOM"
    if [[ -z $smoke ]]; then
        join_wheels && install_wheels
    fi
    describe || die "cannot import MLX (above)"
    if [[ -z $smoke ]] && ! grep -q '^mlx device: Device(gpu' "$WORK/device.txt"; then
        die "MLX does not run on the GPU here (device.txt above): nothing measured"
    fi
    run_parts "$smoke"
    echo
    "$PY" -m bench.device_report table "$WORK" --logs "$OUT" --out "$OUT/table.md"
    awk '$2 != 0 { failed = 1 } END { exit failed }' "$WORK/parts.tsv"
}

case ${1:-} in
    stage) stage "${2:-}" ;;
    join) join_wheels ;;
    check) check "${2:-}" ;;
    list-tests)
        if [[ ${2:-} == --cpu-smoke ]]; then printf '%s\n' "${SMOKE_TESTS[@]}"
        else printf '%s\n' "${TESTS[@]}"; fi ;;
    *) sed -n '2,11p' "$0" >&2; exit 2 ;;
esac
