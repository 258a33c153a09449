#!/usr/bin/env bash
# GPU benchmark in one go (<= 8 minutes on a lent H200; see docs/benchmarks.md, "GPU run"):
# a FLUX.1-dev-sized transformer (presets/models.toml denoiser_config, random weights: no download) at
# 1024x1024, 28 steps, bf16, fused QKV: eager vs compile vs regional vs max-autotune, each step's
# achieved TFLOP/s against the bf16 matmul rate measured on the same GPU.
#
#   bash scripts/bench_gpu.sh wheelhouse   # on the dev machine, once: diffusers + what it needs -> .whl/
#   bash scripts/bench_gpu.sh [extra bench flags]
#                                          # on the GPU machine: installs diffusers from .whl/ (the
#                                          # device has torch and transformers, no diffusers, no network),
#                                          # runs the bench, writes $OUT/bench-gpu/{bench.json,bench.md,...}
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl

if [ "${1:-}" = wheelhouse ]; then
  PY=${PYTHON:-.venv/bin/python}
  rm -rf "$WHEELS" && mkdir -p "$WHEELS" || exit 1
  # diffusers and its dependencies as Linux x86_64 wheels for each Python the engine supports; numpy is
  # left out (transformers already needs it, and it is the largest).
  for v in 3.11 3.12 3.13; do
    "$PY" -m pip download -q diffusers==0.42.1 --only-binary=:all: --python-version "$v" \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$WHEELS" || exit 1
  done
  rm -f "$WHEELS"/numpy-*.whl
  du -sh "$WHEELS" && ls "$WHEELS"
  exit 0
fi

PY=${PYTHON:-python3}
OUT_DIR="${OUT:-artifacts}/bench-gpu"
mkdir -p "$OUT_DIR"
if ! "$PY" -c "import diffusers" 2>/dev/null; then
  [ -d "$WHEELS" ] || { echo "no $WHEELS/: run 'bash scripts/bench_gpu.sh wheelhouse' first and carry .whl" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" diffusers==0.42.1 || exit 2
fi
"$PY" -c "import sys, torch, diffusers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, 'gpu', torch.cuda.get_device_name())" | tee "$OUT_DIR/versions.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true

# Hard limit 450 s (start-up and the transfer of $OUT fit in the rest of 8 minutes); no mode starts
# after 330 s; every finished mode is written to bench.json as soon as it is measured.
timeout --signal=INT --kill-after=20 450 "$PY" -m engine bench --random-weights --preset flux1-dev \
  --device cuda --precisions bf16 --modes eager,compile,regional,max-autotune --fuse-qkv \
  --sizes 1024x1024 --steps 28 --runs 2 --matmul-roofline --time-budget 330 \
  --cache-dir /tmp/showcase-cache --out "$OUT_DIR" --no-progress "$@" 2>&1 | tee "$OUT_DIR/bench.log"
rc=${PIPESTATUS[0]}
echo "bench exited $rc (124/130 = stopped by the time limit; bench.json holds the modes that finished)"
exit "$rc"
