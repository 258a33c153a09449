"""Caches where the README says, a full cache disk that costs no bucket, and no server path for visitors.

- Every worker gets its compile folder from the engine's settings (`--cache-dir`), never torch's default
  folder that importing diffusers writes into the web process's environment; a folder the user exported
  is still theirs.
- A cache disk that is full or read-only is recognised whatever tool failed: an errno, a compiler's
  printed error (g++ writing its precompiled header has no errno), or the disk's free space; the compile
  moves to a temporary cache on a disk with room, and the notice names the condition, never a path.
- Compile failures read by visitors carry no command line and no server path.
The end-to-end checks (three engines, a real 20 MiB tmpfs) are marked slow.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest
from helpers import engine_manager, torch_configs_restored, wait_until

from engine import devices
from engine.config import caches
from engine.devices.environment import PRECOMPILED_HEADERS
from engine.errors import scrub_paths
from engine.protocol import BucketKey, BucketState, Mode, Size

REPO = Path(__file__).resolve().parent.parent
Usage = namedtuple("Usage", "total used free")


def torch_default_folder() -> str:
    """What `import diffusers` leaves in os.environ when TORCHINDUCTOR_CACHE_DIR was unset: torch's cache_dir()
    (called by torch._dynamo at import) writes its default folder there."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


# -- which folder a worker gets ----------------------------------------------------------------------------
def test_a_worker_never_inherits_torchs_default_inductor_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "system-tmp"))
    (tmp_path / "system-tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    inherited = torch_default_folder()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == inherited and "torchinductor_" in inherited
    env = devices.worker_environment(devices.get_device("cpu"), tmp_path / "cache")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert env["TMPDIR"] == str(tmp_path / "cache" / "tmp")
    # A folder the user chose is theirs (the bench and the tests point fresh processes at folders of their own).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert devices.worker_environment(devices.get_device("cpu"), tmp_path / "cache")["TORCHINDUCTOR_CACHE_DIR"] \
        == str(tmp_path / "mine")


def test_the_in_process_runtime_replaces_torchs_default_folder_too(tmp_path, monkeypatch):
    import torch._inductor.codecache as codecache

    for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR"):
        monkeypatch.setattr(codecache, name, getattr(codecache, name))
    monkeypatch.setenv("TMPDIR", os.environ.get("TMPDIR", tempfile.gettempdir()))  # restored after
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    torch_default_folder()
    in_force = devices.apply_environment(devices.get_device("cpu"), tmp_path / "cache")
    assert in_force["TORCHINDUCTOR_CACHE_DIR"] == os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    folders = devices.folders_in_force(devices.get_device("cpu"))
    assert all(Path(f).resolve().is_relative_to((tmp_path / "cache").resolve()) for f in folders.values()), folders



_REPORT_BEFORE_AND_AFTER_THE_CODECACHE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from engine import devices
    cpu = devices.get_device("cpu")
    from engine.devices.environment import contain_temporary_files
    contain_temporary_files(Path(sys.argv[1]), sys.argv[1] + "/inductor")
    before = devices.folders_in_force(cpu)
    assert "torch._inductor.codecache" not in sys.modules
    import torch._inductor.codecache  # what a first compile imports
    print(json.dumps({"before": before, "after": devices.folders_in_force(cpu)}))
""")


def test_a_workers_folder_report_does_not_depend_on_what_was_imported(tmp_path):
    """The header folder is reported from the setting the process applies, before inductor's codecache is
    imported as after (it used to appear only after, so /system and a test depended on import timing)."""
    out = subprocess.run([sys.executable, "-c", _REPORT_BEFORE_AND_AFTER_THE_CODECACHE, str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    headers = {when: folders.get(PRECOMPILED_HEADERS) for when, folders in report.items()}
    assert headers["before"] == headers["after"] == str(tmp_path / "inductor" / "precompiled_headers"), report

# -- a full or read-only cache disk -------------------------------------------------------------------------
def _compile_error(cmd: list[str], output: str) -> RuntimeError:
    """A C++ compile error as dynamo raises it: wrapped, with the compiler's output and no errno."""
    from torch._inductor.exc import CppCompileError

    try:
        try:
            raise CppCompileError(cmd, output)
        except CppCompileError as inner:
            raise RuntimeError("backend='inductor' raised:\nCppCompileError: C++ compile error") from inner
    except RuntimeError as outer:
        return outer


GXX_FULL = _compile_error(
    ["g++", "/srv/showcase/cache/inductor/ab/cabc.cpp", "-o", "/srv/showcase/cache/inductor/ab/cabc.so"],
    "/srv/showcase/cache/inductor/precompiled_headers/abc.h.gch: fatal error: cannot write PCH file: "
    "No space left on device\ncompilation terminated.")


def test_a_compiler_that_prints_no_space_left_is_a_full_disk():
    found = caches.unwritable_cause(GXX_FULL)
    assert found is not None and found.condition == caches.FULL


def test_any_failure_on_a_disk_without_room_is_a_full_disk(tmp_path, monkeypatch):
    """The error says nothing about space (a tool that died, a truncated file): the free space tells."""
    real = shutil.disk_usage
    full = tmp_path / "cache"
    full.mkdir()

    def disk_usage(path):
        return Usage(20 * 2**20, 20 * 2**20 - 4096, 4096) if Path(path) == full else real(path)

    monkeypatch.setattr(caches.shutil, "disk_usage", disk_usage)
    error = RuntimeError("ld returned 1 exit status")
    assert caches.unwritable_cause(error, (full / "inductor",)).condition == caches.FULL  # not created yet
    assert caches.unwritable_cause(error, (tmp_path / "elsewhere",)) is None  # a real compile error stays one
    assert caches.unwritable_cause(error) is None


def test_the_notice_names_the_condition_and_no_path():
    notice = caches.unwritable_cause(GXX_FULL, ()).notice
    assert notice.startswith("the compile cache disk is full: compiling in a temporary cache"), notice
    assert scrub_paths(notice) == notice and "g++" not in notice


def test_the_temporary_cache_goes_to_a_disk_with_room(tmp_path, monkeypatch):
    import torch._inductor.codecache as codecache

    full, roomy = tmp_path / "full-disk", tmp_path / "roomy-disk"
    full.mkdir()
    roomy.mkdir()
    real = shutil.disk_usage
    monkeypatch.setattr(caches.shutil, "disk_usage",
                        lambda p: Usage(2**30, 2**30, 0) if Path(p) == full else real(p))
    monkeypatch.setattr(caches, "TEMPORARY_BASES", (str(full), str(roomy)))
    # Process-wide state the switch changes; restored after the test.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ["TORCHINDUCTOR_CACHE_DIR"])
    monkeypatch.setenv("TMPDIR", os.environ.get("TMPDIR", tempfile.gettempdir()))
    monkeypatch.setattr(tempfile, "tempdir", None)
    for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR"):
        monkeypatch.setattr(codecache, name, getattr(codecache, name))
    with torch_configs_restored():
        folder, notice = caches.switch_to_temporary_compile_cache(caches.unwritable_cause(GXX_FULL))
        assert folder.parent == roomy
        assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(folder)
        assert Path(tempfile.gettempdir()).is_relative_to(folder)  # the compilers' scratch files too
        assert Path(codecache._HEADER_DIR).is_relative_to(folder)
        assert not caches.compile_caches_enabled()
    assert "disk is full" in notice


def test_no_temporary_disk_with_room_is_an_error_not_a_loop(tmp_path, monkeypatch):
    monkeypatch.setattr(caches.shutil, "disk_usage", lambda p: Usage(2**30, 2**30, 0))
    monkeypatch.setattr(caches, "TEMPORARY_BASES", (str(tmp_path),))
    with pytest.raises(OSError, match="no temporary folder with room"):
        caches.switch_to_temporary_compile_cache(caches.unwritable_cause(GXX_FULL))


# -- what visitors read -------------------------------------------------------------------------------------
def test_a_compile_failure_reads_without_command_line_or_path():
    from engine.pipeline.runner import describe_failure

    text = describe_failure(GXX_FULL)
    assert "No space left on device" in text and "C++ compiler failed" in text, text
    assert "/srv/showcase" not in text and "-o " not in text and scrub_paths(text) == text, text
    other = describe_failure(ImportError("/srv/showcase/cache/inductor/ab/x.so: file too short"))
    assert other.startswith("ImportError: <path>") and "file too short" in other and "/srv" not in other, other


def test_a_cache_folder_that_cannot_be_written_says_so_without_its_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cache = caches.prepare_cache_dir(blocker / "cache")
    assert not cache.persistent
    notice = cache.notices[0]
    assert "not writable" in notice and str(tmp_path) not in notice and scrub_paths(notice) == notice
    shutil.rmtree(cache.path, ignore_errors=True)


def test_temporary_compile_caches_are_removed_at_shutdown_and_after_a_kill(tmp_path, monkeypatch):
    """Issue 37: with an unwritable cache folder the fallback (and what workers compiled into it, 151 MB after a
    30 s run) stayed in the system temp folder after shutdown. The manager removes it at shutdown, and the
    folders a killed process left (app or worker) are removed by the next one; a live process's stay."""
    import subprocess
    import sys

    from engine.serving.manager import EngineManager

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(caches, "TEMPORARY_BASES", (str(tmp_path),))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    left = [tmp_path / f"{caches.TEMP_CACHE_PREFIX}{dead_pid}-abc", tmp_path / f"{caches.TEMP_COMPILE_PREFIX}{dead_pid}-d"]
    live = tmp_path / f"{caches.TEMP_COMPILE_PREFIX}{os.getppid()}-e"
    for folder in (*left, live):
        (folder / "inductor").mkdir(parents=True)
        (folder / "inductor" / "graph.so").write_bytes(b"x" * 1000)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    manager = EngineManager(cache_dir=blocker / "cache")
    fallback = manager.cache_dir
    assert not manager.cache.persistent and fallback.parent == tmp_path
    assert fallback.name.startswith(f"{caches.TEMP_CACHE_PREFIX}{os.getpid()}-")
    assert not any(folder.exists() for folder in left)  # swept when the fallback was made
    (fallback / "inductor").mkdir()
    (fallback / "inductor" / "graph.so").write_bytes(b"x" * 1000)
    manager.shutdown()
    assert not fallback.exists()
    assert live.exists()


# -- end to end ---------------------------------------------------------------------------------------------
def _link_models(cache: Path, tiny_models, names) -> None:
    (cache / "models").mkdir(parents=True, exist_ok=True)
    for name in names:
        os.symlink(tiny_models[name], cache / "models" / name)


def _files(folder: Path) -> list[Path]:
    return [f for f in folder.rglob("*") if f.is_file()] if folder.exists() else []


@pytest.mark.slow  # three workers (each compiles, or loads what the session compiled)
@pytest.mark.timeout(1800)
def test_three_engines_compile_inside_the_cache_folder_after_diffusers_was_imported(tmp_path, cache_dir,
                                                                                     monkeypatch):
    """As in a running app: the web process has imported diffusers (TORCHINDUCTOR_CACHE_DIR is torch's default
    in its environment); the first engine and the ones started after it all compile under --cache-dir, and
    /system shows the folders each worker reported. --cache-dir is the session's: graphs other tests compile
    there are hits, graphs compiled here serve them, and a worker that looked elsewhere would compile again,
    into torch's default folder."""
    from ui.system import system_report

    system_tmp = tmp_path / "system-tmp"  # this process's temporary folder, as /tmp is the app's
    system_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(system_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    inherited = Path(torch_default_folder())
    assert inherited.parent == system_tmp
    cache = cache_dir
    # tf32 runs as fp32 on cpu: the third engine's graphs are in the cache the first one filled, so it finds
    # them only if it looks under --cache-dir (elsewhere it compiles again, into that folder)
    keys = [("tiny-flux", "fp32"), ("tiny-shapes", "fp32"), ("tiny-flux", "tf32")]
    bucket = BucketKey(Mode.REGIONAL, Size(64, 64))
    warmed = []
    # One thread each, as every test process has (tests/conftest.py): inductor writes the thread count into its
    # kernels, so these are the graphs tests/test_engine.py and tests/test_batching.py compile in the session's cache.
    with engine_manager(cache, max_engines=3) as manager:
        for preset, precision in keys:  # one after the other: each engine starts after the last one compiled
            manager.warm(preset, "cpu", precision, mode="regional", size="64x64")
            engine = manager.residency.engines()[-1]
            info = wait_until(lambda e=engine: next((b for b in e.buckets() if b.bucket == bucket
                                                     and b.state in (BucketState.WARM, BucketState.FAILED)), None),
                              1200, message=f"{engine.key} compiling {bucket}")
            assert info.state == BucketState.WARM, info.error
            warmed.append(info)
            print(f"{engine.key}: {bucket} warm, compile {info.compile_s:.1f} s, {info.cache_hits} cache hits, "
                  f"{info.cache_misses} misses")
        reported = {str(e.key): e.folders() for e in manager.residency.engines()}
        report = system_report(manager.serving(), [{"name": "cpu", "label": "CPU", "available": True}])
    outside = _files(inherited)
    print(f"3 engines: {len(outside)} files under the system temp folder's inductor cache")
    assert len(reported) == 3
    for key, folders in reported.items():
        assert folders["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor"), (key, folders)
        missing = {"TMPDIR", PRECOMPILED_HEADERS} - folders.keys()
        assert not missing, f"{key} reported no folder for {sorted(missing)}: {folders}"
        assert Path(folders["TMPDIR"]).is_relative_to(cache), (key, folders)
        assert Path(folders[PRECOMPILED_HEADERS]).is_relative_to(cache), (key, folders)
    assert not outside, outside[:5]
    # The third engine read what the first one left under --cache-dir: every graph a hit
    assert warmed[2].cache_hits > 0 and warmed[2].cache_misses == 0, warmed[2]
    rows = {row["folder"]: row["location"] for row in report["caches"]}
    assert any(label.startswith("inductor (in use by") and loc == str(cache / "inductor") for label, loc in rows.items())
    assert str(inherited) not in rows.values() and report["environment"]["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor")


_WARM_ON_A_SMALL_DISK = textwrap.dedent("""
    import json, sys
    from engine.config import caches
    from engine.config.presets import get_preset
    from engine.protocol import BucketKey, EngineConfig, EngineKey, EngineOptions, Mode, Size
    from engine.pipeline.runner import PipelineRunner

    caches.TEMPORARY_BASES = (sys.argv[2],)  # the fallback's folder: the test removes it
    config = EngineConfig(EngineKey("tiny-flux", "cpu", "fp32"), get_preset("tiny-flux"),
                          EngineOptions(warm_sizes=()), sys.argv[1])
    runner = PipelineRunner(config)
    runner.load()
    info = runner.warm_bucket(BucketKey(Mode.REGIONAL, Size(64, 64)))
    print("RESULT " + json.dumps({"state": info.state.value, "error": info.error, "origin": info.origin,
                                  "notices": runner.notices, "folders": dict(runner.folders())}))
""")


@pytest.fixture
def small_disk(tmp_path):
    """A real 20 MiB tmpfs (root only); skipped where it cannot be mounted."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow  # a compile in a fresh process (minutes on 2 shared, busy cores)
def test_a_full_cache_disk_moves_the_compile_to_a_temporary_cache(small_disk, tmp_path, tiny_models):
    cache = small_disk / "cache"
    _link_models(cache, tiny_models, ["tiny-flux"])
    spare = tmp_path / "spare"
    spare.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "SHOWCASE_CACHE_DIR")}
    env.update(PYTHONPATH=str(REPO), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _WARM_ON_A_SMALL_DISK, str(cache), str(spare)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(line[len("RESULT "):])
    print(f"20 MiB cache disk: {result['state']}, origin {result['origin']!r}")
    assert result["state"] == BucketState.WARM.value, result
    assert result["origin"] == "compiled in a temporary cache (the compile cache disk is full)", result
    notice = next(n for n in result["notices"] if "temporary cache" in n)
    assert notice.startswith("the compile cache disk is full") and scrub_paths(notice) == notice
    assert Path(result["folders"]["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(spare), result["folders"]


# -- where the app learns a worker's folders ----------------------------------------------------------------
class _MovingRunner:
    """A runner that computes nothing and whose compile finds the cache disk full (it moves its folders)."""

    def __init__(self, key):
        from types import SimpleNamespace

        from engine.pipeline.runner import BucketBoard

        self.spec = SimpleNamespace(host_memory_is_device_memory=False)
        self.config = SimpleNamespace(key=key)
        self.board = BucketBoard(key)
        self.max_batch, self.batch_sizes, self.measured_run = 1, (1,), None
        self.where = (("TORCHINDUCTOR_CACHE_DIR", "/cache/inductor"), ("TMPDIR", "/cache/tmp"))
        self.folders_notice = ""

    def folders(self):
        return self.where

    def warm_bucket(self, bucket):
        self.where = (("TORCHINDUCTOR_CACHE_DIR", "/tmp/showcase-inductor-x/inductor"),
                      ("TMPDIR", "/tmp/showcase-inductor-x/tmp"))
        self.folders_notice = caches.Unwritable(caches.FULL, "test").notice
        return self.board.update(bucket, state=BucketState.WARM, origin="compiled in a temporary cache")

    def footprint(self):
        return None

    def buckets_to_warm(self):
        return []

    def lora_info(self):
        return None


def test_the_app_shows_the_folders_the_worker_reports_before_and_after_a_move():
    import threading

    from engine.pipeline.faults import Faults
    from engine.protocol import EngineKey, EngineReady, Ready, Shutdown
    from engine.serving.inprocess import LocalConnection
    from engine.worker.client import ConnectionClient
    from engine.worker.loop import WorkerLoop
    from engine.worker.served import EngineFacts

    key = EngineKey("tiny-flux", "cpu", "fp32")
    ours, theirs = LocalConnection.pair()
    runner = _MovingRunner(key)
    loop = WorkerLoop(theirs, EngineFacts(key=key, board=runner.board, faults=Faults()), runner, runner)
    client = ConnectionClient(key)
    client.attach(ours)
    serving = threading.Thread(target=loop.run, daemon=True)
    serving.start()
    try:
        loop.send(Ready(EngineReady(key=key, pid=os.getpid(), load_s=0.1, folders=runner.folders())))
        assert client.wait_ready(timeout=10)
        assert client.folders()["TORCHINDUCTOR_CACHE_DIR"] == "/cache/inductor"
        bucket = BucketKey(Mode.REGIONAL, Size(64, 64))
        client.warm(bucket)
        wait_until(lambda: client.folders()["TORCHINDUCTOR_CACHE_DIR"].startswith("/tmp/showcase-inductor-x"), 10,
                   message="the worker reporting its new folders")
        assert client.folders()["TMPDIR"] == "/tmp/showcase-inductor-x/tmp"
        assert any(n.startswith("the compile cache disk is full") for n in client.status()["notices"])
    finally:
        client.send(Shutdown())
        serving.join(10)
