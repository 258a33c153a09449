"""`python -m bench edit-bench`: what an edit costs against text to image, and what a hostile upload costs.

Three measurements, through an EngineManager as a door drives it (engine/serving/manager.py):

- cost: an instruction edit (`--edit-preset`, default tiny-shapes-edit: FLUX.1 Kontext form) against a
  text-to-image request of the same model (`--text-preset`, tiny-shapes) at the same output size, both warm
  in the same compiled mode (`--mode`, regional), interleaved request by request so the machine's load falls on
  both alike: median total and step milliseconds, their spread (p10-p90), the ratio, and the token ratio it
  is expected to follow (the reference's latent tokens join the sequence: engine/serving/cost.py);
- bomb: the resident-memory growth of a fresh process (no torch: the gate's decode alone) checking a PNG
  that declares 1.3 gigapixels (40000x32500) in a few hundred bytes; the target is under 50 MB;
- malformed: `BAD_UPLOADS` (20 of them) each sent through the gate, each answer printed; then one good edit,
  to show the engine keeps serving.

Figures are medians over `--repeats` pairs (engine.metrics); the load of the shared machine goes with them.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from dataclasses import dataclass

from bench import flags
from engine.config.flags import from_args
from engine.metrics import median, percentile

BOMB_SIZE = (40_000, 32_500)  # 1.3 gigapixels
TIMEOUT_S = 1800  # the first request of each waits for its bucket's compile


def png_declaring(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height 1-bit pixels, one compressed row: a decompression bomb's shape."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(64))) + chunk(b"IEND", b"")


def _encoded(mode: str, size=(64, 64), fmt: str = "PNG", colour=None, **save) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, size, colour if colour is not None else 0).save(buffer, fmt, **save)
    return buffer.getvalue()


def bad_uploads() -> list[tuple[str, dict]]:
    """(what, ImageRequest fields) for 20 malformed or refused uploads to the edit preset (and two to others)."""
    good = _encoded("RGB", colour=(200, 30, 30))
    return [
        ("empty file", {"images": (b"",)}),
        ("text, not an image", {"images": (b"hello, this is not a picture",)}),
        ("a path as text", {"images": ("/etc/passwd",)}),
        ("truncated PNG", {"images": (good[: len(good) // 2],)}),
        ("PNG header only", {"images": (good[:33],)}),
        ("1.3-gigapixel PNG bomb", {"images": (png_declaring(*BOMB_SIZE),)}),
        ("5000x5000 declared", {"images": (png_declaring(5000, 5000),)}),
        ("0-row PNG", {"images": (png_declaring(64, 0),)}),
        ("float TIFF", {"images": (_encoded("F", fmt="TIFF"),)}),
        ("an SVG", {"images": (b'<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"/>',)}),
        ("a PDF", {"images": (b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF",)}),
        ("a ZIP", {"images": (b"PK\x03\x04" + bytes(60),)}),
        ("over 32 MiB", {"images": (b"\x89PNG" + bytes(32 * 2**20),)}),
        ("two images for a one-image edit", {"images": (good, good)}),
        ("no image for an edit", {"images": ()}),
        ("a mask for an edit", {"images": (good,), "mask": good}),
        ("a strength for an edit", {"images": (good,), "strength": "0.5"}),
        ("a list of numbers", {"images": ([1, 2, 3],)}),
        ("an image for text to image", {"preset": "tiny-shapes", "images": (good,)}),
        ("a mask of another size", {"preset": "tiny-shapes-inpaint", "images": (good,),
                                    "mask": _encoded("L", size=(32, 32))}),
    ]


def _bomb_child(queue) -> None:
    """In a fresh process: peak RSS before and after the gate's decode refuses the bomb (kB)."""
    import resource

    from engine.config.presets import get_preset
    from engine.config.request import ImageRequest
    from engine.config.validation import build_request
    from engine.errors import InvalidRequest

    preset = get_preset("tiny-shapes-edit")
    bomb = png_declaring(*BOMB_SIZE)
    warm = _encoded("RGB")  # PIL's PNG decoder loaded and used once, so its own import is not counted
    build_request(preset, ImageRequest(preset=preset.name, images=(warm,)))
    before, rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, _rss_kb()
    try:
        build_request(preset, ImageRequest(preset=preset.name, images=(bomb,)))
        answer = "accepted"
    except InvalidRequest as exc:
        answer = str(exc)
    after, rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, _rss_kb()
    queue.put({"bytes": len(bomb), "peak_rss_growth_mb": (after - before) / 1024,
               "rss_growth_mb": (rss_after - rss_before) / 1024, "rss_mb": rss_after / 1024, "answer": answer})


def _rss_kb() -> int:
    """This process's resident memory now (kB), from /proc (Linux)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def measure_bomb() -> dict:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_bomb_child, args=(queue,))
    child.start()
    report = queue.get(timeout=300)
    child.join(timeout=60)
    return report


@dataclass
class EditBenchOptions:
    """`edit-bench`'s flags."""

    edit_preset: str = flags.text("tiny-shapes-edit", "the editing preset (its first bucket's size is used)")
    text_preset: str = flags.text("tiny-shapes", "the text-to-image preset of the same model")
    device: str = flags.device("cpu")
    mode: str = flags.mode("regional")
    size: str | None = flags.size("64x64")
    steps: int | None = flags.steps(None)
    repeats: int = flags.count(10)
    cache_dir: str | None = flags.cache_dir()
    json: bool = flags.as_json()


def _spread(values: list[float]) -> tuple[float | None, float | None]:
    return percentile(values, 0.1), percentile(values, 0.9)


class EditCost:
    """Warm edits and text-to-image requests, interleaved, on one manager."""

    def __init__(self, manager, opts: EditBenchOptions):
        self.manager, self.opts = manager, opts

    def _request(self, edit: bool, seed: int):
        from engine.config.request import ImageRequest

        o = self.opts
        fields = dict(device=o.device, mode=o.mode, size=o.size, steps=o.steps, seed=seed, on_cold="wait")
        if edit:
            from PIL import Image

            buffer = io.BytesIO()
            Image.new("RGB", (64, 64), (seed * 20 % 256, 40, 200)).save(buffer, "PNG")
            preset = self.manager.catalog.preset(o.edit_preset)
            return ImageRequest(preset=o.edit_preset, prompt=preset.example_prompt, images=(buffer.getvalue(),),
                                **fields)
        preset = self.manager.catalog.preset(o.text_preset)
        return ImageRequest(preset=o.text_preset, prompt=preset.example_prompt, **fields)

    def run(self) -> dict:
        from engine.serving import cost

        for edit in (True, False):  # each bucket compiled (or taken from the cache) before timing
            self.manager.generate(self._request(edit, 0), timeout=TIMEOUT_S)
        rows = {True: [], False: []}
        for i in range(self.opts.repeats):
            for edit in (True, False):
                rows[edit].append(self.manager.generate(self._request(edit, i + 1), timeout=TIMEOUT_S))
        edit, text = rows[True], rows[False]
        size = edit[0].bucket.size
        tokens = (cost.tokens_per_image_step(self.manager.catalog.preset(self.opts.edit_preset), size, refs=edit[0].bucket.refs),
                  cost.tokens_per_image_step(self.manager.catalog.preset(self.opts.text_preset), size))
        return {"bucket": {"edit": str(edit[0].bucket), "text": str(text[0].bucket)},
                "edit": _figures(edit), "text": _figures(text),
                "ratio_total": _ratio(edit, text, "total_ms"), "ratio_step": _ratio(edit, text, "median_step_ms"),
                "token_ratio": tokens[0] / tokens[1], "tokens": {"edit": tokens[0], "text": tokens[1]},
                "recompiles": sum(r.recompiles for r in edit + text), "warm": all(r.warm for r in edit + text)}


def _figures(results) -> dict:
    totals = [r.timings.total_ms for r in results]
    steps = [r.timings.median_step_ms for r in results]
    encodes = [r.timings.encode_ms for r in results]
    return {"total_ms": median(totals), "total_p10_p90": _spread(totals), "step_ms": median(steps),
            "step_p10_p90": _spread(steps), "encode_ms": median(encodes), "runs": len(results)}


def _ratio(a, b, field: str) -> float:
    def value(r):
        return r.timings.total_ms if field == "total_ms" else r.timings.median_step_ms

    return median([value(x) for x in a]) / median([value(y) for y in b])


def malformed(manager, preset: str, device: str) -> list[dict]:
    """Each bad upload through the gate (the answer a visitor reads), then one good edit."""
    from engine.config.request import ImageRequest
    from engine.errors import ShowcaseError

    answers = []
    for what, fields in bad_uploads():
        spec = ImageRequest(**{"preset": preset, "device": device, "prompt": "make the circle green", **fields})
        try:
            manager.gate.admit(spec)
            answers.append({"upload": what, "refused": False, "answer": "accepted"})
        except ShowcaseError as exc:
            answers.append({"upload": what, "refused": True, "answer": str(exc)})
    good = manager.generate(ImageRequest(preset=preset, device=device, prompt="make the circle green",
                                         images=(_encoded("RGB", colour=(200, 30, 30)),)), timeout=TIMEOUT_S)
    answers.append({"upload": "a good PNG, after them", "refused": False, "answer": f"served {good.bucket}"})
    return answers


def format_report(report: dict) -> str:
    c = report["cost"]
    lines = [f"edit {c['bucket']['edit']} vs text {c['bucket']['text']} ({c['edit']['runs']} each, warm={c['warm']}, "
             f"recompiles {c['recompiles']})"]
    for name in ("edit", "text"):
        f = c[name]
        lines.append(f"  {name:4}: total {f['total_ms']:.1f} ms (p10-p90 {f['total_p10_p90'][0]:.1f}-"
                     f"{f['total_p10_p90'][1]:.1f}), step {f['step_ms']:.2f} ms (p10-p90 {f['step_p10_p90'][0]:.2f}-"
                     f"{f['step_p10_p90'][1]:.2f}), encode {f['encode_ms']:.1f} ms")
    lines.append(f"  edit/text: total x{c['ratio_total']:.2f}, step x{c['ratio_step']:.2f}; token ratio "
                 f"x{c['token_ratio']:.2f} ({c['tokens']['edit']} vs {c['tokens']['text']} tokens a step)")
    b = report["bomb"]
    lines.append(f"bomb: {b['bytes']} bytes declaring {BOMB_SIZE[0]}x{BOMB_SIZE[1]}: peak RSS +"
                 f"{b['peak_rss_growth_mb']:.1f} MB, RSS +{b['rss_growth_mb']:.1f} MB of {b['rss_mb']:.0f} MB "
                 f"(target < 50); answer: {b['answer']}")
    bad = report["malformed"]
    lines.append(f"malformed: {sum(a['refused'] for a in bad)} of {len(bad) - 1} refused, then: {bad[-1]['answer']}")
    lines += [f"  {a['upload']:34} {a['answer'][:110]}" for a in bad[:-1]]
    return "\n".join(lines)


def cmd_edit_bench(args) -> int:
    from pathlib import Path

    from engine import settings
    from engine.protocol import EngineOptions
    from engine.serving.manager import EngineManager

    opts = from_args(EditBenchOptions, args)
    cache = Path(opts.cache_dir) if opts.cache_dir else settings.cache_dir()
    manager = EngineManager(cache_dir=cache, options=EngineOptions(warm_sizes=()))
    try:
        report = {"cost": EditCost(manager, opts).run(), "bomb": measure_bomb(),
                  "malformed": malformed(manager, opts.edit_preset, opts.device)}
    finally:
        manager.shutdown()
    print(json.dumps(report, indent=2) if opts.json else format_report(report))
    return 0


def add_edit_bench_parser(sub) -> None:
    flags.add_command(sub, "edit-bench", EditBenchOptions, cmd_edit_bench,
                      help="an edit's cost against text to image (warm, compiled), a PNG bomb's memory, and 20 "
                           "malformed uploads' answers")
