"""The Advisor tab: `python -m bench advise` in a child process (it loads models and compiles; the web
server must stay responsive), its progress on a bar, Cancel ends the child. The speed-quality frontier
is drawn from its JSON; "Apply in Generate" sets the Generate tab's selectors to the pick.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import pandas as pd

from bench.advise import CHECKER_MIN_PSNR, DEFAULT_FIDELITY_POINTS, DEFAULT_MIN_PSNR
from bench.advise_report import COLUMNS, table_rows
from bench.advise_report import summary as advice_summary
from engine.errors import ShowcaseError
from engine.protocol import params, parse_lora
from engine.settings import pythonpath
from ui import advisor_views, views
from ui.common import ADVISOR_QUEUE, FAST, HandlerBase, to_gradio_error

ROOT = Path(__file__).resolve().parent.parent
MAX_CARDS = 6
# The Generate fields "apply" sets from a pick, in apply_advice's order.
APPLIED = ("preset", "device", "precision", "mode", "step_cache", "size", "steps", "lora", "lora_fused", "memory")


def _esc(text) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def advisor_cards_html(result: dict | None) -> str:
    """A card per configuration whose quality was measured (the pick first, then the largest speedups): its
    image of the sample that differs most from eager fp32's, that image of eager fp32, the heat map of the
    difference, and its speedup, drift and verdict."""
    if not result:
        return ""
    from bench.paired import row_speedup_text

    pick = (result.get("pick") or {}).get("label")
    rows = [r for r in result.get("rows", []) if r.get("diff_png") and not r.get("error")]
    rows.sort(key=lambda r: (r["label"] != pick, -(r.get("speedup") or 0)))
    cards = []
    for r in rows[:MAX_CARDS]:
        images = "".join(f'<img src="data:image/png;base64,{r[k]}" alt="{alt}" title="{alt}">'
                         for k, alt in (("picture_png", r["label"]), ("reference_png", "eager fp32"),
                                        ("diff_png", "|difference|: black = same, white = the largest"))
                         if r.get(k))
        drift = (f"{r['drift_psnr_db']:.1f} dB PSNR" if r.get("drift_psnr_db") is not None else "identical") + \
            (f", SSIM {r['drift_ssim']:.3f}" if r.get("drift_ssim") is not None else "") + \
            (f", max diff {r['drift_max_diff']}" if r.get("drift_max_diff") is not None else "")
        verdict = "★ pick" if r["label"] == pick else ("within bound" if r.get("eligible") else
                                                      f"outside bound: {r.get('why_not', '')}")
        cards.append(f'<div class="c-card"><div class="c-card-title">{_esc(r["label"])}</div>'
                     f'<div class="c-pair a-triple">{images}</div>'
                     f'<div class="c-time">{_esc(row_speedup_text(r))} vs eager fp32</div>'
                     f'<div class="c-drift">worst sample: {_esc(drift)}</div>'
                     f'<div class="c-note">{_esc(verdict)}</div></div>')
    return '<div class="c-cards">' + "".join(cards) + "</div>" if cards else ""


RUNNING = "**Running** · "


def advisor_messages(child):
    """The messages a `python -m bench advise --progress-json` child writes (one JSON object a line:
    {"progress", "total", "desc"} while it runs, then {"result"}); its stderr is kept in the list returned
    first, for the failure message."""
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(child.stderr), daemon=True).start()
    yield errors
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in child.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    while (line := _next_line(lines)) is not None:
        if line == TICK:
            yield {"tick": True}
            continue
        try:
            yield json.loads(line)
        except ValueError:
            continue


TICK = ""  # no line from the child for TICK_S: the bar moves with the clock (a compile sends none for minutes)
TICK_S = 1.0


def _next_line(lines: queue.Queue):
    try:
        return lines.get(timeout=TICK_S)
    except queue.Empty:
        return TICK


class AdvisorBar:
    """The Advisor's bar in seconds of its budget: the child's last word, moved on by the clock between its
    messages (it sent "28/60" and nothing else for as long as a compile ran)."""

    def __init__(self, progress):
        self.progress, self.done, self.total, self.desc = progress, 0, None, "starting"
        self.at = time.monotonic()

    def show(self, message: dict) -> str:
        """The bar for a child's message or a tick; returns the status line's words."""
        if "progress" in message:
            self.done, self.total, self.desc = message["progress"], message["total"], message["desc"]
            self.at = time.monotonic()
        since = time.monotonic() - self.at
        if not self.total:
            return self.desc
        done = min(self.total, self.done + since)
        on_it = f" ({since:.0f} s on it)" if since >= 2 else ""
        self.progress((round(done), self.total), desc=f"advisor: {self.desc}{on_it}", unit="s")
        return f"{done:.0f} s of {self.total} s: {self.desc}{on_it}"


def running(what: str) -> str:
    return RUNNING + what


def checked_size(text) -> str:
    """A memory bound as the advisor takes it ("16GiB"), or gr.Error saying how to write one."""
    from engine.serving.budget import parse_size

    try:
        size = parse_size(str(text).strip()[:40])
    except ShowcaseError as exc:
        raise gr.Error(f"max memory: {exc}", title="Invalid request") from None
    if not size:
        raise gr.Error("max memory: write a size such as 16GiB or 512MiB", title="Invalid request")
    return str(size)


@dataclass(frozen=True)
class AdvisorForm(params.form_class("AdvisorFields", ("preset", "device", "size", "steps", "lora"))):
    """The tab's inputs, by name (the handler takes them through Gradio's inputs_kwargs): the request fields it
    measures for (keyword-only, as declared; `lora`: a style measured unfused and fused), then its own."""

    max_minutes: float | None = 5
    fidelity_points: float | None = None
    min_psnr: float | None = None
    max_memory: str | None = None  # "16GiB": the pick's measured peak must fit (memory levers measured too)


class AdvisorHandlers(HandlerBase):
    def advise(self, progress=gr.Progress(), **form):  # noqa: B008
        """Run the advisor (`form`: AdvisorForm's fields); streams (report markdown, results JSON, status
        line). Closing the handler (Cancel) ends the child process and its compile workers (advise_ended then
        says it was cancelled)."""
        if self.serving.public():
            raise gr.Error("the advisor loads and compiles many engines: a host operation, not offered in "
                           "public mode", title="Not allowed")
        child = self.start_advisor(AdvisorForm(**form))
        messages = advisor_messages(child)
        errors = next(messages)
        progress(0, desc="advisor: starting (loads the model once per precision)")
        yield gr.skip(), gr.skip(), running("starting: loads the model once per precision")
        result, bar = None, AdvisorBar(progress)
        try:
            for message in messages:
                if "progress" in message or "tick" in message:
                    yield gr.skip(), gr.skip(), running(bar.show(message))
                elif "result" in message:
                    result = message["result"]
            child.wait()
        finally:
            if child.poll() is None:  # Cancel (Gradio closed the handler): the child and its compile workers
                os.killpg(child.pid, signal.SIGTERM)
                try:
                    child.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
        if result is None:
            failure = f"the advisor failed: {''.join(errors[-5:])[-800:]}"
            yield gr.skip(), gr.skip(), f"**Failed:** {failure}"
            raise gr.Error(failure, title="Advisor failed")
        done = f"**Done** in {result.get('elapsed_s', 0):.0f} s: the pick and every measured configuration are below."
        captions = [advisor_views.frontier_caption(result), advisor_views.memory_frontier_caption(result)]
        yield "\n\n".join([advice_summary(result), *filter(None, captions)]), result, done

    def advise_ended(self, status: str | None):
        """After the advisor's event, however it ended: a status still "running" means Cancel closed it."""
        if not (status or "").startswith(RUNNING):
            return gr.skip()
        return f"**Cancelled** (at {status[len(RUNNING):].strip()}): the advisor process was stopped; no pick."

    def start_advisor(self, form: AdvisorForm) -> subprocess.Popen:
        """`python -m bench advise --progress-json` in a child process of its own session (one JSON message
        a line on stdout: progress, then the result)."""
        try:
            model = self.serving.preset(form.preset)
        except Exception as exc:
            raise to_gradio_error(exc) from None
        argv = [sys.executable, "-m", "bench", "advise", "--preset", model.name, "--device", form.device or "auto",
                "--max-minutes", str(float(form.max_minutes or 5)), "--progress-json",
                "--cache-dir", str(self.serving.cache_dir)]
        if form.size:
            argv += ["--size", str(form.size)]
        if form.steps:
            argv += ["--steps", str(int(form.steps))]
        if form.fidelity_points not in (None, ""):
            argv += ["--fidelity-points", str(float(form.fidelity_points))]
        if form.min_psnr not in (None, "", 0):
            argv += ["--min-psnr", str(float(form.min_psnr))]
        if form.lora not in (None, "", "none"):
            argv += ["--lora", str(form.lora), "--loras"]
        if str(form.max_memory or "").strip():
            argv += ["--max-memory", checked_size(form.max_memory)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), pythonpath()]))}
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    def advisor_defaults(self, preset: str):
        sizes = self.preset_sizes(preset)
        model = self.serving.preset(preset)
        return (gr.update(choices=sizes, value=sizes[0] if sizes else None), gr.update(value=model.steps),
                gr.update(choices=views.lora_choices(model, self.serving.lora_slot()), value="none"))

    def render_advice(self, result: dict | None):
        """The frontier plots (seconds against quality, and against the measured peak GiB), the table and the
        apply button's state."""
        rows = table_rows(result)
        frame = pd.DataFrame(advisor_views.advisor_points(result), columns=advisor_views.ADVISOR_POINT_COLUMNS)
        frame = frame.astype({"s_per_image": "float64", "quality": "float64", "configuration": "string",
                              "verdict": "string"})
        # x ticks carry 3 significant digits: a span of at least 20 % of the time keeps them distinct
        x_lim = advisor_views.padded_limits(frame["s_per_image"], min_share=advisor_views.TIME_AXIS_SHARE)
        y_lim = advisor_views.padded_limits(frame["quality"])
        plot = gr.update(value=frame, x_lim=x_lim, y_lim=y_lim)
        table = pd.DataFrame(rows, columns=COLUMNS)
        pick = (result or {}).get("pick")
        return plot, memory_plot(result), table, gr.update(
            interactive=pick is not None, value=f"Apply {pick['label']} in Generate" if pick else "Apply in Generate"), \
            advisor_cards_html(result)

    def apply_advice(self, result: dict | None):
        """Generate's fields named in APPLIED, in that order: precision, mode, step cache and memory levers (and its preset, device, size, steps) from
        the pick."""
        pick = (result or {}).get("pick")
        if not pick:
            raise gr.Error("no pick to apply: run the advisor first", title="Nothing to apply")
        gr.Info(f"Generate now uses {pick['label']}", duration=4)
        lora = parse_lora(result.get("lora"))
        return (gr.update(value=result["preset"]), gr.update(value=result["device"]),
                gr.update(value=pick["precision"]), gr.update(value=pick["mode"]),
                gr.update(value=pick["step_cache"]), gr.update(value=result["size"]),
                gr.update(value=result["steps"]), gr.update(value=lora.name or "none"),
                gr.update(value=bool(pick.get("lora_fused"))),
                gr.update(value=pick.get("memory") or ("" if self.serving.public() else "none")),
                gr.Tabs(selected="generate"))


def memory_plot(result: dict | None):
    """The speed-memory plot's update: seconds per image against the measured peak GiB."""
    frame = pd.DataFrame(advisor_views.memory_points(result), columns=advisor_views.ADVISOR_MEMORY_COLUMNS)
    frame = frame.astype({"s_per_image": "float64", "peak_gib": "float64", "configuration": "string",
                          "verdict": "string"})
    return gr.update(value=frame, x_lim=advisor_views.padded_limits(frame["s_per_image"],
                                                                    min_share=advisor_views.TIME_AXIS_SHARE),
                     y_lim=advisor_views.padded_limits(frame["peak_gib"]))


def build(h: AdvisorHandlers, settings, tabs: gr.Tabs) -> None:
    """The tab (inside gr.Tabs); `settings`: the Generate tab's widgets by field name (ui.generate.build)."""
    preset = h.default_preset()
    report = h.devices_report()
    sizes = [str(s) for s in preset.buckets]
    with gr.Tab("Advisor", id="advisor"):
        gr.Markdown(
            "Measures what this engine can run here — precision × mode × step cache × attention backend — "
            "and names the **fastest configuration within a quality bound**: a PSNR floor against eager fp32's "
            "image of the same prompt and seed (any model) and, on models with a pixel checker, fidelity within "
            "N points of eager fp32. Speedups are medians of images timed round-robin with eager fp32, with "
            "their spread and image count; a spread across 1.0× says there is no measurable difference. What cannot "
            "run here, or would not fit the time budget, is skipped and listed. A step cache is picked only "
            "where it measured faster than the same configuration without it.")
        with gr.Row():
            a_preset = gr.Dropdown(h.serving.visitor_presets(), value=preset.name, label="Model preset",
                                   elem_id="a-preset")
            a_device = gr.Dropdown(views.device_choices(report, short=True), value=h.defaults.device,
                                   label="Device", elem_id="a-device")
            a_size = gr.Dropdown(sizes, value=sizes[0], label="Size", elem_id="a-size")
            a_steps = gr.Number(value=preset.steps, precision=0, minimum=1, label="Steps", elem_id="a-steps")
            a_lora = gr.Dropdown(views.lora_choices(preset, h.serving.lora_slot()), value="none",
                                 label="LoRA style (measured unfused and, eager, fused)", elem_id="a-lora")
        with gr.Row():
            minutes = gr.Slider(1, 30, value=5, step=0.5, label="Time budget (minutes)", elem_id="a-minutes")
            points = gr.Number(value=DEFAULT_FIDELITY_POINTS, minimum=0, label="Fidelity: at most this many points "
                               "below eager fp32", elem_id="a-fidelity-points")
            psnr = gr.Number(value=0, minimum=0, label=f"PSNR floor in dB (0: {DEFAULT_MIN_PSNR:g}, or "
                             f"{CHECKER_MIN_PSNR:g} on models with a checker)", elem_id="a-min-psnr")
            max_memory = gr.Textbox(value="", label="Fastest within this memory (e.g. 16GiB; empty: no bound; "
                                    "memory levers are measured too)", elem_id="a-max-memory")
        with gr.Row():
            run_btn = gr.Button("Measure and advise", variant="primary", elem_id="advise-btn")
            cancel_btn = gr.Button("Cancel", variant="stop", elem_id="a-cancel-btn")
            apply_btn = gr.Button("Apply in Generate", interactive=False, elem_id="a-apply-btn")
        # Its progress bar is drawn here, right under the buttons (never in an empty, zero-height box).
        status = gr.Markdown("Not run yet: a run takes about the time budget.", elem_id="a-status")
        with gr.Row():  # the plot at half the page's width: a full-width axis draws ~30 crowded ticks
            summary = gr.Markdown(elem_id="a-summary")
            frontier = gr.ScatterPlot(x="s_per_image", y="quality", color="verdict", title="Speed–quality frontier",
                                      x_title="s per image (lower is faster)", y_title="fidelity % / PSNR dB",
                                      color_title="", x_axis_format=".3~r", y_axis_format=".4~r",
                                      tooltip=["configuration", "s_per_image", "quality", "verdict"], height=340,
                                      elem_id="a-frontier")
            memory_frontier = gr.ScatterPlot(x="s_per_image", y="peak_gib", color="verdict", title="Speed–memory "
                                             "frontier", x_title="s per image (lower is faster)",
                                             y_title="measured peak GiB (lower fits more)", color_title="",
                                             x_axis_format=".3~r", y_axis_format=".3~r", height=340,
                                             tooltip=list(advisor_views.ADVISOR_MEMORY_COLUMNS),
                                             elem_id="a-memory-frontier")
        cards = gr.HTML(elem_id="a-cards", label="Each configuration: its image, eager fp32's, the difference")
        table = gr.Dataframe(headers=COLUMNS, interactive=False, wrap=True, label="Every configuration",
                             column_widths=advisor_views.ADVISOR_WIDTHS, elem_id="a-table")
        with gr.Accordion("Advisor JSON (also saved under the cache folder)", open=False):
            result = gr.JSON(elem_id="a-json")

    a_preset.change(h.advisor_defaults, a_preset, [a_size, a_steps, a_lora], **FAST)
    form = {"preset": a_preset, "device": a_device, "size": a_size, "steps": a_steps, "max_minutes": minutes,
            "fidelity_points": points, "min_psnr": psnr, "lora": a_lora, "max_memory": max_memory}
    run = run_btn.click(h.advise, None, [summary, result, status], inputs_kwargs=form, api_name="advise", api_visibility="private",
                        concurrency_id=ADVISOR_QUEUE, concurrency_limit=1, show_progress="full",
                        show_progress_on=[status])
    cancel_btn.click(None, cancels=[run])
    run.then(h.advise_ended, status, status, **FAST)
    result.change(h.render_advice, result, [frontier, memory_frontier, table, apply_btn, cards], **FAST)
    apply_btn.click(h.apply_advice, result, [settings[name] for name in APPLIED] + [tabs], **FAST)
