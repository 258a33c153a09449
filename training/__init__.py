"""Training: how the embedded model (models/tiny-shapes) and its LoRA styles were made, reproducible.

    shapes/             the toy world the embedded model learns: the prompt grammar and renderer
                        (grammar.py), the pixel fidelity checker (fidelity.py) and the styles' checks
                        (styles.py), the named seeds (samples.py), the semantic latents, the training loops
                        (train.py, training.py, sampling.py, lora_train.py) and the held-out evaluation
    train_embedded.py   `python -m training.train_embedded`: retrain models/tiny-shapes
    train_loras.py      `python -m training.train_loras`: retrain models/tiny-shapes-loras
    train_edit.py       `python -m training.train_edit`: retrain models/tiny-shapes-edit (FLUX.1 Kontext form;
                        edit grammar shapes/edits.py, checker shapes/edit_fidelity.py, its VAE encoder
                        shapes/edit_encoder.py, loop shapes/edit_train.py)
    evaluate_edit.py    `python -m training.evaluate_edit`: its held-out accuracy and the img2img baseline

Outside the engine: serving loads the committed folders like any diffusers pipeline and LoRA files and never
imports this package. It may import the engine (its tiny builders, weights readers, metrics); the engine
never imports it. The bench scores images with the checker here (bench/quality.py), and the UI's Compare tab
through the bench; nothing here imports the bench.
"""
