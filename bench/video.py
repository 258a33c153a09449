"""`python -m bench video-bench`: what compiling buys a clip, on a video preset (default tiny-wan at 32x32 x 17
frames): seconds per clip and per frame, eager against each compiled mode, the VAE decode's share, recompiles,
each clip's own motion, and each mode's clip against eager's at the same seed: its worst frame's drift and its
temporal flicker (bench/quality.py `clip_drift`: how much its error against eager changes from frame to frame).

One engine in a worker process, driven through the client as the manager drives it (engine/worker/client.py);
each compiled mode's (size, frames) bucket is warmed first, then every round runs one clip in each mode, one
after another, so the machine's load falls on all of them alike. A round's ratio is that round's compiled
clip over its eager one; the figures are medians (engine.metrics) with the spread (p10-p90) beside them.
"""

from __future__ import annotations

import json
import os
import queue
from dataclasses import dataclass
from pathlib import Path

from bench import flags
from bench.quality import clip_drift, fmt_drift, frame_change
from engine.config.flags import from_args
from engine.metrics import median, percentile
from engine.protocol import BucketKey, EngineConfig, EngineKey, EngineOptions, GenerateRequest, Mode, Size
from engine.worker.client import EngineEvents

LOAD_TIMEOUT_S = 600
COMPILE_TIMEOUT_S = 1800
REQUEST_TIMEOUT_S = 600
PROMPT = "a yellow triangle moving left on a purple background"


class _Compiles(EngineEvents):
    """Grants every compile at once (no host scheduler here) and tells when one has ended."""

    def __init__(self):
        self.finished: queue.Queue = queue.Queue()

    def compile_finished(self, engine, bucket: BucketKey) -> None:
        self.finished.put(bucket)


@dataclass(frozen=True)
class Clip:
    """What one bench clip is: its bucket, steps and the mode it runs in."""

    size: Size
    frames: int
    steps: int

    def request(self, preset, mode: Mode, seed: int) -> GenerateRequest:
        return GenerateRequest.checked(prompt=PROMPT, width=self.size.width, height=self.size.height, steps=self.steps,
                               guidance=preset.guidance, seed=seed, mode=mode, num_frames=self.frames,
                               fps=preset.fps)


def _spread(values: list[float]) -> dict:
    return {"median": median(values), "p10": percentile(values, 0.1), "p90": percentile(values, 0.9)}


class VideoBench:
    """The clips of one engine: warm each compiled bucket, then `repeats` rounds of one clip per mode."""

    def __init__(self, preset, clip: Clip, modes: tuple[Mode, ...], cache_dir: Path):
        from engine import devices
        from engine.worker.client import ProcessClient

        self.preset, self.clip, self.modes = preset, clip, modes
        self.compiles = _Compiles()
        config = EngineConfig(EngineKey(preset.name, "cpu", "fp32"), preset, EngineOptions(warm_sizes=()),
                              str(cache_dir))
        env = devices.worker_environment(devices.get_device("cpu"), cache_dir)
        self.client = ProcessClient(config, env=env, events=self.compiles).start()

    def warm(self, mode: Mode) -> str | None:
        """Compile the clip's bucket in `mode`; why it failed, or None."""
        bucket = BucketKey(mode, self.clip.size, frames=self.clip.frames)
        self.client.warm(bucket)
        while True:
            try:
                done = self.compiles.finished.get(timeout=COMPILE_TIMEOUT_S)
            except queue.Empty:
                return "the compile did not finish"
            if done == bucket:
                info = next((i for i in self.client.buckets() if i.bucket == bucket), None)
                return None if info is not None and info.state.value == "warm" else (info.error if info else "?")

    def run(self, repeats: int) -> dict:
        self.client.wait_ready(LOAD_TIMEOUT_S)
        if self.client.error is not None:
            raise SystemExit(f"the engine did not load: {self.client.error}")
        errors = {str(m): why for m in self.modes if m.compiled and (why := self.warm(m))}
        modes = [m for m in self.modes if str(m) not in errors]
        results = {m: [] for m in modes}
        for i in range(repeats + 1):
            for mode in modes:
                result = self.client.generate(self.clip.request(self.preset, mode, seed=i), timeout=REQUEST_TIMEOUT_S)
                if i:  # the first round warms each mode's pipeline (its first eager call pays the set-up)
                    results[mode].append(result)
        eager = results.get(Mode.EAGER)
        rows = {str(m): self._row(results[m], eager if m is not Mode.EAGER else None) for m in modes}
        return {"modes": rows, "errors": errors}

    def _row(self, results: list, eager: list | None) -> dict:
        totals = [r.timings.total_ms for r in results]
        row = {"clip_s": _spread([t / 1000 for t in totals]),
               "frame_ms": _spread([t / self.clip.frames for t in totals]),
               "decode_share": median([r.timings.decode_ms / r.timings.total_ms for r in results]),
               "denoise_ms": median([r.timings.denoise_ms for r in results]),
               "recompiles": sum(r.recompiles for r in results),
               "motion": median([frame_change(r.frames()) for r in results]),
               "warm": all(r.warm for r in results), "peak_memory_bytes": max(r.peak_memory_bytes or 0 for r in results)}
        if eager:
            pairs = list(zip(results, eager, strict=True))
            row["vs_eager"] = _spread([r.timings.total_ms / e.timings.total_ms for r, e in pairs])
            drifts = [clip_drift(r.frames(), e.frames()) for r, e in pairs]  # each round: the same seed
            psnrs = [d["psnr_db"] for d in drifts if d["psnr_db"] is not None]
            row["drift"] = {"worst_frame_psnr_db": min(psnrs) if psnrs else None,
                            "max_diff": max(d["max_diff"] for d in drifts),
                            "ssim": min(d["ssim"] for d in drifts),
                            "flicker": max((d["flicker"] for d in drifts if d["flicker"] is not None), default=None)}
        return row

    def close(self) -> None:
        self.client.close()


def run_video_bench(preset_name: str, clip: Clip, modes: tuple[Mode, ...], repeats: int, cache_dir) -> dict:
    from engine.config.presets import get_preset

    preset = get_preset(preset_name)
    if not preset.video:
        raise SystemExit(f"preset {preset_name} makes images; pick a video preset (tiny-wan, ...)")
    bench = VideoBench(preset, clip, modes, Path(cache_dir))
    try:
        report = bench.run(repeats)
    finally:
        bench.close()
    return {"preset": preset_name, "size": str(clip.size), "frames": clip.frames, "steps": clip.steps,
            "repeats": repeats, "load": os.getloadavg()[0], **report}


def _drift_text(drift: dict | None) -> str:
    if drift is None:
        return "—"
    text = fmt_drift(drift["worst_frame_psnr_db"], drift["max_diff"])
    if drift.get("ssim") is not None and drift["max_diff"]:
        text += f", SSIM {drift['ssim']:.3f}"
    return text + ("" if drift.get("flicker") is None else f", flicker {drift['flicker']:.2f} px")


def format_report(report: dict) -> str:
    lines = [f"video on {report['preset']} at {report['size']} x {report['frames']} frames, {report['steps']} steps, "
             f"{report['repeats']} rounds; load average {report['load']:.1f}",
             f"{'mode':9s} {'s/clip (p10-p90)':>22s} {'ms/frame':>9s} {'decode':>7s} {'vs eager (p10-p90)':>22s} "
             f"{'recompiles':>10s} {'warm':>5s} {'motion':>7s}  drift vs eager (worst frame: PSNR / max diff, SSIM, "
             "flicker)"]
    for mode, row in report["modes"].items():
        c, f, v = row["clip_s"], row["frame_ms"], row.get("vs_eager")
        ratio = f"{v['median']:.2f} ({v['p10']:.2f}-{v['p90']:.2f})" if v else "—"
        lines.append(f"{mode:9s} {c['median']:8.3f} ({c['p10']:.3f}-{c['p90']:.3f}) {f['median']:9.1f} "
                     f"{100 * row['decode_share']:6.0f}% {ratio:>22s} {row['recompiles']:10d} {row['warm']!s:>5s} "
                     f"{row['motion']:7.1f}  {_drift_text(row.get('drift'))}")
    for mode, why in report["errors"].items():
        lines.append(f"{mode:9s} failed to compile: {why}")
    return "\n".join(lines)


@dataclass(frozen=True)
class VideoBenchOptions:
    """`video-bench`'s flags."""

    preset: str = flags.preset("tiny-wan")
    size: str = flags.size("32x32")
    frames: int = flags.count(17, "frames per clip (one of the preset's frame buckets)")
    steps: int = flags.steps(4)
    modes: str = flags.text("eager,compile,regional")
    repeats: int = flags.count(7)
    cache_dir: str | None = flags.cache_dir()
    json: bool = flags.as_json()


def cmd_video_bench(args) -> int:
    from engine import settings

    opts = from_args(VideoBenchOptions, args)
    modes = tuple(Mode.parse(m, "mode") for m in opts.modes.split(","))
    if Mode.EAGER not in modes:
        modes = (Mode.EAGER, *modes)  # the baseline of every ratio
    cache = Path(opts.cache_dir) if opts.cache_dir else settings.cache_dir()
    report = run_video_bench(opts.preset, Clip(Size.parse(opts.size), opts.frames, opts.steps), modes, opts.repeats,
                             cache)
    print(json.dumps(report, indent=2) if opts.json else format_report(report))
    return 0


def add_video_bench_parser(sub) -> None:
    flags.add_command(sub, "video-bench", VideoBenchOptions, cmd_video_bench,
                      help="seconds per clip and per frame on a video preset, compiled / eager per clip with its "
                           "spread, the VAE decode's share and recompiles (cpu)")
