"""One Compare handler call (ui/compare.py's `compare`): its form, who runs it, and its run (`Comparison`): the
quality images of every configuration, which also warm it, then the paired timing rounds with the reference.

A video preset's configurations each run a clip (the form's frame count and rate, the fields its family
declares); its card's clip, per-frame drift and flicker come from ui/compare_clips.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass

import gradio as gr

import bench.configs as explicit
from bench.paired import PairedTiming, current_marks, engine_marks
from engine.config.request import ImageRequest
from engine.config.validation import check_steps
from engine.errors import Cancelled, ShowcaseError
from engine.protocol import Size, params
from engine.serving import stream
from engine.serving.interface import Caller, Serving, Uploads
from ui import compare_clips, compare_views, edit_inputs, views, waiting
from ui.common import to_gradio_error
from ui.runs import HEARTBEAT_S, ProgressBar

MAX_FIDELITY_PROMPTS = 32
DEFAULT_FIDELITY_PROMPTS = 8
DEFAULT_TIMING_S = 30.0  # seconds of round-robin timing after the quality images
MAX_TIMING_S = 600.0
TIMING_MIN_ROUNDS, TIMING_MAX_ROUNDS = 3, 12
FIDELITY_SEED = 1000  # the fidelity prompts' seeds: FIDELITY_SEED, FIDELITY_SEED + 1, ...


@dataclass(frozen=True)
class CompareForm(params.form_class("CompareFields", ("prompt", "preset", "size", "steps", "guidance", "seed"))):
    """What /compare takes, in its API's order (gradio_client callers pass them positionally: never reorder): the
    request fields every configuration shares (as declared), then Compare's own axes; the handler takes them by
    name."""

    devices: list[str] | None
    precisions: list[str] | None
    modes: list[str] | None
    wait_for_warm: bool = True
    caches: list[str] | None = None
    fidelity_prompts: int | None = DEFAULT_FIDELITY_PROMPTS
    configurations: str | None = None
    timing_s: float | str | None = DEFAULT_TIMING_S
    loras: list[str] | None = None  # "none", "NAME" or "NAME:fused": one more axis of the cross product
    levers: list[str] | None = None  # "none" or a memory lever set (MEMORY_CHOICES): one more axis
    images: list | None = None  # presets that edit: every configuration edits these (ui/edit_inputs.py)
    num_frames: int | str | None = None  # video presets: every configuration's clip (ui/compare_clips.py)
    fps: int | str | None = None


@dataclass(frozen=True)
class CompareCall:
    """Who runs a comparison and what it uses of the handlers (their callables, never the handlers)."""

    caller: Caller
    client: str  # whom the edge's admission holds the call against (HandlerBase.client_of)
    open_run: Callable  # () -> the call's run, registered for /cancel (HandlerBase.open_run)
    key_for: Callable  # (preset, device, precision, caller=) -> the engine key, memoised
    run_feed: Callable  # (key, bar, steps) -> what a run shows on the progress bar
    configs: tuple[list[str], str, bool]  # the configurations, the reference, whether it was picked
    refused: dict[str, str]  # configuration -> why it cannot run here



class Comparison:
    """One Compare handler call: its plan (configurations, prompts, the progress bar's steps), then its
    phases: the quality images of each configuration, then the paired timing rounds. Streams
    (gallery, results, thumbnails) after each configuration and round."""

    def __init__(self, serving: Serving, form: CompareForm, call: CompareCall, progress):
        self.serving, self.form, self.call, self.progress = serving, form, call, progress
        self.configs, self.reference, picked = call.configs
        self.note = ("the reference, picked" if picked else
                     "the reference, added: every speedup and drift is measured against it")
        try:
            self.size_text = str(Size.parse(form.size)) if form.size else str(serving.preset(form.preset).buckets[0])
            self.model = serving.preset(form.preset)
            self.steps = check_steps(form.steps) if form.steps else self.model.steps
            self.sources = edit_inputs.sources(form.images)  # read once, bounded; decoded once when the run starts
            self.clip_fields = compare_clips.clip_request_fields(self.model, form)  # a video preset's frames and fps
        except ShowcaseError as exc:
            raise to_gradio_error(exc) from None
        self.timing_budget = self._timing_budget(form.timing_s)
        n_samples = max(0, min(MAX_FIDELITY_PROMPTS, int(form.fidelity_prompts or 0))) \
            if compare_views.has_checker(self.model) and not self.sources else 0  # text prompts: no edit
        self.n_samples = n_samples
        # The main prompt, then the sample prompts (seeded: every configuration draws the same ones).
        self.prompts = [form.prompt, *compare_views.fidelity_sample_prompts(self.model, n_samples, fallback=form.prompt)]
        self.seeds = [form.seed, *(FIDELITY_SEED + i for i in range(n_samples))]
        # What each picture is checked against: its prompt, or for an edit the source and instruction together
        # (set once the uploads are decoded, in `run`)
        self.samples = list(self.prompts)
        self.decoded = None  # the uploads decoded once, at the comparison's size: every configuration's images
        # A visitor's Compare is priced before it runs, timing rounds included, so theirs stop at the fewest
        # rounds that still give a spread; the host's grow until the spread is known or the budget ends.
        self.max_rounds = TIMING_MIN_ROUNDS if serving.priced(call.caller) else TIMING_MAX_ROUNDS
        self.rounds_cap = self.max_rounds if self.timing_budget > 0 else 0
        self.grand_total = len(self.configs) * (len(self.prompts) + self.rounds_cap) * self.steps
        self.results: list[dict] = []
        self.gallery: list[tuple] = []
        self.thumbnails: list[str] = []
        self.ref_images: list | None = None
        self.ref_clips: list | None = None  # a video preset's: the reference's clips' frames
        self.timing: dict = {"budget_s": self.timing_budget, "rounds": 0, "stop_reason": None}
        self.run_state = self.ticket = None
        self.last_yield = time.perf_counter()

    @staticmethod
    def _timing_budget(timing_s) -> float:
        try:
            return min(MAX_TIMING_S, max(0.0, float(DEFAULT_TIMING_S if timing_s is None else timing_s)))
        except (TypeError, ValueError):
            raise gr.Error(f"timing seconds must be a number from 0 to {MAX_TIMING_S:g}, not {timing_s!r}",
                           title="Invalid request", print_exception=False) from None

    def payload(self, done: bool = False) -> dict:
        return {"configs": self.configs, "done": done, "reference": self.reference, "results": self.results,
                "timing": self.timing, "speedup": compare_views.speedup_table(self.results)}

    def outputs(self, done: bool = False) -> tuple:
        return self.gallery, self.payload(done), self.thumbnails

    def run(self):
        """The whole comparison: admitted (and, for a visitor, priced as a whole), then its two phases."""
        serving = self.serving
        with ExitStack() as stack:
            try:  # public mode: one running request per visitor, priced as a whole before anything runs
                self.run_state = stack.enter_context(self.call.open_run())
                self._decode_sources()  # after the visitor's run is held: nothing is decoded for a refused one
                images = len(self.configs) * (len(self.prompts) + self.rounds_cap)
                price = serving.price_compare(self.form.preset, self.size_text, self.steps, len(self.configs),
                                              len(self.prompts) + self.rounds_cap, self.form.guidance,
                                              caller=self.call.caller, num_frames=self.clip_fields.get("num_frames"))
                if self.decoded is not None:  # every image's references, and decoding them once
                    price = serving.price_uploads(self.form.preset, self.size_text, self.steps, images, price,
                                                  Uploads(len(self.sources), self.decoded.pixels), self.call.caller)
                self.ticket = stack.enter_context(serving.admission(self.call.client, price, self.call.caller))
            except ShowcaseError as exc:
                raise to_gradio_error(exc) from None
            yield self.outputs()  # the page shows this comparison from now on
            self.last_yield = time.perf_counter()
            for index, config in enumerate(self.configs):
                yield from self.quality_images(index, config)
            yield from self.timing_rounds()
        yield self.outputs(done=True)
        if all(r.get("error") for r in self.results):
            failures = "; ".join(f"{r['config']}: {r['error']}" for r in self.results)
            raise gr.Error(f"every configuration failed: {failures}", title="Compare failed")

    def _decode_sources(self) -> None:
        """The uploads decoded and resized to the comparison's size once (the gate's own code): each
        configuration's admission takes them as they are; an edit's checker compares against the source."""
        if not self.sources:
            return
        from engine.config.images import decode_inputs

        self.decoded = decode_inputs(self.model, self.sources, None, None, self.call.client).fitted(
            Size.parse(self.size_text))
        if compare_views.has_checker(self.model):
            self.samples[0] = compare_views.edit_sample(self.model, self.form.prompt, self.decoded.images[0])

    def draw(self, config: str, text: str, seed, desc: str, offset: int):
        """One image of `config` through the engine; yields heartbeats, returns (result, seconds)."""
        spec = self.image_request(config, text, seed)
        key = self.call.key_for(spec.preset, spec.device, spec.precision, caller=self.call.caller)
        bar = ProgressBar(self.progress, desc_prefix=desc, offset=offset, grand_total=self.grand_total)
        feed = self.call.run_feed(key, bar, spec.steps, waiting.compile_bucket(spec.mode, self.size_text, spec.on_cold))
        started = time.perf_counter()
        run = self.serving.events(spec, key=key, run=self.run_state, ticket=self.ticket)
        with closing(stream.blocking(run)) as events:
            for event in events:
                feed.see(event)
                if (result := stream.result_of(event)) is not None:
                    return result, time.perf_counter() - started
                if time.perf_counter() - self.last_yield >= HEARTBEAT_S:
                    self.last_yield = time.perf_counter()
                    yield gr.skip(), gr.skip(), gr.skip()  # a heartbeat: Gradio can close the handler here
        raise RuntimeError("the engine ended the request without a result")

    def image_request(self, config: str, text: str, seed) -> ImageRequest:
        """What one image of `config` asks the engine for: its device, precision, mode, step cache and LoRA
        (every configuration is priced the same way; a LoRA's is just one more lever)."""
        device, precision, mode, cache = compare_views.parse_config(config)
        lora = explicit.split_lora(config)[1]
        form = self.form
        return ImageRequest(form.preset, prompt=text, device=device, precision=precision, mode=mode,
                            size=self.size_text, steps=self.steps, guidance=form.guidance, seed=seed,
                            on_cold="wait" if form.wait_for_warm else "eager",
                            step_cache=None if cache == views.NO_CACHE else cache, caller=self.call.caller,
                            lora=lora.text(), lora_fused=lora.fused, memory=explicit.split_levers(config)[1] or None,
                            images=self.sources, decoded=self.decoded, **self.clip_fields)

    # -- phase 1: quality images, one configuration after another (they also warm each one) ------------
    def quality_images(self, index: int, config: str):
        reference, results = self.reference, self.results
        if self.run_state.cancelled:
            results.append({"config": config, "error": "cancelled before it started"})
            return
        if config in self.call.refused:
            results.append({"config": config, "error": f"not run: {self.call.refused[config]}", "refused": True,
                            "reference": config == reference})
            yield self.outputs()
            return
        outcomes = []
        runs_each = len(self.prompts)
        try:
            for i, (text, seed) in enumerate(zip(self.prompts, self.seeds, strict=True)):
                desc = f"{config}: " if i == 0 else f"{config} fidelity prompt {i}/{self.n_samples}: "
                outcomes.append((yield from self.draw(config, text, seed, desc, (index * runs_each + i) * self.steps)))
        except ShowcaseError as exc:
            if isinstance(exc, Cancelled):
                gr.Warning(str(exc), title="Cancelled", duration=4)
            results.append({"config": config, "error": explicit.first_line(str(exc)), "reference": config == reference})
            yield self.outputs()
            return
        except Exception as exc:
            results.append({"config": config, "error": f"internal error ({type(exc).__name__})"})
            yield self.outputs(done=True)  # settled, so it is not taken for a cancel
            raise to_gradio_error(exc) from None
        entry = self.entry(config, outcomes)
        results.append(entry)
        yield self.outputs()

    def entry(self, config: str, outcomes: list) -> dict:
        """A configuration's result from its quality images: timings, bucket costs, drift, fidelity, its card's
        pictures (added to the gallery and the thumbnails)."""
        result, elapsed = outcomes[0]
        waited_s = max(0.0, elapsed - result.timings.total_ms / 1000)
        warmup_ms = [r.timings.total_ms for r, _ in outcomes]
        entry = {**result.as_dict(), "config": config, "waited_s": waited_s, "image_ms": warmup_ms,
                 "warmup_image_ms": warmup_ms}
        is_reference = config == self.reference
        if is_reference:
            entry.update(reference=True, reference_note=self.note)
        mode = compare_views.parse_config(config)[2]
        bucket = compare_views.find_bucket(self.serving.status_rows(), entry["engine"], mode, entry["bucket"])
        if bucket:
            entry.update(compile_s=bucket.get("compile_s"), warmup_s=bucket.get("warmup_s"),
                         bucket_state=bucket.get("state"), cache_hits=bucket.get("cache_hits"))
        images = [r.image() for r, _ in outcomes]
        clips = [r.frames() for r, _ in outcomes] if outcomes[0][0].num_frames else None  # as the MP4 plays them
        if is_reference:
            self.ref_images, self.ref_clips = images, clips
        if clips is None:
            lora = explicit.split_lora(config)[1]
            style = lora.name if lora.scale != 0 else None  # a style's cards are checked as the style implies
            entry.update(compare_views.price_quality(images, self.samples, None if is_reference else self.ref_images,
                                                     self.model, style))
        else:
            reference = None if is_reference or self.ref_clips is None else (self.ref_clips, self.ref_images)
            entry.update(compare_views.clip_quality(clips, images, self.prompts, reference, self.model))
            entry["strip"] = [(self.thumbnail(picture), caption)
                              for picture, caption in compare_clips.strip_pictures(clips[0])]
        entry["image_index"] = self.thumbnail(images[0])
        if not is_reference and self.ref_images is not None:
            entry["heatmap_index"] = self.thumbnail(self.heatmap(entry, images, clips))
        entry["gallery_index"] = len(self.gallery)
        self.gallery.append((images[0], compare_views.caption(entry)))
        return entry

    def thumbnail(self, picture) -> int:
        """Adds a card's picture to the thumbnails: its index there."""
        self.thumbnails.append(compare_views.thumbnail_uri(picture))
        return len(self.thumbnails) - 1

    def heatmap(self, entry: dict, images: list, clips: list | None):
        """The card's heat map against the reference: of its image, or of its clip's worst frame."""
        if clips is None or self.ref_clips is None:
            return compare_views.difference_picture(images[0], self.ref_images[0])
        frame = compare_clips.worst_frame(entry)
        entry["heatmap_frame"] = frame + 1
        return compare_views.difference_picture(clips[0][frame], self.ref_clips[0][frame])

    # -- phase 2: timing, round-robin with the reference (the start rotating) until each spread is known --
    def timing_rounds(self):
        entries = {r["config"]: r for r in self.results if not r.get("error")}
        cancelled = self.run_state.cancelled
        if entries.get(self.reference) is None or cancelled or self.timing_budget <= 0:
            self.timing["stop_reason"] = ("cancelled" if cancelled else "no timing budget"
                                          if self.timing_budget <= 0 else "the reference did not run: no speedups")
            return
        plan = PairedTiming(list(entries), reference=self.reference, budget_s=self.timing_budget,
                            min_rounds=TIMING_MIN_ROUNDS, max_rounds=self.max_rounds)
        for config, r in entries.items():
            plan.warm[config] = {k: r.get(k) for k in ("compile_s", "warmup_s", "waited_s")}
        started, round_index = time.perf_counter(), 0
        self.done_images = len(self.configs) * len(self.prompts)
        while not self.run_state.cancelled:
            elapsed = time.perf_counter() - started
            if not plan.another_round(elapsed, elapsed / round_index if round_index else None):
                break
            yield from self.timing_round(plan, round_index, entries)
            round_index += 1
            compare_views.apply_timing(plan, entries)
            for entry in entries.values():
                i = entry["gallery_index"]
                self.gallery[i] = (self.gallery[i][0], compare_views.caption(entry))
            self.timing.update(rounds=plan.rounds, stop_reason=plan.stop_reason)
            yield self.outputs()
            if "error" in plan.warm.get(self.reference, {}):
                plan.stop_reason = "the reference failed while timed"
                break
        compare_views.apply_timing(plan, entries)
        self.timing.update(rounds=plan.rounds, stop_reason="cancelled" if self.run_state.cancelled else plan.stop_reason)
        self.progress((self.grand_total, self.grand_total),
                      desc=f"timed {plan.rounds} rounds: {self.timing['stop_reason']}", unit="steps")

    def timing_round(self, plan: PairedTiming, round_index: int, entries: dict[str, dict]):
        """One image of each configuration, in the round's order; one that fails is no longer timed."""
        own = {r.get("engine") for r in entries.values()}
        all_images = len(self.configs) * (len(self.prompts) + self.rounds_cap)
        for config in plan.order(round_index):
            if self.run_state.cancelled:
                break
            before = self.marks(own)
            try:
                result, _ = yield from self.draw(config, self.form.prompt, self.form.seed,
                                                 f"timing round {round_index + 1}: {config}: ",
                                                 self.done_images * self.steps)
            except Exception as exc:  # it is no longer timed; the others go on
                why = explicit.first_line(str(exc)) if isinstance(exc, ShowcaseError) else \
                    f"internal error ({type(exc).__name__})"
                plan.warm[config]["error"] = entries[config]["timing_error"] = why
                if config == self.reference:
                    break
                continue
            self.done_images = min(self.done_images + 1, all_images)
            plan.record(round_index, config, result.timings.total_ms, dict.fromkeys(before + self.marks(own)))

    def marks(self, own: set) -> list[str]:
        """What else ran on the machine meanwhile (compiles, other engines' work, a load spike)."""
        try:
            compiles = self.serving.host_status().get("compiles")
            return current_marks(lambda: engine_marks(self.serving.status_rows(), own, compiles))
        except Exception:  # a status read must not end the measurement
            return current_marks()
