"""Every tab's handlers on one object: what build_demo wires and what the tests call.

Each tab's handlers live with the tab (ui/generate.py, ui/generate_video.py: Generate's and the clip's, ui/buckets.py,
ui/compare.py, ui/system.py)
on the shared HandlerBase (ui/common.py), so a tab is built and tested alone with its own class.
"""

from __future__ import annotations

from ui.advisor import AdvisorHandlers
from ui.buckets import BucketsHandlers
from ui.common import UIDefaults
from ui.compare import CompareHandlers
from ui.generate_video import VideoHandlers
from ui.system import SystemHandlers

__all__ = ["Handlers", "UIDefaults"]


class Handlers(VideoHandlers, BucketsHandlers, CompareHandlers, AdvisorHandlers, SystemHandlers):
    """Handlers(serving, defaults): one serving interface, one set of lookups and runs for every tab."""
