"""The images the /v1 API's "url" answers point at: PNG files under unguessable names in a folder of this
app's own (under its cache folder, `--cache-dir`, where one is given), the oldest deleted first."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

FILES_KEPT = 256  # images a "url" answer may point at (the oldest are deleted first)


class OutputStore:
    """The images a "url" answer points at: PNG files under unguessable names in a folder of this app's own,
    the last FILES_KEPT kept."""

    def __init__(self, kept: int = FILES_KEPT, under: Path | None = None):
        self.kept, self.under = kept, under  # where the folder is made (None: the system temp)
        self.folder: Path | None = None
        self._files: OrderedDict[str, Path] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, png: bytes) -> str:
        name = f"{secrets.token_urlsafe(18)}.png"
        with self._lock:
            if self.folder is None:
                self.folder = Path(tempfile.mkdtemp(prefix="showcase-v1-", dir=self._under()))
            path = self.folder / name
            path.write_bytes(png)
            self._files[name] = path
            while len(self._files) > self.kept:
                _, old = self._files.popitem(last=False)
                old.unlink(missing_ok=True)
        return name

    def _under(self) -> Path | None:
        if self.under is None:
            return None
        try:
            self.under.mkdir(parents=True, exist_ok=True)
            return self.under
        except OSError:  # a read-only cache folder: the system temp, as before
            return None

    def get(self, name: str) -> bytes | None:
        with self._lock:
            path = self._files.get(name)
        try:
            return path.read_bytes() if path is not None else None
        except OSError:
            return None

    def close(self) -> None:
        with self._lock:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
                self.folder = None
            self._files.clear()
