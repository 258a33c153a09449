"""The app as an MCP server (`app.py --mcp`, SHOWCASE_MCP=1): Gradio serves every public API endpoint as an
MCP tool over Streamable HTTP at /gradio_api/mcp/ (`launch(mcp_server=True)`, the optional `mcp` extra).

A tool call is an event of the app's own queue, joined in this process with the agent's own HTTP request
(`AgentCalls`; Gradio's way, one gradio_client shared by every agent over loopback, let one agent fill it),
so public mode's bounds hold per agent as they do per page: the visitor's choices, one running request
per agent, the per-client bound of ui/edge.py (the edge names the agent by its address, see
`Callers.mark_mcp_caller` in ui/edge.py), the cost budget, host operations only with admin_token. A refusal reaches the
agent as a tool error carrying the app's message; a call whose agent hangs up is cancelled.

Here: the tools' names (the endpoints', not the handlers' function names) and descriptions an agent can act
on, and the `mcp` package check. The advisor measures for minutes, longer than a tool call should wait:
it is a start/poll pair (/advise_start returns a job at once, /advise_poll reports its progress and, once
done, its pick), a host operation like the Advisor tab's.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import hmac
import json
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from functools import partial

import gradio as gr

from engine.config.request import API_FIELDS
from engine.protocol import params
from engine.serving.interface import Caller
from ui import schemas
from ui.advisor import (
    CHECKER_MIN_PSNR,
    DEFAULT_FIDELITY_POINTS,
    DEFAULT_MIN_PSNR,
    AdvisorForm,
    AdvisorHandlers,
    advisor_messages,
)
from ui.common import document_api

log = logging.getLogger(__name__)

MCP_PATH = "/gradio_api/mcp/"
FILE_INPUTS = ("images", "mask")  # /generate's uploads: optional (text to image sends none)
FILE_LIST_ITEMS = 16  # the files of a list a tool call may send (engine/config/images.py MAX_IMAGES)
FILE_NOTE = (" To edit a picture, images is a list of image URLs: http(s)://... or data:image/png;base64,... (the "
             "first is the source; a preset that edits, e.g. tiny-shapes-edit with 'make the circle green'; FLUX.2 "
             "presets take several references); mask, one such URL, white where an inpaint preset repaints; "
             "strength 0-1 for img2img / inpaint presets. Leave them out for text to image. generate_video: images "
             "is one such URL for an image-to-video preset (tiny-wan-i2v, wan2.1-i2v-14b-480p), the clip's first "
             "frame; none for text to video.")
# endpoint -> what an agent reads in tools/list (parameters are listed by Gradio with their types)
DESCRIPTIONS = {
    "generate": (
        "Generate one image with a diffusers pipeline kept compiled and warm on this server. Returns the image "
        "(PNG), then its timings as a JSON object (json.loads it): request_id, engine, mode, bucket (the size it "
        "ran at), seed, steps, warm (a compiled graph served it), eager_fallback, recompiles, notices (e.g. a size "
        "snapped to its bucket), batch_size, peak_memory_bytes and timings {step_ms: [one per step], encode_ms, "
        "denoise_ms, decode_ms, total_ms, queued_ms}. Every parameter is text; empty means the default. The default "
        "model tiny-shapes draws 'a {colour} {circle|square|triangle} on a {colour} background'. "
        + "; ".join(f"{name}: {text}" for name, text in params.field_help(None, API_FIELDS).items()
                    if name not in FILE_INPUTS)
        + ". A request the server does not offer fails with the reason and what to change."),
    "generate_video": (
        "Generate one short clip with a video preset (tiny-wan, Wan 2.x: text to video; tiny-wan-i2v and "
        "wan2.1-i2v-14b-480p: from a source image, images = [one image URL], the clip's first frame). Returns the "
        "MP4, its frames "
        "and its timings as JSON (frames, fps, step_ms, encode_ms, denoise_ms, decode_ms, total_ms, video_encode_ms, "
        "recompiles, peak memory, notices). preset: a video preset; size 'WxH' (one of its buckets); num_frames: "
        "snapped to its frame buckets (4k + 1 for Wan, e.g. 9, 17, 33); fps; steps, guidance, seed: numbers; mode: "
        "eager, compile or regional. A clip costs its frames x size in the visitor's budget."),
    "compare": (
        "Run one prompt, seed, size and steps on 1-6 device x precision x mode (x step cache) configurations and "
        "return the images and a JSON object of each one's seconds per image, speedup against eager fp32, drift "
        "(PSNR against eager fp32's image) and, for tiny-shapes, fidelity. On a video preset (tiny-wan) each "
        "configuration runs the clip num_frames and fps ask for: seconds per clip, per-frame drift against eager "
        "fp32's clip and its flicker (how much the difference changes frame to frame, in pixel levels). Takes as long "
        "as all of them together (seconds on tiny models, longer for compiled modes on a cold bucket)."),
    "status": ("Every loaded engine and each resolution bucket's state, as a JSON list: [{engine, state (loading, "
               "ready, down), load_s, notices, pending, buckets: [{mode, size, batch, state (cold, queued, "
               "compiling, warm, failed), compile_s, warmup_s, requests_served}]}]. Fast; call it to see what is "
               "warm before generate, or to follow a warm."),
    "system": ("The server as a JSON object: devices [{name, available, reason (why not), modes}], versions, "
               "caches, host (budgets, the hosting policy: what visitors may choose), web_server (its bounds)."),
    "warm": ("Compile and warm one bucket ('WxH') of an engine in the background, or all of them ('' or 'all'); "
             "returns at once with JSON {engine, mode, queued: [sizes]}; poll status until the bucket is warm. On a "
             "public server a visitor may warm one bucket of the engine their last request ran on; the rest needs "
             "admin_token."),
    "cancel": ("Cancel this caller's running generate or compare between steps; that call then returns "
               "cancelled=true. Returns nothing."),
    "advise_start": (
        "Start the advisor: it measures every precision x mode x step cache x attention backend this server can "
        "run for a preset and device, and picks the fastest configuration within a quality bound (fidelity "
        "within fidelity_points of eager fp32 on tiny-shapes, else PSNR >= min_psnr dB). Returns at once with "
        "JSON {job, state: running, progress, desc, elapsed_s}; it runs for up to max_minutes: call advise_poll "
        "with the job id every few seconds. One run at a time; on a public server only with admin_token."),
    "advise_poll": ("The state of an advisor job as JSON {job, state (running, done, failed, cancelled), progress: "
                    "[measured, total], desc, elapsed_s, error, result}; once done, result.pick is the "
                    "recommendation (preset, device, precision, mode, step_cache, attention; null: none) and "
                    "result.rows every configuration measured. Pass cancel='true' to stop it."),
    "restart": ("Restart an engine (a new worker process; its buckets warm again from the compile cache); returns "
                "JSON {engine, restarted}. On a public server only with admin_token."),
}


def describe_tools(demo) -> None:
    """Give the public endpoints the descriptions above (Gradio's API page shows them too)."""
    for fn in demo.fns.values():
        text = DESCRIPTIONS.get(fn.api_name or "")
        if text and fn.api_description is None:
            fn.api_description = text


def missing() -> str | None:
    """Why the MCP server cannot run here (the `mcp` package absent or a 2.x one), or None."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python 3.11 has it
        return None
    try:
        found = version("mcp")
    except PackageNotFoundError:
        return 'the MCP server needs the mcp extra: pip install ".[mcp]" (or: pip install "gradio[mcp]" "mcp<2")'
    if int(found.split(".")[0]) >= 2:
        return f'mcp {found} is installed; Gradio\'s MCP server needs mcp 1.x: pip install "mcp>=1.21,<2"'
    return None


def serve(demo) -> None:
    """After launch(mcp_server=True): the tools take their endpoints' names (generate, compare, status, ...), a
    tool with several outputs returns each of them (generate: the image, then the timings), data outputs come as
    JSON text, each parameter's description is the one its API page shows, and a queued tool call joins the
    app's queue here, as its agent (AgentCalls), instead of through Gradio's one shared client."""
    server = getattr(demo, "mcp_server_obj", None)
    if server is None:
        return
    server.tool_to_endpoint = {server.tool_prefix + endpoint.lstrip("/"): endpoint
                               for endpoint in server.tool_to_endpoint.values()}
    optional_files(server.api_info)
    server.get_input_schema = url_lists(server.get_input_schema)
    calls = AgentCalls(demo, server)
    server._get_or_create_client = lambda: calls  # what call_tool submits a queued call to

    async def result(job, progress_token=None) -> list:  # noqa: ARG001 - Gradio passes a progress token
        return await job.result()

    server._execute_tool_without_progress = result
    server._execute_tool_with_progress = result
    describe = server.get_fn_description

    def described(block_fn, tool_name: str):
        # A parameter the handler's docstring does not describe keeps what document_api wrote (Gradio's own
        # empty text would replace it)
        description, parameters = describe(block_fn, tool_name)
        if description.endswith(server._file_data_tool_description):  # Gradio's note names a tool not served here
            description = description[:-len(server._file_data_tool_description)] + FILE_NOTE
        return description, {name: text for name, text in parameters.items() if text}

    server.get_fn_description = described
    postprocess = server.postprocess_output_data

    def as_json(data, root_url: str) -> list:
        return _no_server_paths(postprocess([_json_text(value) for value in data], root_url))

    server.postprocess_output_data = as_json


def _no_server_paths(contents: list) -> list:
    """Gradio adds "Image URL: …/gradio_api/file=<the app's cache folder>/….png" beside each image it sends
    inline: a server path an agent has no use for (the image is in the result)."""
    return [c for c in contents if not (getattr(c, "type", "") == "text" and "/gradio_api/file=" in c.text)]


def optional_files(api_info: dict) -> None:
    """A tool's file inputs (FILE_INPUTS) as optional parameters: Gradio marks a File without a value required,
    so an agent asking for text to image would have to send an image."""
    for endpoint in api_info.get("named_endpoints", {}).values():
        for parameter in endpoint.get("parameters", []):
            if parameter.get("parameter_name") in FILE_INPUTS and not parameter.get("parameter_has_default"):
                parameter.update(parameter_has_default=True, parameter_default=None)


def url_lists(get_input_schema):
    """Gradio's MCP schema of a list of files (/generate's images) as a list of URL strings. Gradio keeps a $ref
    to $defs it leaves inside the parameter (a client's validator cannot resolve it: "PointerToNowhere") and marks
    the list's items where a call's values sit at [name, 0], [name, 1], ... (so none would become a file)."""
    def schema(tool_name: str, parameters=None):
        simplified, positions = get_input_schema(tool_name, parameters)
        for name in {p[0] for p in positions if len(p) == 2 and p[1] == "items"}:
            node = simplified["properties"][name]
            simplified["properties"][name] = {
                "type": "array", "items": {"type": "string", "format": node["items"].get("format", "url")},
                **{key: node[key] for key in ("description", "default") if key in node}}
            positions = [p for p in positions if p[:1] != [name]] + [[name, i] for i in range(FILE_LIST_ITEMS)]
        return simplified, positions

    return schema


def _json_text(value):
    """A tool's data output (generate's timings, status, a job) as JSON text an agent can json.loads: Gradio
    writes any output that is not a file as str(), Python's repr. Outputs holding files stay Gradio's."""
    from gradio.data_classes import JsonData

    if isinstance(value, JsonData):  # generate_video's timings arrive as Gradio's pydantic root model
        value = value.root
    if not isinstance(value, (dict, list)):
        return value
    text = json.dumps(value, default=str)
    return value if '"gradio.FileData"' in text else text


class AgentCalls:
    """Each MCP agent is a visitor like any other. Gradio sends every tool call through one gradio_client of
    its own (one session, its thread pool, one event stream): twelve agents filled it, another agent's
    status waited seconds behind their calls, and a call whose agent hung up still ran to the end. Here a
    tool call joins the app's queue in this process with the agent's own HTTP request, so the web edge names
    the agent by its address (its signed header, ui/edge.py) and its per-client bound, the cost budget and
    the one-running-request rule hold per agent; each agent has a session of its own, named with a secret
    of this server (a visitor can neither choose nor guess it); a call whose agent hangs up is cancelled."""

    def __init__(self, demo, server):
        self.demo, self.server = demo, server
        self.fn_index = {fn.api_name: index for index, fn in demo.fns.items() if fn.api_name}
        self._secret = secrets.token_bytes(32)
        self._waiting: dict[str, dict[str, asyncio.Future]] = {}  # agent session -> event id -> its result
        self._readers: dict[str, asyncio.Task] = {}

    def session_of(self, agent: str) -> str:
        return "mcp-" + hmac.new(self._secret, agent.encode(), hashlib.sha256).hexdigest()[:32]

    def submit(self, *args, api_name: str, headers: dict | None = None) -> AgentCall:  # noqa: ARG002 - Gradio's call
        return AgentCall(partial(self.run, as_queue_join(self.server.mcp_server.request_context.request),
                                 self.fn_index[api_name.lstrip("/")], list(args)))

    async def run(self, request, fn_index: int, data: list) -> list:
        """Join the queue as the call's agent; the outputs, or RuntimeError with the app's message."""
        from gradio.data_classes import PredictBodyInternal

        queue, edge = self.demo._queue, self.demo.edge
        session = self.session_of(edge.callers.client_of(request))
        body = PredictBodyInternal(data=data, fn_index=fn_index, session_hash=session, event_data=None,
                                   trigger_id=None, request=request)
        with edge.streams.listener(session):  # the handler's listener check: the result is read here
            joined, event_id, _ = await queue.push(body=body, request=request, username=None)
            if not joined:
                raise RuntimeError(str(event_id))  # the edge's refusal, with what to do
            future = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(session, {})[event_id] = future
            if session not in self._readers or self._readers[session].done():
                # one reader per agent with calls waiting; finished ones are forgotten
                self._readers = {s: task for s, task in self._readers.items() if not task.done()}
                self._readers[session] = asyncio.create_task(self._read(session))
            try:
                message = await future
            except asyncio.CancelledError:  # the agent hung up: its call goes too
                await asyncio.shield(self._cancel(event_id))
                raise
            finally:
                waiting = self._waiting.get(session, {})
                waiting.pop(event_id, None)
                if not waiting:
                    self._waiting.pop(session, None)
        output = message.output or {}
        if not message.success:
            raise RuntimeError(output.get("error") or message.title or output.get("title") or "the call failed")
        return list(output["data"])

    async def _read(self, session: str) -> None:
        """Hand each completed event of the agent's session to its call, while the agent has calls waiting."""
        messages = self.demo._queue.pending_messages_per_session.get(session)
        while messages is not None and any(not f.done() for f in self._waiting.get(session, {}).values()):
            message = await messages.get()
            if getattr(message, "msg", None) == "process_completed":
                future = self._waiting.get(session, {}).get(message.event_id)
                if future is not None and not future.done():
                    future.set_result(message)

    async def _cancel(self, event_id: str) -> None:
        """What Gradio's /cancel does for one event: out of the queue, or its running task cancelled."""
        queue = self.demo._queue
        await queue.clean_events(event_id=event_id)
        tasks = [t for t in asyncio.all_tasks() if t.get_name().endswith(f"<gradio-sep>{event_id}")]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        log.info("cancelled MCP call %s: its agent hung up", event_id[:12])


def as_queue_join(request):
    """The agent's HTTP request as Gradio's queue takes an event's: at the app's queue/join route (Gradio
    finds the app's root URL for the outputs' file links from it), with state of its own."""
    from starlette.requests import Request

    scope = dict(request.scope)
    path = scope["path"]
    root = path[:path.index("/gradio_api/")] if "/gradio_api/" in path else ""
    scope.update(path=f"{root}/gradio_api/queue/join", raw_path=f"{root}/gradio_api/queue/join".encode(),
                 query_string=b"", state={})
    return Request(scope)


class AgentCall:
    """One queued tool call, as Gradio's call_tool holds it between submit and its result; `run` joins the
    queue as the agent (AgentCalls.run with the call's request, endpoint and inputs)."""

    def __init__(self, run: Callable[[], Awaitable[list]]):
        self._run = run

    async def result(self) -> list:
        return await self._run()


JOBS_KEPT = 16  # finished advisor jobs whose results stay readable (the oldest are forgotten first)


class AdviceJobs:
    """/advise_start and /advise_poll: the Advisor tab's child process, run in the background."""

    def __init__(self, handlers: AdvisorHandlers):
        self.h = handlers
        self._jobs: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()

    # gr.api builds the MCP tool's schema from this very signature, so its parameters stay loose.
    def start(self, preset: str, device: str = "auto", size: str = "", steps: str = "",  # noqa: PLR0913
              max_minutes: str = "5",
              fidelity_points: str = "", min_psnr: str = "", admin_token: str = "",
              request: gr.Request = None) -> dict:
        """Start the advisor in the background; returns {"job", "state"} at once (poll /advise_poll)."""
        if self.h.serving.public() and self.h.caller(request, admin_token) is not Caller.HOST:
            raise gr.Error("the advisor loads and compiles many engines: a host operation (admin_token) on this "
                           "public server", title="Not allowed")
        with self._lock:
            running = next((j for j in self._jobs.values() if j["state"] == "running"), None)
            if running is not None:
                raise gr.Error(f"advisor job {running['job']} is still running (one at a time): poll it, or cancel "
                               "it with advise_poll(job, cancel='true')", title="Busy")
            try:
                minutes = float(max_minutes or 5)
            except ValueError:
                raise gr.Error(f"max_minutes must be a number of minutes, not {max_minutes!r}",
                               title="Invalid request") from None
            child = self.h.start_advisor(AdvisorForm(preset=preset, device=device, size=size, steps=steps, max_minutes=minutes,
                                                      fidelity_points=fidelity_points, min_psnr=min_psnr))
            job = {"job": uuid.uuid4().hex[:12], "state": "running", "progress": [0, None], "desc": "starting",
                   "started": time.time(), "result": None, "error": None, "child": child}
            self._jobs[job["job"]] = job
            while len(self._jobs) > JOBS_KEPT:
                oldest = next(iter(self._jobs))
                if self._jobs[oldest]["state"] == "running":
                    break
                self._jobs.pop(oldest)
        threading.Thread(target=self._follow, args=(job,), name=f"advise-{job['job']}", daemon=True).start()
        return self._view(job)

    def poll(self, job: str, cancel: str = "") -> dict:
        """An advisor job's state, progress and (done) result; cancel='true' stops it."""
        with self._lock:
            found = self._jobs.get((job or "").strip())
        if found is None:
            raise gr.Error(f"no advisor job {job!r} here; start one with advise_start", title="Invalid request")
        if str(cancel).strip().lower() in ("1", "true", "yes") and found["state"] == "running":
            found["state"] = "cancelled"
            _stop(found["child"])
        return self._view(found)

    def _follow(self, job: dict) -> None:
        child = job["child"]
        messages = advisor_messages(child)
        errors = next(messages)
        for message in messages:
            if "progress" in message:
                job["progress"], job["desc"] = [message["progress"], message["total"]], message["desc"]
            elif "result" in message:
                job["result"] = message["result"]
        child.wait()
        if job["state"] == "running":
            job["state"] = "done" if job["result"] is not None else "failed"
            if job["result"] is None:
                job["error"] = f"the advisor failed: {''.join(errors[-5:])[-800:]}"

    @staticmethod
    def _view(job: dict) -> dict:
        return {k: v for k, v in job.items() if k != "child"} | {"elapsed_s": round(time.time() - job["started"], 1)}

    def close(self) -> None:
        for job in list(self._jobs.values()):
            if job["state"] == "running":
                job["state"] = "cancelled"
                _stop(job["child"])


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is None:  # the child and its compile workers (its own session)
        try:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def advisor_api(handlers: AdvisorHandlers) -> AdviceJobs:
    """The start/poll pair as API endpoints (so MCP tools), inside the Blocks, each parameter named with what
    it takes and the job's JSON typed."""
    jobs = AdviceJobs(handlers)
    atexit.register(jobs.close)  # a running advisor is the app's child: it ends with the app
    job = ("job", "the advisor job: {job, state, progress, desc, elapsed_s, error, result (once done: pick, rows)}")
    document_api(gr.api(jobs.start, api_name="advise_start", concurrency_limit=None), {
        "preset": "one of " + ", ".join(handlers.serving.preset_names()),
        "device": "auto, or one of " + ", ".join(r["name"] for r in handlers.devices_report())
                  + " (/system says which are available here)",
        "size": "WIDTHxHEIGHT, one of the preset's buckets ('' for its first)",
        "steps": "denoising steps per image, 1-200 ('' for the preset's default)",
        "max_minutes": "the time budget in minutes, 1-30 (default 5); what does not fit is skipped",
        "fidelity_points": f"quality bound on models with a checker: at most this many fidelity points below eager "
                           f"fp32 ('' for {DEFAULT_FIDELITY_POINTS:g})",
        "min_psnr": f"quality bound: drift PSNR in dB against eager fp32's image ('' for {DEFAULT_MIN_PSNR:g}, "
                    f"{CHECKER_MIN_PSNR:g} on models with a checker)",
        "admin_token": "public servers only: the host's token (the advisor is a host operation there)",
    }, returns=job, schema=schemas.ADVICE_JOB)
    document_api(gr.api(jobs.poll, api_name="advise_poll", concurrency_limit=None), {
        "job": "the job id advise_start returned",
        "cancel": "'true' to stop the job ('' or 'false' to only read it)",
    }, returns=job, schema=schemas.ADVICE_JOB)
    return jobs
