"""Build hook: a wheel carries the data the app reads (presets/*.toml, models/tiny-shapes) inside the engine
package, under engine/_data, where engine.settings.data_path() finds them. In a checkout (and an editable
install) they stay at the repository root. Everything else is declared in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# folder (relative to the repository root) -> files of it to ship
BUNDLED = {"presets": "*.toml", "models/tiny-shapes": "**/*", "models/tiny-shapes-edit": "**/*",
           "models/tiny-shapes-loras": "**/*"}


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout itself
        for folder, pattern in BUNDLED.items():
            for src in sorted((ROOT / folder).glob(pattern)):
                if src.is_file():
                    dest = Path(self.build_lib, "engine", "_data", src.relative_to(ROOT))
                    self.mkpath(str(dest.parent))
                    self.copy_file(str(src), str(dest))


setup(cmdclass={"build_py": BuildPyWithData})
