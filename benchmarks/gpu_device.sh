#!/usr/bin/env bash
# The GPU kit in one command, for a GPU machine without network (or any GPU box):
#
#   make gpu-kit                      # here, with network: the wheels into .gpu_kit/wheels
#   bash benchmarks/gpu_device.sh     # there, from the repository root, .gpu_kit/wheels beside it
#
# Installs the carried wheels offline (pip --no-index --find-links, no dependencies, into a
# scratch --target put on PYTHONPATH: the machine's own torch, triton and transformers stay),
# puts this checkout on PYTHONPATH (rayflex as source; Ray's workers inherit it), then runs
# benchmarks/gpu_kit.py: $OUT/gpu_kit.json (rewritten after every run) and $OUT/gpu_kit.log.
# Extra arguments go to gpu_kit.py (e.g. --rounds 3, --systems torchtitan,rayflex-in-process).
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=${GPU_KIT_WHEELS:-.gpu_kit/wheels}
OUT=${OUT:-$PWD/gpu_kit_out}
PYTHON=${PYTHON:-python3}
# The kit's own budget is 450 s of runs (gpu_kit.py --budget-s); this stops a hung run past it.
LIMIT_S=${GPU_KIT_LIMIT_S:-500}
mkdir -p "$OUT"

if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "no wheels in $WHEELS: run 'make gpu-kit' on a machine with network and carry .gpu_kit" >&2
    exit 2
fi
SITE=$(mktemp -d /tmp/gpu-kit-site.XXXXXX)
t0=$(date +%s)
# Every wheel, none of their dependencies: the image has torch (CUDA) and the rest.
"$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" --no-deps --no-compile --no-cache-dir \
    --target "$SITE" "$WHEELS"/*.whl || { echo "offline install from $WHEELS failed" >&2; exit 3; }
echo "[gpu_device] installed $(ls "$WHEELS"/*.whl | wc -l) wheels offline in $(( $(date +%s) - t0 )) s" >&2

export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
export PYTHONUNBUFFERED=1
unset RAY_ADDRESS  # never join a cluster the machine may know of

timeout --kill-after=20 "$LIMIT_S" "$PYTHON" benchmarks/gpu_kit.py --out "$OUT/gpu_kit.json" "$@" \
    > "$OUT/gpu_kit_stdout.json" 2> >(tee "$OUT/gpu_kit.log" >&2)
status=$?
rm -f "$OUT/gpu_kit_stdout.json"  # the same object as gpu_kit.json when the kit finished
echo "[gpu_device] gpu_kit.py exited $status after $(( $(date +%s) - t0 )) s; results in $OUT/gpu_kit.json" >&2
exit $status
