"""Gradio Blocks UI on the engine's serving interface (engine/serving/interface.py); engine/ never imports this."""

from ui.blocks import build_demo, launch_kwargs
from ui.handlers import Handlers, UIDefaults

__all__ = ["Handlers", "UIDefaults", "build_demo", "launch_kwargs"]
