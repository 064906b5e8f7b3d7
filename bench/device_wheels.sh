#!/usr/bin/env bash
# Prepare the GPU check's wheels HERE (with network), then print the device calls.
#
#   bash bench/device_wheels.sh            # download, split into call folders, print calls
#   bash bench/device_wheels.sh --split    # only re-split what .whl/all already holds
#
# The GPU machine (NVIDIA H200, x86-64, Python 3.12, root, no network) lacks MLX and
# part of our dependencies; they travel as cp312 manylinux wheels, at the versions
# installed here, in ignored folders named in a device call's `carry`. A call carries
# at most 64 MiB with the checkout, so the wheels are packed into .whl/call1, call2, ...
# of at most MLXD_WHEELS_CALL_MIB each, and a wheel larger than that is cut into parts
# that `bench/device_check.sh stage` / `check` put back together there.
# docs/PERFORMANCE.md, "GPU check", gives the whole sequence.
#
# Settings (environment): MLXD_WHEELS_DIR (default .whl), MLXD_WHEELS_CALL_MIB (56),
# MLXD_CUDA (13: the machine's driver is CUDA 13), PYTHON (python3), MLXD_WHEELS_TREE
# (the checkout whose files travel with each call; default this repository).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHL=${MLXD_WHEELS_DIR:-$ROOT/.whl}
CALL_MIB=${MLXD_WHEELS_CALL_MIB:-56}
CUDA=${MLXD_CUDA:-13}
PY=${PYTHON:-python3}
LIMIT=$((CALL_MIB * 1024 * 1024))
TREE=${MLXD_WHEELS_TREE:-$ROOT}
TREE_LIMIT=$((64 * 1024 * 1024))   # the device tool's limit on what one call sends

# What the machine's image lacks (docs/PERFORMANCE.md lists what it has), with the
# needs of each that it lacks too. Everything else (numpy, msgpack, transformers,
# tokenizers, uvloop, prometheus-client, httpx, anyio, pytest, ...) is used as found.
PACKAGES=(
    mlx "mlx-cuda-$CUDA" mlx-lm pyzmq llguidance
    fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
    typing-extensions opentelemetry-api
    openai anthropic httpx2 httpcore2 truststore jiter sniffio docstring-parser
)
PLATFORMS=(manylinux1_x86_64 manylinux2014_x86_64 manylinux_2_17_x86_64
           manylinux_2_24_x86_64 manylinux_2_26_x86_64 manylinux_2_27_x86_64
           manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64
           manylinux_2_35_x86_64)

die() { echo "device_wheels: $*" >&2; exit 1; }

# NAME==VERSION for every package, at the version installed here; MLX's CUDA backend
# at MLX's own version (the tests compare against this machine's mlx_lm).
pins() {
    "$PY" - "${PACKAGES[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version('mlx' if name.startswith('mlx-cuda-') else name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"not installed here, so no version to match: {' '.join(missing)}")
EOF
}

download() {
    local new="$WHL/all.new" list
    list=$(pins) || die "cannot pin the versions"
    rm -rf "$new" && mkdir -p "$new"
    # shellcheck disable=SC2046
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $(printf -- '--platform %s ' "${PLATFORMS[@]}") \
        -d "$new" $list >"$WHL/pip.log" 2>&1 || { cat "$WHL/pip.log"; die "pip download failed"; }
    local want got
    want=$(wc -w <<<"$list")
    got=$(find "$new" -name '*.whl' | wc -l)
    [[ $want == "$got" ]] || die "expected $want wheels (one of each), pip gave $got"
    rm -rf "$WHL/all" && mv "$new" "$WHL/all"
    echo "$list" | tr ' ' '\n' >"$WHL/all/PINS"
}

# Sizes and paths of what must travel, largest first: whole wheels, and the parts of
# any wheel larger than one call.
items() {
    local w
    rm -rf "$WHL/parts" && mkdir -p "$WHL/parts"
    for w in "$WHL"/all/*.whl; do
        if (($(stat -c %s "$w") > LIMIT)); then
            split -b "$LIMIT" -d -a 2 "$w" "$WHL/parts/$(basename "$w").part-"
        else
            echo "$w"
        fi
    done
    ls "$WHL"/parts/* 2>/dev/null || true
}

# First-fit decreasing into call folders of at most LIMIT bytes each.
pack() {
    local -a used=()
    local size path i
    rm -rf "$WHL"/call[0-9]*
    while read -r size path; do
        for ((i = 0; i < ${#used[@]}; i++)); do
            ((used[i] + size <= LIMIT)) && break
        done
        [[ $i == "${#used[@]}" ]] && used+=(0) && mkdir -p "$WHL/call$((i + 1))"
        used[i]=$((used[i] + size))
        ln -f "$path" "$WHL/call$((i + 1))/" 2>/dev/null || cp "$path" "$WHL/call$((i + 1))/"
    done < <(items | xargs stat -c '%s %n' | sort -rn)
    # every call carries the manifest, so the last one can tell what is missing
    (cd "$WHL/all" && sha256sum -- *.whl) >"$WHL/MANIFEST.sha256"
    for ((i = 1; i <= ${#used[@]}; i++)); do
        cp "$WHL/MANIFEST.sha256" "$WHL/call$i/"
    done
}

# Bytes the device tool sends besides the carried folder: tracked files and
# untracked ones that git does not ignore.
tree_bytes() {
    (cd "$TREE" && git ls-files -z --cached --others --exclude-standard |
        du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
}

print_calls() {
    local n tree i rel size cmd limit_s
    n=$(find "$WHL" -maxdepth 1 -name 'call[0-9]*' | wc -l)
    tree=$(tree_bytes)
    rel=$(realpath --relative-to="$ROOT" "$WHL")
    echo "checkout: $((tree / 1024)) KiB; wheels: $(find "$WHL/all" -name '*.whl' | wc -l)," \
         "$(du -sm "$WHL/all" | cut -f1) MiB in $n calls"
    echo
    echo "Device calls (tool run), in order, each within 30 s of the previous reply"
    echo "(a machine stays warm 30 s; a cold one has lost the staged wheels: start again at 1):"
    for ((i = 1; i <= n; i++)); do
        size=$(du -cb "$WHL/call$i"/* | tail -1 | cut -f1)
        ((size + tree <= TREE_LIMIT)) || die "call $i would send $(((size + tree) >> 20)) MiB"
        cmd="bash bench/device_check.sh stage $i" limit_s=120
        ((i == n)) && cmd+=" && bash bench/device_check.sh check" && limit_s=600
        echo "  $i. command: $cmd"
        echo "     carry: [\"$rel/call$i\"]   timeout_s: $limit_s   ($((size >> 20)) MiB)"
    done
}

main() {
    mkdir -p "$WHL"
    if [[ $(realpath "$WHL")/ == "$ROOT"/* ]]; then
        git -C "$ROOT" check-ignore -q "$WHL/x" || die "$WHL is not ignored by git, so it" \
            "would travel with every call: add '/.whl/' to .gitignore or .git/info/exclude"
    fi
    [[ ${1:-} == --split ]] || download
    [[ -d $WHL/all ]] || die "no $WHL/all: run without --split first"
    pack
    print_calls
}

main "$@"
