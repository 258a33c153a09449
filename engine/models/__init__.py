"""Layer 2, models: the weights the engine serves when no Hub model is named, and how weights are read.

    tiny.py             the random-weight tiny diffusers pipelines, built locally (presets "random:<name>")
                        (`python -m engine.models.tiny NAME OUT_DIR` builds one in a fresh process)
    tiny_builders.py    their text encoders, VAEs and pipelines, seeded
    tiny_tokenizers.py  their tokenizers, trained deterministically on a fixed corpus
    shapes/             the toy world of the trained embedded model (models/tiny-shapes): the prompt
                        grammar, the renderer, the pixel fidelity checker and the training loop
    train_embedded.py   `python -m engine.models.train_embedded`: retrain models/tiny-shapes
    weights.py          safetensors headers read and checked without loading a tensor

May import: the contract (engine/protocol/, errors.py, metrics.py, settings.py), this folder and
engine/devices/. Never the layers above (config, pipeline, worker, tp, serving, bench).

Goes here: a new bundled, random-weight or test model, a new way of reading or checking weight files. Quantized
weights are made by the pipeline layer (a lever of the runner), not here.
"""
