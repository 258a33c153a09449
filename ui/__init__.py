"""Gradio Blocks UI on the engine's client protocol (EngineManager); engine/ never imports this."""

from ui.blocks import build_demo, launch_kwargs
from ui.handlers import Handlers, UIDefaults

__all__ = ["Handlers", "UIDefaults", "build_demo", "launch_kwargs"]
