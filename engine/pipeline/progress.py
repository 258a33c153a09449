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
