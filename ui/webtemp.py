"""Gradio's temporary folder under the app's cache folder, so nothing a visitor does writes anywhere else.

Gradio writes what it serves (each output image, copied into its cache) and, for its deep links, each
session's components to its temporary folder: by default the system temp's `gradio/`, shared by every Gradio
app on the machine, never cleaned, and served whole by `/file=`. This app's is `<cache>/web/<pid>`: its
own, served alone (ui/edge.py refuses `/file=` outside it), bounded (files older than MAX_AGE_S go, and
the oldest while it holds more than MAX_BYTES, checked at most every TIDY_EVERY_S as outputs are written),
removed at shutdown, and swept by the next start when the process was killed. Deep links are refused at the
edge (the app offers none), so no session's state is ever written.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from engine.processes import pid_alive

FOLDER = "web"  # under the cache folder
MAX_AGE_S = 3600.0  # an output a page shows is fetched within seconds; an hour leaves room for a slow reader
MAX_BYTES = 1 << 30  # 1 GiB of outputs: ~10,000 1024x1024 PNGs
TIDY_EVERY_S = 30.0

_owned: Path | None = None  # the folder use_cache_folder made: the only one ever tidied
_tidy_lock = threading.Lock()
_tidied_at = 0.0


def use_cache_folder(cache_dir: Path | str) -> Path:
    """Point Gradio's temporary folder at `<cache_dir>/web/<pid>` (before the app is built: components and
    routes read it then), after removing the folders of processes that are gone."""
    root = Path(cache_dir) / FOLDER
    for old in root.glob("*") if root.is_dir() else ():
        if old.name.isdigit() and not pid_alive(int(old.name)) and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    folder = root / str(os.getpid())
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["GRADIO_TEMP_DIR"] = str(folder)  # what gradio.utils.get_upload_folder() returns from now on
    global _owned
    _owned = folder
    for name in ("gradio.mcp", "gradio.route_utils", "gradio.routes", "gradio.screen_recording_utils"):
        module = sys.modules.get(name)
        if module is not None:  # read once when it was imported (routes makes vibe_edit_history/ there)
            module.DEFAULT_TEMP_DIR = str(folder)
    return folder


def remove(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def save_output(data: bytes, folder: str, suffix: str = ".png") -> str:
    """Write an output where Gradio serves it from (its temporary folder, `folder`: so it is served as is, not
    copied) and return its path; the folder is tidied first when that is due."""
    os.makedirs(folder, exist_ok=True)
    if _owned is not None and Path(folder) == _owned:
        tidy(_owned)
    fd, path = tempfile.mkstemp(prefix="showcase-", suffix=suffix, dir=folder)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    return path


def tidy(folder: Path, max_age_s: float = MAX_AGE_S, max_bytes: int = MAX_BYTES, force: bool = False) -> int:
    """Remove the folder's files older than `max_age_s`, then the oldest while they hold more than `max_bytes`
    (at most every TIDY_EVERY_S unless `force`). Returns the bytes kept."""
    global _tidied_at
    with _tidy_lock:
        now = time.time()
        if not force and time.monotonic() - _tidied_at < TIDY_EVERY_S:
            return -1
        _tidied_at = time.monotonic()
        files = []
        for root, _, names in os.walk(folder):
            for name in names:
                path = os.path.join(root, name)
                try:
                    stat = os.lstat(path)
                except OSError:
                    continue
                files.append((stat.st_mtime, stat.st_size, path))
        files.sort()
        kept = sum(size for _, size, _ in files)
        for mtime, size, path in files:
            if now - mtime <= max_age_s and kept <= max_bytes:
                break
            try:
                os.unlink(path)
                kept -= size
            except OSError:
                pass
        return kept


# Gradio's upload route (input images) writes into the same folder: each visitor's uploads are bounded in count
# and bytes, the oldest of theirs going first, and the reaper (start_reaper) tidies the folder on its own schedule.
UPLOAD_FILES = 32  # per visitor: two requests' worth of images (engine/config/images.py MAX_IMAGES)
UPLOAD_SHARE_BYTES = 128 * 2**20  # per visitor: two requests' worth of bytes (MAX_UPLOADS_BYTES)
VISITORS = 4096  # visitors whose uploads are tracked; past it the oldest visitor's files go


class UploadShares:
    """Which visitor uploaded which file (path -> size, oldest first), bounded per visitor."""

    def __init__(self, files: int = UPLOAD_FILES, share_bytes: int = UPLOAD_SHARE_BYTES):
        self.files, self.share_bytes = files, share_bytes
        self._lock = threading.Lock()
        self._of: dict[str, dict[str, int]] = {}
        self._pending: list[str] = []  # removed from the counts, not yet from disk
        self.removed = 0

    def record(self, client: str, paths) -> None:
        """`paths` were just uploaded by `client`: counted, and the visitor's oldest removed past the bounds."""
        gone = []
        with self._lock:
            mine = self._of.pop(client, {})
            self._of[client] = mine  # most recently active last
            for path in paths:
                try:
                    mine[str(path)] = os.path.getsize(path)
                except OSError:  # not moved into place yet (Gradio may finish that after answering): counted
                    mine[str(path)] = 0
            while mine and (len(mine) > self.files or sum(mine.values()) > self.share_bytes):
                path = next(iter(mine))
                del mine[path]
                gone.append(path)
            while len(self._of) > VISITORS:
                oldest = self._of.pop(next(iter(self._of)))
                gone.extend(oldest)
            gone += self._pending
            self._pending = []
        for path in gone:
            if _remove_upload(path):
                self.removed += 1
            elif len(self._pending) < 4 * self.files:
                self._pending.append(path)  # retried with the next upload

    def held(self, client: str) -> tuple[int, int]:
        """(files, bytes) `client`'s uploads hold now (files removed since are forgotten)."""
        with self._lock:
            mine = self._of.get(client, {})
            for path in [p for p in mine if not os.path.exists(p)]:
                del mine[path]
            return len(mine), sum(mine.values())


def _remove_upload(path: str) -> bool:
    """An upload and its folder (Gradio writes each into a folder named by its hash); False when not there yet."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass
    return True


def start_reaper(folder: Path, every_s: float = TIDY_EVERY_S) -> threading.Thread:
    """Tidy `folder` every `every_s` whether or not outputs are saved (uploads arrive without them)."""
    def reap():
        while folder.is_dir():
            tidy(folder, force=True)
            time.sleep(every_s)

    thread = threading.Thread(target=reap, name="webtemp-reaper", daemon=True)
    thread.start()
    return thread
