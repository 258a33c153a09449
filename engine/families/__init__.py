"""Layer 3, families: what each diffusers pipeline family is, declared once, and the registry that holds them.

    family.py       PipelineFamily: one frozen record per pipeline class (task, inputs, bucket family, denoiser,
                    call adapter, preview unpacking, decode, published sizes, context-parallel sequences,
                    defaults, tiny build); CallArguments, the declared call adapter most families use
    registry.py     the registry: `register` (called by each family module), `find` by class name,
                    `families()`; it discovers every module of this folder on first use
    flux.py, flux_kontext.py, flux_variants.py, flux2.py, qwen_edit.py, sd3.py, sdxl.py, sd.py, wan.py, ltx.py
                    one module per family

Every other module asks the registry what a pipeline class is; no other source file outside this folder and
engine/models/ names a pipeline class (tests/test_families.py greps for them). Nothing here imports torch.

May import: the contract (engine/protocol/, errors.py, metrics.py, settings.py), this folder, engine/devices/
and engine/models/. Never config, pipeline, worker, tp, fleet or serving.

Goes here: a new pipeline family (one module calling `register`, plus its preset rows in presets/models.toml
and its tests).
"""
