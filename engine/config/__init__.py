"""Layer 4, config: what a user asks for, turned into checked data before anything is loaded.

    request.py      ImageRequest: one image request as every edge builds it; FORM, its one field table
    flags.py        the engine flags, defined once for the CLI, app.py and the bench
    presets.py      model and resolution presets (presets/*.toml) and routing a size to its bucket
    resolve.py      Catalog: (preset, device, precision, tp) -> EngineKey and EngineConfig
    validation.py   every user-facing input checked, with a message that says what to change;
                    build_request: an ImageRequest validated into the worker's GenerateRequest
    caches.py       the persistent cache folder: prepared, its compile caches switched or cleaned

Nothing here starts a process or builds a pipeline; importing it imports no torch (the caches helpers
import it when they run).

May import: the contract (engine/protocol/, errors.py, metrics.py, settings.py), this folder,
engine/devices/, engine/models/ and engine/families/. Never pipeline, worker, tp, serving or bench.

Goes here: a new preset field or flag, a new check of user input, a new rule for resolving a model
reference. The behaviour a flag switches on lives in the layer that runs it (a step cache or
quantization recipe in engine/pipeline/, a hosting limit in engine/serving/).
"""
