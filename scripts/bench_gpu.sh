#!/usr/bin/env bash
# GPU benchmark in one go (<= 9 minutes on a lent H200; see docs/benchmarks.md, "GPU run"):
# a FLUX.1-dev-sized transformer (presets/models.toml denoiser_config, random weights: no download) at
# 1024x1024, 28 steps, bf16, fused QKV: eager vs compile vs CUDA graphs (compile, mode="reduce-overhead")
# vs regional vs max-autotune, each step's achieved TFLOP/s against the bf16 matmul rate measured on the
# same GPU; then an FA3 row (full compile with the _flash_3_hub or _flash_3 attention backend) when this
# machine can run FA3, else the reason, from `python -m engine attention`.
#
#   bash scripts/bench_gpu.sh wheelhouse   # on the dev machine, once: diffusers + what it needs -> .whl/
#   bash scripts/bench_gpu.sh [extra bench flags]
#                                          # on the GPU machine: installs diffusers from .whl/ (the
#                                          # device has torch and transformers, no diffusers, no network),
#                                          # runs the bench, writes $OUT/bench-gpu/{bench.json,bench.md,...}
#                                          # and $OUT/bench-gpu-fa3/
#   bash scripts/bench_gpu.sh aot          # a second call: eager vs aot (AOTInductor package: export +
#                                          # AOT compile of the full transformer, minutes) -> $OUT/bench-gpu-aot/
#   bash scripts/bench_gpu.sh batch        # batch-size sweep: 1/2/4/8 images per compiled denoiser call
#                                          # (sizes --max-batch on this GPU) -> $OUT/bench-gpu-batch/sweep.md
#   bash scripts/bench_gpu.sh cp           # a third call: the context-parallel row -> $OUT/bench-gpu-cp/:
#                                          # the same transformer on one GPU against Ulysses over 2 GPUs
#                                          # (python -m bench cp-bench), then Ring with cuDNN attention;
#                                          # skipped with a message where fewer than 2 GPUs are visible
#   bash scripts/bench_gpu.sh levers       # a fourth call: quantized precisions (bf16 vs int8wo, int8dq, fp8)
#                                          # on the full-size random-weight transformer, eager and compile
#                                          # (speed only), then step caches x precisions on tiny-shapes
#                                          # (every combination runs on CUDA; cache speed-ups and quality
#                                          # at scale need real weights) -> $OUT/bench-gpu-levers/
#   bash scripts/bench_gpu.sh memory       # memory levers on the FLUX.1-dev-size transformer (random weights,
#                                          # bf16, 1024x1024, 28 steps): none, layerwise fp8, group offload
#                                          # (block, CUDA stream prefetch), model offload; s / image and peak GiB
#                                          # beside the estimate and diffusers' table -> $OUT/bench-gpu-memory/
#   bash scripts/bench_gpu.sh edit         # the edit case: FLUX.1 Kontext-dev's transformer (random weights, bf16)
#                                          # at 1024x1024 with one 1024x1024 reference (8704 tokens), 8 steps x
#                                          # 2 runs: eager vs compile, in bf16 and fp8 (fp8 where the GPU is
#                                          # sm_89+); recompiles at the warm edit bucket, peak memory
#                                          # -> $OUT/bench-gpu-edit/
#   bash scripts/bench_gpu.sh video        # the video case: Wan 2.1 T2V 1.3B's transformer (random weights, bf16)
#                                          # at 832x480 x 33 frames, guidance as two forwards per step: eager vs
#                                          # compile, bf16 and fp8; then Wan 2.1's VAE decoding that clip, plain
#                                          # vs enable_tiling() (python -m bench vae-bench), ms and peak GiB
#                                          # -> $OUT/bench-gpu-video/{denoiser,vae}/
#                                          # edit and video have not yet run on a GPU (docs/benchmarks.md)
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
  # torchao (quantized precisions), pinned like the project; the device's torch is used as it is.
  for v in 3.11 3.12 3.13; do
    "$PY" -m pip download -q torchao==0.18.0 --no-deps --only-binary=:all: --python-version "$v" \
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
if ! "$PY" -c "import torchao" 2>/dev/null && [ -d "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps torchao==0.18.0 || echo "torchao not installed" >&2
fi
"$PY" -c "import sys, torch, diffusers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, 'gpu', torch.cuda.get_device_name())" | tee "$OUT_DIR/versions.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true

COMMON=(--random-weights --preset flux1-dev --device cuda --precisions bf16 --fuse-qkv --sizes 1024x1024
        --steps 28 --runs 2 --cache-dir /tmp/showcase-cache --no-progress)

cp_row() {
  # Context parallel: 1 GPU vs 2 ranks (Ulysses, then Ring with _native_cudnn, which returns the LSE Ring
  # needs); each at most 240 s.
  local CP_DIR="${OUT:-artifacts}/bench-gpu-cp"
  mkdir -p "$CP_DIR"
  local GPUS
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "${GPUS:-0}" -lt 2 ]; then
    echo "context-parallel row skipped: $GPUS GPU(s) visible, Ulysses-2 needs 2" | tee "$CP_DIR/skipped.txt"
    return 0
  fi
  for layout in "ulysses native" "ring _native_cudnn"; do
    set -- $layout
    timeout --signal=INT --kill-after=20 240 "$PY" -m bench cp-bench --preset flux1-dev --device cuda \
      --precision bf16 --tp 2 --parallel "$1" --attention-backend "$2" --sizes 1024x1024 --modes eager \
      --runs 5 --timeout 200 --out "$CP_DIR/$1" 2>&1 | tee "$CP_DIR/$1.log"
    echo "context-parallel $1 exited ${PIPESTATUS[0]}"
  done
}

gpu_precisions() {
  # bf16, and fp8 where this GPU has float8 matmuls (compute capability 8.9+); the bench refuses fp8 elsewhere.
  "$PY" -c "import torch; print('bf16,fp8' if torch.cuda.get_device_capability() >= (8, 9) else 'bf16')" \
    2>/dev/null || echo bf16
}

if [ "${1:-}" = edit ]; then
  shift
  # FLUX.1 Kontext at its edit bucket: the reference's 4096 tokens join the output's 4096 and the 512 text
  # tokens. Modes in order (each finished one kept in bench.json); no configuration starts after 360 s, hard
  # limit 480 s: two full compiles of the 12B transformer (bf16, fp8) are the long part.
  EDIT_DIR="${OUT:-artifacts}/bench-gpu-edit"
  mkdir -p "$EDIT_DIR"
  timeout --signal=INT --kill-after=20 480 "$PY" -m bench bench --random-weights --preset flux1-kontext-dev \
    --device cuda --precisions "$(gpu_precisions)" --modes eager,compile --sizes 1024x1024 --references 1024x1024 \
    --steps 8 --runs 2 --matmul-roofline --time-budget 360 --cache-dir /tmp/showcase-cache --no-progress \
    --out "$EDIT_DIR" "$@" 2>&1 | tee "$EDIT_DIR/bench.log"
  rc=${PIPESTATUS[0]}
  echo "edit bench exited $rc (124/130 = stopped by the time limit; bench.json holds the modes that finished)"
  exit "$rc"
fi

if [ "${1:-}" = video ]; then
  shift
  # Wan 2.1 T2V 1.3B at 832x480 x 33 frames (14040 video tokens; guidance's halves are two forwards, as
  # WanPipeline runs them): at most 330 s, no configuration after 250 s. Then the VAE decode of that clip,
  # plain and tiled: at most 150 s. Extra arguments go to the denoiser bench; $VAE_BENCH_FLAGS (word-split) to
  # vae-bench, e.g. a CPU smoke run's "--device cpu --size 64x64 --frames 9 --vae-config-override {...}".
  VIDEO_DIR="${OUT:-artifacts}/bench-gpu-video"
  mkdir -p "$VIDEO_DIR/denoiser" "$VIDEO_DIR/vae"
  timeout --signal=INT --kill-after=20 330 "$PY" -m bench bench --random-weights --preset wan2.1-t2v-1.3b \
    --device cuda --precisions "$(gpu_precisions)" --modes eager,compile --sizes 832x480 --frames 33 \
    --steps 8 --runs 2 --matmul-roofline --time-budget 250 --cache-dir /tmp/showcase-cache --no-progress \
    --out "$VIDEO_DIR/denoiser" "$@" 2>&1 | tee "$VIDEO_DIR/denoiser/bench.log"
  rc=${PIPESTATUS[0]}
  echo "video denoiser bench exited $rc (124/130 = stopped by the time limit)"
  timeout --signal=INT --kill-after=20 150 "$PY" -m bench vae-bench --preset wan2.1-t2v-1.3b --device cuda \
    --precision bf16 --size 832x480 --frames 33 --runs 3 --out "$VIDEO_DIR/vae" ${VAE_BENCH_FLAGS:-} 2>&1 \
    | tee "$VIDEO_DIR/vae/vae.log"
  echo "vae decode bench exited ${PIPESTATUS[0]}"
  exit "$rc"
fi

if [ "${1:-}" = cp ]; then
  cp_row
  exit $?
fi

if [ "${1:-}" = aot ]; then
  shift
  # Eager, then the AOTInductor package of the transformer (constants outside the package, loaded on the
  # model's own weights); hard limit 540 s.
  AOT_DIR="${OUT:-artifacts}/bench-gpu-aot"
  mkdir -p "$AOT_DIR"
  timeout --signal=INT --kill-after=20 540 "$PY" -m bench bench "${COMMON[@]}" --modes eager,compile,aot \
    --time-budget 420 --out "$AOT_DIR" "$@" 2>&1 | tee "$AOT_DIR/bench.log"
  rc=${PIPESTATUS[0]}
  echo "aot bench exited $rc"
  exit "$rc"
fi

if [ "${1:-}" = batch ]; then
  shift
  # Batch-size sweep (engine/pipeline/batching.py sizes --max-batch): the same transformer, compiled, with 1/2/4/8
  # images per denoiser call; per size the step time, the time per image, peak memory and the gain per
  # image against 1. The default --max-batch for a GPU is the largest size that still gains (>= 10 % per
  # image) and fits the memory budget with the other engines. Hard limit 540 s; sizes run in order and
  # each finished one is kept.
  BATCH_DIR="${OUT:-artifacts}/bench-gpu-batch"
  mkdir -p "$BATCH_DIR"
  SWEEP_START=$SECONDS
  for b in ${BATCH_SIZES:-1 2 4 8}; do
    left=$((540 - (SECONDS - SWEEP_START)))
    [ "$left" -gt 60 ] || { echo "batch $b: skipped, time is up"; break; }
    timeout --signal=INT --kill-after=20 "$left" "$PY" -m bench bench "${COMMON[@]}" --modes compile \
      --images-per-call "$b" --steps 8 --runs 2 --time-budget $((left - 30)) --out "$BATCH_DIR/b$b" "$@" \
      2>&1 | tee "$BATCH_DIR/b$b.log"
  done
  "$PY" - "$BATCH_DIR" <<'PYEOF' | tee "$BATCH_DIR/sweep.md"
import json, pathlib, sys
rows, base = [], None
for path in sorted(pathlib.Path(sys.argv[1]).glob("b*/bench.json"), key=lambda p: int(p.parent.name[1:])):
    report = json.loads(path.read_text())
    n = report["extras"].get("images_per_call", 1)
    for r in report["results"]:
        if r.get("error") or not r.get("step_ms_median"):
            continue
        per_image = r["step_ms_median"] / n
        base = base or per_image
        rows.append(f"| {n} | {r['step_ms_median']:.1f} | {per_image:.1f} | {base / per_image:.2f} | "
                    f"{(r.get('peak_memory_bytes') or 0) / 2**30:.1f} |")
print("| images per call | step ms | step ms per image | gain per image vs 1 | peak GiB |\n|---|---|---|---|---|")
print("\n".join(rows))
PYEOF
  exit 0
fi

if [ "${1:-}" = memory ]; then
  shift
  MEM_DIR="${OUT:-artifacts}/bench-gpu-memory"
  mkdir -p "$MEM_DIR"
  # Each lever builds the 11.9 B-parameter transformer again (on the GPU, or in pinned host RAM for the
  # offloads: about 24 GB) and times one 28-step image; at most 300 s in all.
  timeout --signal=INT --kill-after=20 300 "$PY" -m bench memory-bench --gpu flux1-dev --device cuda \
    --gpu-steps 28 --json "$@" > "$MEM_DIR/memory.json" 2> "$MEM_DIR/memory.log"
  rc=$?
  cat "$MEM_DIR/memory.json"
  echo "memory levers exited $rc (124/130 = stopped by the time limit)"
  exit "$rc"
fi

if [ "${1:-}" = levers ]; then
  shift
  LEV_DIR="${OUT:-artifacts}/bench-gpu-levers"
  mkdir -p "$LEV_DIR/quant" "$LEV_DIR/caches"
  # Quantized precisions on the full-size transformer (random weights: speed, not quality); fp8 needs sm_89+.
  timeout --signal=INT --kill-after=20 330 "$PY" -m bench bench "${COMMON[@]}" --precisions bf16,int8wo,int8dq,fp8 \
    --modes eager,compile --time-budget 250 --out "$LEV_DIR/quant" "$@" 2>&1 | tee "$LEV_DIR/quant/bench.log"
  rc=${PIPESTATUS[0]}
  # Step caches x precisions on the trained tiny-shapes pipeline: every offered combination, with drift and
  # fidelity; its per-image times are launch-bound on a GPU, so its speed-ups say little about a real model.
  timeout --signal=INT --kill-after=20 180 "$PY" -m bench bench --preset tiny-shapes --device cuda \
    --caches none,first-block:0.2,taylorseer:3:2,magcache,faster-cache,pyramid --precisions fp32,bf16,int8wo,fp8 \
    --modes eager,regional --steps 20 --runs 3 --quality-samples 16 --cache-dir /tmp/showcase-cache --no-progress \
    --out "$LEV_DIR/caches" 2>&1 | tee "$LEV_DIR/caches/bench.log"
  echo "levers: quantized bench exited $rc, cache bench exited ${PIPESTATUS[0]}"
  exit "$rc"
fi

# Main run: hard limit 390 s; no mode starts after 270 s; every finished mode is written to bench.json as
# soon as it is measured. cuda-graphs comes right after compile (same compile plus CUDA graph capture);
# max-autotune, the most expensive compile, last.
timeout --signal=INT --kill-after=20 390 "$PY" -m bench bench "${COMMON[@]}" \
  --modes eager,compile,cuda-graphs,regional,max-autotune --matmul-roofline --time-budget 270 \
  --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/bench.log"
rc=${PIPESTATUS[0]}
echo "bench exited $rc (124/130 = stopped by the time limit; bench.json holds the modes that finished)"

# FA3 row: which FA3 backend can run here (kernels package + Hub download, or an FA3 build), else why not.
FA3_DIR="${OUT:-artifacts}/bench-gpu-fa3"
mkdir -p "$FA3_DIR"
"$PY" -m engine attention --device cuda --precision bf16 --json > "$FA3_DIR/attention.json" 2> "$FA3_DIR/attention.err"
FA3=$("$PY" - "$FA3_DIR/attention.json" <<'PYEOF'
import json, sys
rows = {r["name"]: r for r in json.load(open(sys.argv[1]))["backends"]}
usable = [n for n in ("_flash_3_hub", "_flash_3") if rows.get(n, {}).get("usable")]
print(usable[0] if usable else "")
for n in ("_flash_3_hub", "_flash_3"):
    print(f"{n}: {'usable' if rows.get(n, {}).get('usable') else rows.get(n, {}).get('reason')}", file=sys.stderr)
PYEOF
)
if [ -n "$FA3" ]; then
  timeout --signal=INT --kill-after=20 150 "$PY" -m bench bench "${COMMON[@]}" --modes compile \
    --attention-backend "$FA3" --time-budget 60 --out "$FA3_DIR" 2>&1 | tee "$FA3_DIR/bench.log"
  echo "FA3 ($FA3) bench exited ${PIPESTATUS[0]}"
else
  echo "FA3 row skipped: no FA3 attention backend can run here (reasons in $FA3_DIR/attention.json)" \
    | tee "$FA3_DIR/skipped.txt"
fi
exit "$rc"
