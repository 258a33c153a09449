"""Progress bars for long commands (bench, export): tqdm on stderr, so stdout carries the answer."""

from __future__ import annotations

import sys


class NullBar:
    """What a disabled bar is: every call does nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool, desc: str, unit: str = "step"):
    if not enabled:
        return NullBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return NullBar()
    return tqdm(total=total, file=sys.stderr, desc=desc, unit=unit, dynamic_ncols=True, leave=True)


def quiet_library_consoles() -> None:
    """diffusers' and transformers' own console in an engine: no load progress bars (the app says what it
    loads; tqdm's redrawn lines are noise in a server's log), and with the JSON log format their log lines
    go through the process's handler instead of their own plain-text one."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    from engine import settings

    for library in (diffusers_logging, transformers_logging):
        library.disable_progress_bar()
        if settings.log_format().strip().lower() == "json":
            library.disable_default_handler()
            library.enable_propagation()
