"""Each page's handlers (PageHandlers: what build_demo wires) and all of them on one object (Handlers: what
tests call).

Each tab's handlers live with the tab (ui/generate.py, ui/generate_video.py: Generate's and the clip's, ui/buckets.py,
ui/compare.py, ui/system.py)
on the shared HandlerBase (ui/common.py), so a tab is built and tested alone with its own class.
"""

from __future__ import annotations

from typing import NamedTuple

from ui.advisor import AdvisorHandlers
from ui.buckets import BucketsHandlers
from ui.common import HandlerBase, UIDefaults, UIState
from ui.compare import CompareHandlers
from ui.generate_video import VideoHandlers
from ui.system import SystemHandlers

__all__ = ["PAGE_KINDS", "Handlers", "PageHandlers", "UIDefaults", "UIState"]


class PageHandlers(NamedTuple):
    """Each page's own handlers (build_demo): a page is handed its own alone. `shared`: /cancel, /v1 and
    /metrics, which need no page's handlers."""

    generate: VideoHandlers  # the Generate page and the clip tab
    buckets: BucketsHandlers
    compare: CompareHandlers
    advisor: AdvisorHandlers
    system: SystemHandlers
    shared: HandlerBase


PAGE_KINDS = (VideoHandlers, BucketsHandlers, CompareHandlers, AdvisorHandlers, SystemHandlers, HandlerBase)


class Handlers(VideoHandlers, BucketsHandlers, CompareHandlers, AdvisorHandlers, SystemHandlers):
    """Every page's handlers on one object, for tests that drive several tabs on one serving interface."""
