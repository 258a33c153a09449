"""Layer 4, pipeline: one diffusers pipeline on one device, and every lever that changes how it runs.

    runner.py       PipelineRunner: load once per (model, device, precision), one variant per mode,
                    per-bucket compiled graphs, warm-up, timed runs, batched calls
    variants.py     pipelines over the loaded pipeline's components (mode, step-cache and aot variants)
                    and the per-run copy
    recipes.py      the optimisation recipes, one named step each, driven by EngineOptions
    attention.py    diffusers attention backends: which can run here, and why not
    stepcache.py    diffusers step caches: which can run for a preset, device and mode, and their hooks
    batching.py     which queued requests share one pipeline call (Gatherer, used by the worker loop)
    aot.py          mode `aot`: one AOTInductor package per bucket, on the engine's own weights
    aot_hub.py      aot packages pushed to and pulled from the Hugging Face Hub
    faults.py       test-only hooks (EngineOptions.testing), read in one place: what the runner, the worker
                    loop and a TP rank ask where each fault can happen
    progress.py     progress bars for long commands (bench, export)

Nothing here knows about processes, queues of clients or hosting: a runner is called, and answers.

May import: the contract (engine/protocol.py, errors.py, metrics.py, settings.py), this folder,
engine/devices/, engine/models/ and engine/config/. Never worker, tp, serving or bench.

Goes here: every lever on how one pipeline computes an image: a new step cache, quantization, a new
recipe or attention backend, the batching rule, a compile or export mode. Context parallel goes here
as far as one pipeline's attention is concerned (the backend's capability in attention.py); launching
and coordinating its ranks belongs to engine/tp/.
"""
