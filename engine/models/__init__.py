"""Layer 2, models: the weights the engine serves when no Hub model is named, and how weights are read.

    tiny.py             the random-weight tiny diffusers pipelines, built locally (presets "random:<name>")
                        (`python -m engine.models.tiny NAME OUT_DIR` builds one in a fresh process)
    tiny_builders.py    their text encoders, VAEs and pipelines, seeded
    tiny_tokenizers.py  their tokenizers, trained deterministically on a fixed corpus
    weights.py          safetensors headers read and checked without loading a tensor

May import: the contract (engine/protocol/, errors.py, metrics.py, settings.py), this folder and
engine/devices/. Never the layers above (config, pipeline, worker, tp, fleet, serving).

Goes here: a new bundled, random-weight or test model, a new way of reading or checking weight files. Quantized
weights are made by the pipeline layer (a lever of the runner), not here. How the embedded model was trained
(its toy world, the checker, the training loops) is the training package (training/), outside the engine:
serving loads the committed folder models/tiny-shapes like any diffusers folder (its tokenizers included) and
needs none of it.
"""
