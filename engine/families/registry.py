"""The family registry: every module of engine/families/ registers its records on import; the engine looks a
pipeline class up here (by model_index.json's `_class_name` or a preset's `pipeline`)."""

from __future__ import annotations

import importlib
import pkgutil

from engine.families.family import PipelineFamily

_FRAMEWORK = frozenset({"family", "registry"})  # this folder's modules that declare no family
_FAMILIES: dict[str, PipelineFamily] = {}
_discovered = False


def register(*records: PipelineFamily) -> tuple[PipelineFamily, ...]:
    """Add a module's families (a class is declared once); returns them, so a module can name its records."""
    for record in records:
        if record.pipeline in _FAMILIES and _FAMILIES[record.pipeline] != record:
            raise ValueError(f"pipeline class {record.pipeline} is declared twice (engine/families/)")
        _FAMILIES[record.pipeline] = record
    return records


def _discover() -> None:
    """Import every family module of this folder once: a new family is one new module."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    import engine.families as package

    for module in pkgutil.iter_modules(package.__path__):
        if module.name not in _FRAMEWORK and not module.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{module.name}")


def families() -> tuple[PipelineFamily, ...]:
    """Every registered family, in the order the modules declared them."""
    _discover()
    return tuple(_FAMILIES.values())


def find(pipeline: str) -> PipelineFamily | None:
    """The family of a pipeline class name, or None where none is registered."""
    _discover()
    return _FAMILIES.get(pipeline)

