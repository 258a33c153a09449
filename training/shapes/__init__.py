"""A toy text-to-image world that a tiny model can learn and a few lines of numpy can grade.

Prompts follow one exact grammar, `a {colour} {shape} on a {background} background`; the renderer draws
the ground truth for any prompt, the fidelity checker reads colour, shape and background back from pixels,
and `train` teaches the embedded FluxPipeline (models/tiny-shapes) to draw them. Together they make the
embedded default model's output checkable by a test instead of by eye.
"""
