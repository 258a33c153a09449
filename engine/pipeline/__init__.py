"""Layer 5, pipeline: one diffusers pipeline on one device, and every lever that changes how it runs.

    runner.py       PipelineRunner: the facade over the parts below (what the worker, a TP rank and the
                    in-process runtime call): modes, load, one request, a batch, warm-up, footprint
    loading.py      the weights loaded once per (model, device, precision), load-time recipes applied
    modes.py        one pipeline per mode over those weights (VariantSet), compiled lazily per shape
    calls.py        one pipeline call on a private copy of a variant, timed step by step, cancellable
    batchrun.py     requests sharing one call, each answered on its own (BatchRun)
    warmup.py       compiling and warming a bucket, the compile caches' recovery, the start-up list
    board.py        the bucket board (thread-safe states, pushed to a listener) and a failure's one line
    clock.py        a run's clock, the graphs a thread compiled, the compile caches' hits and misses
    footprint.py    what an engine holds: weights, measured peak, resident memory
    png.py          a result's image as PNG, its generation parameters inside
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

May import: the contract (engine/protocol/, errors.py, metrics.py, settings.py), this folder,
engine/devices/, engine/models/, engine/families/ and engine/config/. Never worker, tp, serving or bench.

Goes here: every lever on how one pipeline computes an image: a new step cache, quantization, a new
recipe or attention backend, the batching rule, a compile or export mode. Context parallel goes here
as far as one pipeline's attention is concerned (the backend's capability in attention.py); launching
and coordinating its ranks belongs to engine/tp/.
"""
