"""The Compare tab's views: configuration labels, the price table and cards, the speedup rows, the per-step
plot's series and legend. The speedup rows come from the benchmark's own speedup_table and the drift and
fidelity from its quality code, imported on first use, so the UI and the bench agree."""

from __future__ import annotations

import base64
import html
import io

import pandas as pd

import bench.configs as explicit
from bench.paired import PairedTiming
from engine.protocol import LoraChoice, lora_run_text
from ui import compare_clips
from ui.memory_views import gib_text
from ui.views import CACHED, NO_CACHE, SERIES_PALETTE, fmt_ms, fmt_s, fmt_steps, median, step_rows

COMPARE_STEP_COLUMNS = ["step", "step_ms", "config"]
SPEEDUP_COLUMNS = ["config", "median step", "total", "× step", "× total", "compile s", "warm-up s",
                   "break-even"]
CACHED_SUFFIX = " · cached"
THUMBNAIL_PX = 256
COST_COLUMNS = ["config", "state", "compile s", "warm-up s", "cache hits", "waited s", "error"]
FIDELITY_SEED = 7  # the bench's prompt-sampling seed: Compare scores the same prompts as its quality samples
REFERENCE_TAG = "reference: eager fp32, no step cache"
PRICE_COLUMNS = ["config", "s / image", "× vs eager fp32", "median step", "steps computed / cached",
                 "drift PSNR / max diff", "fidelity", "compile s", "warm-up s"]
# The speedup (its spread, image count and load marks) gets the room it needs: at 1280x800 six rows fit
# without the table's inner scroller. No header is narrower than its longest word.
PRICE_WIDTHS = ["22%", "6%", "20%", "7%", "9%", "12%", "10%", "7%", "7%"]


def config_label(device: str, precision: str, mode: str, cache: str = NO_CACHE, lora: str = "") -> str:
    """"cpu/fp32/eager", with "/first-block:0.2" appended when a step cache is on and `lora` ("+lora=swap:0.5",
    the typed list's spelling: ui/compare.py writes and reads it) when a LoRA is."""
    base = f"{device}/{precision}/{mode}"
    return (base if not cache or cache == NO_CACHE else f"{base}/{cache}") + lora


def typed_label(config, device: str) -> str:
    """A typed configuration's label ("cpu/fp32/compile+lora=swap:0.5"), on `device` when it names none."""
    return config_label(config.device or device, config.precision, config.mode, config.step_cache,
                        explicit.lora_suffix(config.lora) + explicit.memory_suffix(config.memory))


def parse_config(label: str) -> tuple[str, str, str, str]:
    """(device, precision, mode, cache) of a config_label, its LoRA part left out."""
    parts = label.split("+", 1)[0].split("/", 3)
    return parts[0], parts[1], parts[2], parts[3] if len(parts) > 3 else NO_CACHE


def reference_label(device: str) -> str:
    return config_label(device, "fp32", "eager")


def compare_lora_choices(preset, slot: bool) -> list[tuple[str, str]]:
    """Compare's LoRA axis: "none", then each adapter unfused and fused (values in the typed list's
    NAME[:fused] form); without a slot only "none"."""
    return [("none", "none")] + [choice for lora in (preset.loras if slot else ())
                                 for choice in ((lora.name, lora.name), (f"{lora.name} fused", f"{lora.name}:fused"))]


LABELLED_STEPS = 60  # up to this many steps a full-width plot labels each step; beyond, numeric ticks


def steps_as_labels(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str] | None]:
    """A step frame for a plot drawn once (Compare's): up to LABELLED_STEPS steps, the steps as labels and
    their order (the plot's `sort`), so the axis ticks each whole step; a numeric axis ticks 1.0, 1.25, 1.5
    when it has more room than steps. More steps: as it is (numeric ticks are then whole steps)."""
    last = int(frame["step"].max()) if len(frame) else 0
    if not 0 < last <= LABELLED_STEPS:
        return frame, None
    return frame.astype({"step": "string"}), [str(i) for i in range(1, last + 1)]


def find_bucket(status: list[dict], engine: str, mode: str, size: str) -> dict | None:
    for e in status:
        if e.get("engine") != engine:
            continue
        for b in e.get("buckets", []):
            if b.get("mode") == mode and b.get("size") == size and b.get("batch", 1) == 1:
                return b
    return None


def per_image_s(result: dict) -> float | None:
    """Seconds per image: the median total over the configuration's images (main + fidelity samples)."""
    totals = result.get("image_ms") or [(result.get("timings") or {}).get("total_ms")]
    totals = [t for t in totals if t is not None]
    return median(totals) / 1000 if totals else None


def speedups_vs_reference(results: list[dict]) -> dict[str, float | None]:
    """config -> its speedup over the reference (eager fp32 without a step cache): the paired figure where
    it was timed round-robin with it (speedup_figure), else reference s/image ÷ its s/image."""
    ref = next((r for r in results if r.get("reference") and not r.get("error")), None)
    ref_s = per_image_s(ref) if ref else None
    out = {}
    for r in results:
        figure = r.get("speedup_figure")
        if figure and not r.get("error"):
            out[r.get("config", "")] = figure.get("speedup")
            continue
        mine = None if r.get("error") else per_image_s(r)
        out[r.get("config", "")] = ref_s / mine if ref_s and mine else None
    return out


def speedup_text(result: dict, x: float | None) -> str:
    """The speedup as a table or card shows it: with its spread and images where timed in pairs."""
    figure = result.get("speedup_figure")
    if figure and figure.get("text"):
        return figure["text"]
    return "—" if x is None else f"{x:.2f}×"


def fmt_fidelity(result: dict) -> str:
    share, n = result.get("fidelity"), result.get("fidelity_samples")
    if share is None:
        return "—" if "fidelity" not in result else "no prompt in the model's grammar"
    right = round(share * n) if n else None
    return f"{share * 100:.0f} % ({right}/{n} prompts)" if n else f"{share * 100:.0f} %"


def price_rows(results: list[dict]) -> list[list]:
    """The Compare tab's table: what each configuration costs and what it buys."""
    speed = speedups_vs_reference(results)
    out = []
    for r in results:
        config = r.get("config", "")
        if r.get("error"):
            out.append([config, r["error"] if r.get("refused") else f"failed: {r['error']}", "", "", "", "", "", "", ""])
            continue
        x = speed.get(config)
        drift = r.get("drift") or "—"
        if r.get("drift_samples"):
            drift = f"{drift} (worst of {r['drift_samples']})"
        out.append([
            config + (" (reference)" if r.get("reference") else ""), _per_run_text(r) + gib_text(r),
            speedup_text(r, x), fmt_ms((r.get("timings") or {}).get("median_step_ms")),
            fmt_steps(r), drift, fmt_fidelity(r), fmt_s(r.get("compile_s")), fmt_s(r.get("warmup_s")),
        ])
    return out


def _per_run_text(r: dict) -> str:
    """The price table's time: seconds per image, or per clip with milliseconds per frame."""
    per = per_image_s(r)
    if not r.get("frames") or per is None:
        return fmt_s(per)
    return f"{fmt_s(per)} / clip, {1000 * per / r['frames']:.1f} ms / frame"


def _esc(text) -> str:
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;"))


def compare_cards_html(results: list[dict], images: list[str | None], heatmaps: list[str | None] | None = None,
                       strips: list[list] | None = None) -> str:
    """One card per configuration: its image (and beside it the heat map of its difference to the reference's)
    and, under them, time, speedup, drift and fidelity. `images[i]` / `heatmaps[i]`: of results[i] as URLs
    (data: URIs), or None (failed, not run yet, the reference). A clip's card (ui/compare_clips.py) shows its
    frame strip (`strips[i]`: (URI, caption) pairs), its worst frame's heat map and its drift frame by frame."""
    speed = speedups_vs_reference(results)
    cards = []
    heatmaps = heatmaps or [None] * len(results)
    strips = strips or [[]] * len(results)
    for r, uri, heat, strip in zip(results, images, heatmaps, strips, strict=True):
        config = r.get("config", "")
        lines = [f'<div class="c-card-title">{_esc(config)}</div>']
        if r.get("reference"):
            lines.append(f'<div class="c-card-tag">{_esc(r.get("reference_note") or REFERENCE_TAG)}</div>')
        if r.get("error"):
            if uri:
                lines.append(f'<img src="{uri}" alt="{_esc(config)}">')
            error = r["error"] if r.get("refused") else f"failed: {r['error']}"
            lines.append(f'<div class="c-card-error">{_esc(error)}</div>')
        elif r.get("frames"):
            lines += _clip_card(r, strip, heat, speed.get(config)) + _card_tail(r)
        else:
            lines += _image_card(r, uri, heat, speed.get(config)) + _card_tail(r)
        cards.append('<div class="c-card">' + "".join(lines) + "</div>")
    return '<div class="c-cards">' + "".join(cards) + "</div>"


def _image_card(r: dict, uri: str | None, heat: str | None, x: float | None) -> list[str]:
    """An image card's middle: its image beside the heat map of its difference, time per image, drift."""
    config = r.get("config", "")
    lines = []
    if uri and heat:
        lines.append(f'<div class="c-pair"><img src="{uri}" alt="{_esc(config)}">'
                     f'<img class="c-heat" src="{heat}" alt="difference to the reference" '
                     f'title="|this − reference|: black = same pixels, white = the largest difference"></div>')
    elif uri:
        lines.append(f'<img src="{uri}" alt="{_esc(config)}">')
    per = per_image_s(r)
    lines.append(f'<div class="c-time">{"—" if per is None else f"{per:.3f} s"} / image{gib_text(r)} · '
                 f'{_esc(speedup_text(r, x))} vs eager fp32</div>')
    drift = r.get("drift") or ("reference" if r.get("reference") else "—")
    return [*lines, f'<div class="c-drift">drift: {_esc(drift)}</div>']


def _clip_card(r: dict, strip: list, heat: str | None, x: float | None) -> list[str]:
    """A clip card's middle: its frame strip, its worst frame's heat map, time per clip and frame, drift by frame."""
    config = r.get("config", "")
    lines = [compare_clips.strip_html(strip, config)] if strip else []
    if heat:
        frame = r.get("heatmap_frame", 1)
        lines.append(f'<img class="c-heat" src="{heat}" alt="difference to the reference at frame {frame}" '
                     f'title="|this − reference| at frame {frame}: black = same pixels, white = the largest '
                     f'difference"><div class="c-note">difference at frame {frame} (its worst)</div>')
    lines.append(f'<div class="c-time">{_esc(compare_clips.clip_time_text(r, per_image_s(r)))}{gib_text(r)} · '
                 f'{_esc(speedup_text(r, x))} vs eager fp32</div>')
    return lines + compare_clips.clip_drift_lines(r)


def _card_tail(r: dict) -> list[str]:
    """Under a card's drift: fidelity (where the preset has a checker), the step cache's share, LoRA, fallback."""
    lines = []
    if "fidelity" in r or r.get("fidelity_this") is not None:
        verdict = {True: "✓ draws the prompt", False: "✗ does not draw the prompt"}.get(
            r.get("fidelity_this"), "prompt outside the grammar")
        lines.append(f'<div class="c-fidelity">fidelity: {_esc(fmt_fidelity(r))} · {verdict}</div>')
    lines.append(f'<div class="c-steps">steps computed / cached: {fmt_steps(r)}</div>')
    if r.get("lora"):
        lines.append(f'<div class="c-lora">LoRA {_esc(lora_run_text(r))}</div>')
    if r.get("eager_fallback"):
        lines.append('<div class="c-note">eager fallback: the bucket was not warm</div>')
    return lines


def series_colors(names: list[str]) -> dict[str, str]:
    """Each series its colour: a configuration the next hue, its cached steps (" · cached") a tint of its own."""
    colors: dict[str, str] = {}
    bases = list(dict.fromkeys(name.removesuffix(CACHED_SUFFIX) for name in names))
    for i, base in enumerate(bases):
        colors[base] = SERIES_PALETTE[i % len(SERIES_PALETTE)]
    for name in names:
        if name.endswith(CACHED_SUFFIX):
            colors[name] = tint(colors[name.removesuffix(CACHED_SUFFIX)])
    return {name: colors[name] for name in names}


def tint(color: str, share: float = 0.55) -> str:
    """`color` (#rrggbb) mixed with white: `share` of white."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * share):02x}" for c in rgb)


def legend_html(colors: dict[str, str]) -> str:
    """The plot's legend as HTML that wraps (Vega draws its bottom legend as one row, cut at the plot's edge)."""
    items = "".join(f'<span class="legend-item"><span class="swatch" style="background:{color}"></span>'
                    f'{html.escape(name)}</span>' for name, color in colors.items())
    return f'<div class="legend">{items}</div>' if items else ""


def compare_step_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        if r.get("error"):
            continue
        for row in step_rows(r):
            config = r.get("config", "")
            rows.append({"step": row["step"], "step_ms": row["step_ms"],
                         "config": f"{config}{CACHED_SUFFIX}" if row["steps"] == CACHED else config})
    return rows


def fidelity_sample_prompts(preset, n: int, fallback: str) -> list[str]:
    """The Compare tab's fidelity prompts: the bench's seeded samples of the model's grammar."""
    from bench.quality import sample_prompts

    return sample_prompts(preset, n, seed=FIDELITY_SEED, fallback=fallback)


def difference_picture(image, reference):
    """|image - reference| as a heat map (PIL), by the bench's quality code."""
    from bench.quality import diff_heatmap

    return diff_heatmap(image, reference)


def edit_sample(preset, instruction: str, source):
    """An edit's quality sample (bench.quality.edit_sample): for the embedded edit model, the edit the checker
    reads in `source` (PIL, as the worker got it) and the instruction; scored by the edit checker."""
    from bench.quality import edit_sample as sample

    return sample(preset, instruction, source)


def has_checker(preset) -> bool:
    """Whether the preset's `fidelity` names a checker: of images, or of clips for a video preset."""
    from bench.quality import clip_checker, fidelity_checker

    return (clip_checker(preset) if compare_clips.takes_clips(preset) else fidelity_checker(preset)) is not None


def price_quality(images: list, prompts: list[str], ref_images: list | None, preset, style: str | None = None) -> dict:
    """Under a Compare image: drift of every image against the reference's image of the same prompt and
    seed (the worst kept), and fidelity over the sample prompts (images[1:]) with the first image's own
    verdict, by the bench's quality.score; with a LoRA `style`, against what the style implies."""
    from bench.quality import fidelity_checker, fmt_drift, score

    out: dict = {}
    if ref_images is not None:
        drift = score(images, prompts, ref_images, preset)
        ssim_text = "" if drift.get("drift_ssim") is None or not drift["drift_max_diff"] else \
            f", SSIM {drift['drift_ssim']:.3f}"
        out.update(drift_psnr_db=drift["drift_psnr_db"], drift_max_diff=drift["drift_max_diff"],
                   drift_ssim=drift.get("drift_ssim"),
                   drift=fmt_drift(drift["drift_psnr_db"], drift["drift_max_diff"]) + ssim_text,
                   drift_samples=len(images))
    checker = fidelity_checker(preset, style)
    if checker is not None:
        out["fidelity_this"] = checker(images[0], prompts[0])
        if len(prompts) > 1:
            fid = score(images[1:], prompts[1:], None, preset, style)
            out.update(fidelity=fid["fidelity"], fidelity_samples=fid["fidelity_samples"])
    return out


def clip_quality(clips: list, posters: list, prompts: list[str], reference: tuple[list, list] | None, preset) -> dict:
    """What a clip card shows of its quality: the first clip's drift against the reference's (frame by frame on the
    decoded MP4s, with the flicker); beside it frame 1 before the codec (the posters, lossless PNGs) and the
    codec's own loss on it, so a drift the size of that loss reads as the codec's; and, where the preset's
    `fidelity` names a clip checker, its verdict and the sample clips' share. `reference`: (clips, posters)."""
    from bench.quality import clip_checker, clip_drift, fmt_clip_drift, fmt_drift, image_drift

    codec = image_drift(clips[0][0], posters[0])
    codec_text = f"MP4 codec loss on frame 1: {fmt_drift(codec['psnr_db'], codec['max_diff'])}"
    out: dict = {"codec_psnr_db": codec["psnr_db"], "codec_max_diff": codec["max_diff"], "codec_note": codec_text}
    if reference is not None:
        drift = clip_drift(clips[0], reference[0][0])
        raw = image_drift(posters[0], reference[1][0])
        out.update(clip_drift=drift, drift=fmt_clip_drift(drift), drift_psnr_db=drift["psnr_db"],
                   drift_max_diff=drift["max_diff"], drift_ssim=drift["ssim"], flicker=drift["flicker"],
                   first_frame_psnr_db=raw["psnr_db"], first_frame_max_diff=raw["max_diff"],
                   codec_note=f"frame 1 before the MP4: {fmt_drift(raw['psnr_db'], raw['max_diff'])} · {codec_text}")
    checker = clip_checker(preset)
    if checker is not None:
        out["fidelity_this"] = checker(clips[0], prompts[0])
        verdicts = [v for v in (checker(c, p) for c, p in zip(clips[1:], prompts[1:], strict=True)) if v is not None]
        if len(prompts) > 1:
            out.update(fidelity=sum(verdicts) / len(verdicts) if verdicts else None, fidelity_samples=len(verdicts))
    return out


def speedup_table(results: list[dict]) -> list[dict]:
    """The Compare tab's speedup rows, computed by the benchmark's own speedup_table (bench),
    so the UI, the CLI bench and docs/benchmarks.md agree.

    `results` are GenerateResult.as_dict() objects, optionally with "config", "compile_s" and
    "warmup_s" added (and "error" for a configuration that failed). The baseline is the eager run of
    the same engine and size; without one the speedup is None.
    """
    from bench import speedup_table as bench_speedup_table

    rows = []
    for r, b in zip(results, bench_speedup_table(results), strict=True):
        rows.append({
            "config": r.get("config")
            or config_label(r.get("device", "?"), r.get("precision", "?"), r.get("mode", "?")),
            "bucket": r.get("bucket"),
            "median_step_ms": b.get("step_ms_median"),
            "total_ms": b.get("image_ms_median"),
            "speedup_step": b.get("speedup_vs_eager"),
            # the paired figure where Compare timed one: the same speedup as the table and the cards
            "speedup_total": r["speedup_figure"]["speedup"] if r.get("speedup_figure")
            else b.get("speedup_image_vs_eager"),
            "compile_s": r.get("compile_s"),
            "warmup_s": r.get("warmup_s"),
            "break_even_images": b.get("break_even_images"),
            "error": r.get("error"),
        })
    return rows


def speedup_display_rows(rows: list[dict]) -> list[list]:
    def x(v):
        return "—" if v is None else f"{v:.2f}×"

    out = []
    for r in rows:
        if r.get("error"):
            out.append([r["config"], f"failed: {r['error']}", "", "", "", "", "", ""])
            continue
        out.append([
            r["config"], fmt_ms(r["median_step_ms"]), fmt_ms(r["total_ms"]),
            x(r["speedup_step"]), x(r["speedup_total"]), fmt_s(r["compile_s"]), fmt_s(r["warmup_s"]),
            "" if r["break_even_images"] is None else str(r["break_even_images"]),
        ])
    return out


def cost_rows(results: list[dict]) -> list[list]:
    out = []
    for r in results:
        out.append([
            r.get("config", ""), r.get("bucket_state") or ("failed" if r.get("error") else ""),
            fmt_s(r.get("compile_s")), fmt_s(r.get("warmup_s")), r.get("cache_hits") or "",
            fmt_s(r.get("waited_s")), r.get("error") or "",
        ])
    return out


def caption(entry: dict) -> str:
    """A gallery image's caption: its configuration, s / image, speedup, drift and fidelity."""
    figure = entry.get("speedup_figure")
    return " · ".join(filter(None, [
        entry["config"], f"LoRA {LoraChoice.of(entry).caption()}" if entry.get("lora") else "",
        f"{per_image_s(entry):.3f} s / {'clip' if entry.get('frames') else 'image'}{gib_text(entry)}",
        f"{figure['text']} vs eager fp32" if figure and not entry.get("reference") else "",
        f"{entry['own_chip_figure']['text']} vs eager fp32 on its chip" if entry.get("own_chip_figure") else "",
        f"drift {entry['drift']}" if entry.get("drift") else "",
        f"fidelity {fmt_fidelity(entry)}" if "fidelity" in entry else "",
        "eager fallback" if entry.get("eager_fallback") else ""]))


def apply_timing(plan: PairedTiming, entries: dict[str, dict]) -> None:
    """Each entry's one speedup (and its timed images) from the paired plan: every view reads these."""
    chip_of_reference = parse_config(plan.reference)[0]
    for config, entry in entries.items():
        figure = plan.figure(config)
        if figure.images:
            entry["image_ms"] = [plan.times[config][r] for r in sorted(plan.times[config])]
            entry["speedup_figure"] = figure.as_dict()
        chip = parse_config(config)[0]
        own = reference_label(chip)  # its chip's eager fp32, when on another chip
        if figure.images and chip != chip_of_reference and own in entries and own != config:
            entry["own_chip_figure"] = plan.figure(config, against=own).as_dict()


def thumbnail_uri(image) -> str:
    """A PNG data: URI of the image, at most THUMBNAIL_PX on its longer side (the cards are small)."""
    image = image.copy()
    image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
