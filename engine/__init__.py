"""Diffusion Showcase engine: pipelines compiled and warm per resolution bucket, on any device.

Never imports gradio (the UI lives in ui/).
"""

__version__ = "0.1.0"
