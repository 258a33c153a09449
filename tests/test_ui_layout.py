"""How the UI is put together: one module per tab, the public API, Gradio's own cancels, import boundaries.

No server and no engine process: the Blocks are built and their config is read.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import gradio as gr
import pytest

from engine.config.request import FORM, FORM_FIELDS, ImageRequest
from ui import advisor, buckets, build_demo, compare, generate, generate_video, system
from ui.advisor import AdvisorHandlers
from ui.buckets import BucketsHandlers
from ui.common import UIDefaults
from ui.compare import COMPARE_API_PARAMS, COMPARE_FIELDS, CompareHandlers
from ui.generate import GENERATE_API_PARAMS, GenerateHandlers
from ui.generate_video import VideoHandlers
from ui.system import SystemHandlers

UI = Path(__file__).resolve().parent.parent / "ui"
PUBLIC_API = {"generate", "cancel", "compare", "status", "warm", "restart", "system",
              "advise_start", "advise_poll", "generate_video"}  # the advisor as a start/poll pair (ui/mcp.py)
TAB_IDS = {
    "generate": {"prompt", "examples", "negative-prompt", "preset", "device", "precision", "mode", "size", "steps",
                 "guidance", "seed", "randomize", "tp", "on-cold", "step-cache", "lora", "lora-scale", "lora-fused", "memory",
                 "frames", "fps",
                 "input-images", "input-capture", "input-mask", "strength", "edit-this", "edit-ab", "edit-history",
                 "why-not",
                 "generate-btn",
                 "cancel-btn", "output-image", "step-plot", "stats", "timings-json", "gen-controls", "gen-output",
                 "run-summary", "history", "gen-row", "gen-buttons", "gen-image-row"},
    "buckets": {"board", "board-engine", "board-mode", "board-size", "warm-btn", "warm-all-btn",
                "restart-btn", "admin-token", "attention-backend", "cuda-graphs", "restart-options-btn",
                "attention-table"},
    "compare": {"c-prompt", "c-preset", "c-images", "c-capture", "c-size", "c-steps", "c-guidance", "c-seed", "c-devices",
                "c-precisions", "c-modes", "c-wait", "compare-btn", "c-cancel-btn", "c-gallery", "c-plot",
                "c-speedup", "c-costs", "c-json", "c-caches", "c-loras", "c-ab-choice", "c-ab", "c-fidelity-prompts",
                "c-cards", "c-configs",
                "c-config-list", "c-timing", "c-config-check", "c-status", "c-plot-legend", "c-levers", "c-frames",
                "c-fps"},
    "advisor": {"a-preset", "a-device", "a-size", "a-steps", "a-lora", "a-minutes", "a-fidelity-points",
                "a-min-psnr", "a-max-memory",
                "advise-btn", "a-cancel-btn", "a-apply-btn", "a-status", "a-summary", "a-frontier", "a-memory-frontier",
                "a-table",
                "a-json", "a-cards"},
    "system": {"system-refresh", "system"},
    "video": {"video-prompt", "video-negative-prompt", "video-memory", "video-preset", "video-device", "video-precision", "video-mode",
              "video-size", "video-frames-count", "video-fps", "video-steps", "video-guidance", "video-seed",
              "video-on-cold", "video-images", "video-capture", "video-btn", "video-cancel-btn", "video-row", "video-controls", "video-output", "video-buttons", "video-player", "video-frames", "video-summary",
              "video-plot", "video-run-summary", "video-stats", "video-timings"},
}
TAB_APIS = {"generate": {"generate"}, "buckets": {"status", "warm", "restart"}, "compare": {"compare"},
            "advisor": set(),
            "system": {"system"}, "video": {"generate_video"}}


def elem_ids(demo: gr.Blocks) -> set[str]:
    return {c["props"]["elem_id"] for c in demo.config["components"] if c["props"].get("elem_id")}


def public_apis(demo: gr.Blocks) -> set[str]:
    return {d["api_name"] for d in demo.config["dependencies"] if d["api_visibility"] == "public"}


def dependencies_on(demo: gr.Blocks, elem_id: str, event: str) -> list[dict]:
    ids = {c["id"] for c in demo.config["components"] if c["props"].get("elem_id") == elem_id}
    return [d for d in demo.config["dependencies"]
            if any(t[0] in ids and t[1] == event for t in d["targets"])]


def by_name(demo: gr.Blocks, api_name: str) -> dict:
    return next(d for d in demo.config["dependencies"] if d["api_name"] == api_name)


@pytest.fixture(scope="module")
def demo(manager):
    return build_demo(manager.serving(), UIDefaults(device="cpu", mode="eager"))


def build_tab(name, manager):
    """One tab's module built alone, in its own Blocks, with only its own handler class."""
    defaults = UIDefaults(device="cpu", mode="eager")
    with gr.Blocks() as blocks:
        line = gr.Markdown()
        with gr.Tabs() as tabs:
            if name == "generate":
                generate.build(GenerateHandlers(manager.serving(), defaults), blocks, line)
            elif name == "buckets":
                buckets.build(BucketsHandlers(manager.serving(), defaults))
            elif name == "compare":
                compare.build(CompareHandlers(manager.serving(), defaults))
            elif name == "advisor":
                settings = generate.build(GenerateHandlers(manager.serving(), defaults), blocks, line)
                advisor.build(AdvisorHandlers(manager.serving(), defaults), settings, tabs)
            elif name == "video":
                generate_video.build(VideoHandlers(manager.serving(), defaults))
            else:
                system.build(SystemHandlers(manager.serving(), defaults))
    return blocks


def test_every_child_of_the_tab_bar_is_a_tab(demo):
    """Gradio's tab bar draws each child of gr.Tabs as a tab: a component made outside a tab (a gr.State in a
    tab's event wiring did) duplicated tabs and hid others when one was clicked."""
    bars = [block for block in demo.blocks.values() if isinstance(block, gr.Tabs)]
    assert bars and all(isinstance(child, gr.Tab) for bar in bars for child in bar.children), \
        [type(child).__name__ for bar in bars for child in bar.children]


@pytest.mark.parametrize("name", sorted(TAB_IDS))
def test_each_tab_module_builds_alone_with_its_own_handlers(manager, name):
    blocks = build_tab(name, manager)
    needs = ["generate"] if name == "advisor" else []  # the advisor's apply button sets Generate's selectors
    assert elem_ids(blocks) == TAB_IDS[name].union(*(TAB_IDS[n] for n in needs))
    assert public_apis(blocks) == TAB_APIS[name].union(*(TAB_APIS[n] for n in needs))


def test_the_app_has_the_tabs_element_ids_and_exactly_the_public_api(demo):
    tabs = [c["props"]["label"] for c in demo.config["components"] if c["type"] == "tabitem"]
    assert tabs == ["Generate", "Video", "Buckets", "Compare", "Advisor", "System"]
    assert elem_ids(demo) == set().union(*TAB_IDS.values()) | {"engine-line"}
    assert public_apis(demo) == PUBLIC_API
    params = demo.get_api_info()["named_endpoints"]["/generate"]["parameters"]
    assert tuple(p["parameter_name"] for p in params) == GENERATE_API_PARAMS
    cancel = demo.get_api_info()["named_endpoints"]["/cancel"]
    assert cancel["parameters"] == [] and cancel["returns"] == []  # as before: no inputs, no outputs


def test_cancel_buttons_use_gradio_cancels_on_their_tab_run(demo):
    fn_index = {d["api_name"]: d["id"] for d in demo.config["dependencies"]}
    for button, run in (("cancel-btn", "generate_ui"), ("c-cancel-btn", "compare")):
        deps = dependencies_on(demo, button, "click")
        assert [d["cancels"] for d in deps if d["cancels"]] == [[fn_index[run]]]
        assert not any(d["backend_fn"] for d in deps)  # nothing of ours runs: Gradio closes the handler
        ended = by_name(demo, {"generate_ui": "generate_ended", "compare": "compare_ended"}[run])
        # chained with .then: the page runs it once the cancelled run is closed, and settles its outputs
        assert ended["trigger_after"] == fn_index[run] and not ended["trigger_only_on_success"]


def test_handlers_shared_by_several_triggers_are_one_gr_on_event(demo):
    select = [d for d in demo.config["dependencies"] if (d["api_name"] or "").startswith("select_engine")]
    assert len(select) == 1
    assert sorted(t[1] for t in select[0]["targets"]) == ["change"] * 6 + ["load"]
    tick = [d for d in demo.config["dependencies"] if (d["api_name"] or "").startswith("tick")]
    assert len(tick) == 1 and sorted(t[1] for t in tick[0]["targets"]) == ["load", "tick"]


# -- module boundaries -----------------------------------------------------------------------------
# The UI reaches the engine through the serving interface it is given (engine/serving/interface.py: Serving,
# never the EngineManager), the typed protocol, the error classes and the settings (every environment variable is read there). Exceptions, each in one module: ui/common.py asks
# engine.devices and engine.pipeline.attention what the serving interface cannot tell (the device report, a device's
# modes, the attention backends and step caches that can run), ui/compare_views.py reuses the benchmark's
# speedup_table and quality code so the UI and the bench agree, ui/views.py hands the tabs' views the metrics'
# median, ui/advisor.py shows the advisor's
# default bounds (it runs `python -m bench advise` in a child process) and reads its report out with the
# CLI's own renderer (bench.advise_report), and ui/compare.py reads typed
# configurations and times them with the bench's paired plan (bench.configs, bench.paired).
ALLOWED_ENGINE_IMPORTS = {
    "engine.protocol": None, "engine.errors": None, "engine.settings": None, "engine.serving.interface": {"Serving", "Caller", "Admitted", "Uploads"},
    "engine.pipeline.attention": {"attention_table", "DEFAULT"},
    "engine.devices": {"devices_report", "resolve_device", "get_device", "check_mode"},
    "bench": {"speedup_table"},
    "bench.quality": {"fidelity_checker", "fmt_drift", "image_drift", "sample_prompts", "score", "diff_heatmap"},
    "bench.paired": {"PairedTiming", "current_marks", "engine_marks", "row_speedup_text"},
    "bench.configs": None,
    "engine.metrics": {"median", "percentile"},
    "engine.pipeline.stepcache": {"available_step_caches"},
    "bench.advise": {"DEFAULT_FIDELITY_POINTS", "DEFAULT_MIN_PSNR", "CHECKER_MIN_PSNR"},
    "bench.advise_report": {"COLUMNS", "summary", "table_rows"},
    "engine.config.validation": {"check_steps"},
    "engine.config.request": None,  # the request every edge builds
    "engine.config": {"strict"},  # numbers and JSON bodies read by one strict grammar at every door
    "engine.config.images": {"MAX_IMAGES", "MAX_UPLOAD_BYTES", "MAX_UPLOADS_BYTES", "read_image_file", "decode_inputs",
                             "fit_inputs"},  # an upload read bounded, as the CLI reads a file; decoded as the gate does
    "engine.config.placement": {"split_device"},  # a device field's chip or node (--ray)
    "engine.config.defaults": {"task_default"},  # each task's default model, picked one way at every door
    "engine.processes": {"pid_alive"},
    "engine.serving.budget": {"parse_size"},  # the Advisor's memory bound, read as the CLI reads it
    "engine.serving": {"stream"},  # every door reads a request's one event stream
    "engine.serving.stream": {"Idle", "Run", "Started", "Step"},
    "engine.serving.gate": {"Admitted"},  # what the gate let through, run as it is
}
ONLY_IN = {"engine.devices": "common.py", "engine.pipeline.attention": "common.py", "bench": "compare_views.py",
           "bench.quality": "compare_views.py", "engine.metrics": "views.py", "engine.pipeline.stepcache": "common.py",
           "bench.advise": "advisor.py", "bench.advise_report": ("advisor.py", "advisor_views.py"),
           "engine.config.validation": "compare_run.py", "engine.config.placement": "common.py",
           "engine.processes": "webtemp.py", "engine.serving.budget": "advisor.py",
           "engine.config.images": ("uploads.py", "openai_edits.py", "compare_run.py"),
           "bench.configs": ("compare.py", "compare_run.py", "compare_views.py")}  # a tab's module, or its views
TAB_MODULES = ("generate", "buckets", "compare", "advisor", "system")


def imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every import in a file, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, a.name) for a in node.names]
            if node.module in ("engine", "ui"):  # `from engine import devices` imports engine.devices
                found += [(f"{node.module}.{a.name}", None) for a in node.names]
    return found


def attribute_uses(path: Path, alias: str) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == alias}


def serving_uses() -> set[str]:
    """Every member the UI reads of the serving interface it is given (`serving.X`, `self.serving.X`, ...)."""
    return {n.attr for path in UI.glob("*.py") for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and (isinstance(n.value, ast.Name) and n.value.id == "serving"
                                                  or isinstance(n.value, ast.Attribute) and n.value.attr == "serving")}


def test_the_ui_uses_only_the_serving_interface_and_the_manager_implements_it(manager):
    from engine.serving.interface import Serving

    members = {name for name in {*vars(Serving), *Serving.__annotations__} if not name.startswith("_")}
    assert serving_uses() - members == set(), "the UI reads something the Serving protocol does not declare"
    serving = manager.serving()
    assert sorted(name for name in members if not hasattr(serving, name)) == []


@pytest.mark.parametrize("path", sorted(UI.glob("*.py")), ids=lambda p: p.name)
def test_ui_modules_use_only_the_engines_contract(path):
    for module, name in imports(path):
        if module == "engine" or not module.startswith("engine."):
            continue
        assert module in ALLOWED_ENGINE_IMPORTS, f"{path.name} imports {module}"
        allowed = ALLOWED_ENGINE_IMPORTS[module]
        if allowed is not None and name is not None:
            assert name in allowed, f"{path.name} imports {module}.{name}"
    for module, owner in ONLY_IN.items():
        if any(m == module for m, _ in imports(path)):
            assert path.name in ((owner,) if isinstance(owner, str) else owner), f"{path.name} imports {module}"
    if ("engine.devices", None) in imports(path):
        assert attribute_uses(path, "engine_devices") <= ALLOWED_ENGINE_IMPORTS["engine.devices"]
    if path.name.endswith("views.py"):  # pure formatting: testable without a server
        assert not any(m.split(".")[0] == "gradio" for m, _ in imports(path))
    if path.stem in TAB_MODULES:  # tabs share ui.common / ui.runs / ui.views, never each other
        assert not {f"ui.{t}" for t in TAB_MODULES if t != path.stem} & {m for m, _ in imports(path)}
    assert "design.md" not in path.read_text()


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def test_each_tab_owns_its_views():
    """A tab's views sit beside it (ui/<tab>_views.py) and only that tab imports them (its module, or one it is
    split into: ui/<tab>_*.py); ui/views.py keeps only what several modules show (each of its names used by two
    other UI modules, or by itself)."""
    for tab in TAB_MODULES:
        own = f"ui.{tab}_views"
        importers = {p.stem for p in UI.glob("*.py") if any(m == own for m, _ in imports(p))}
        strangers = {stem for stem in importers if stem != tab and not stem.startswith(f"{tab}_")}
        assert not strangers, f"{own} imported by {sorted(strangers)}"
    shared = UI / "views.py"
    text = shared.read_text()
    for name in top_level_names(shared):
        users = {p.stem for p in UI.glob("*.py") if p != shared and (
            ("ui.views", name) in imports(p) or name in attribute_uses(p, "views"))}
        inside = len(re.findall(rf"\b{name}\b", text)) > 1  # defined once, used by another shared view
        assert len(users) >= 2 or inside, f"ui/views.py {name} is used only by {sorted(users)}: move it there"


def test_compare_says_what_each_parameter_takes_and_keeps_its_api(demo):
    """/compare's parameters carry what they take, as /generate's do (view_api, the MCP tool's schema); names,
    order and types stay CompareForm's, and the page keeps its labels."""
    params = demo.get_api_info()["named_endpoints"]["/compare"]["parameters"]
    assert [p["parameter_name"] for p in params] == list(COMPARE_FIELDS)
    for p in params:
        assert p["python_type"]["description"] == p["type"]["description"] == COMPARE_API_PARAMS[p["parameter_name"]]
    by_name = {p["parameter_name"]: p for p in params}
    assert by_name["steps"]["type"]["type"] == "number" and by_name["steps"]["python_type"]["type"] == "float"
    assert by_name["modes"]["python_type"]["type"].startswith("list[Literal['eager', 'compile'")
    assert by_name["prompt"]["label"] == "Prompt" and "1-200" in by_name["steps"]["python_type"]["description"]
    # a video preset's clip fields: optional for every caller (an image preset's call leaves them out)
    assert by_name["num_frames"]["parameter_has_default"] and by_name["fps"]["parameter_has_default"]


def test_the_generate_api_params_are_the_request_forms_api_fields():
    assert GENERATE_API_PARAMS == tuple(f.name for f in FORM if f.api)
    assert set(FORM_FIELDS) <= {f.name for f in dataclasses.fields(ImageRequest)}  # each one a request field


def test_every_event_passes_its_handler_as_many_inputs_as_it_takes(demo):
    """Gradio only warns when an event sends a handler more inputs than it takes (then the run fails)."""
    import inspect

    for fn in demo.fns.values():
        target = getattr(fn, "fn", None)
        if target is None or not fn.inputs:
            continue
        params = [p for name, p in inspect.signature(target).parameters.items() if name not in ("request", "progress")]
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            continue
        required = [p for p in params if p.default is p.empty and p.kind is not p.VAR_KEYWORD]
        # a handler with **fields takes its keyword inputs (inputs_kwargs) by name: any number of them
        most = float("inf") if any(p.kind is p.VAR_KEYWORD for p in params) else len(params)
        assert len(required) <= len(fn.inputs) <= most, (fn.name, len(fn.inputs), [p.name for p in params])


def test_the_api_page_says_what_each_endpoint_does_and_takes(demo):
    """What /gradio_api/info (and gradio_client's view_api()) tells a client developer."""
    endpoints = demo.get_api_info()["named_endpoints"]
    generate = endpoints["/generate"]
    assert generate["description"].startswith("Generate one image.")
    assert not {"async", "preprocess", "gr.skip"} & set(re.findall(r"[\w.]+", generate["description"]))
    assert [r["label"] for r in generate["returns"]] == ["image", "timings"]
    allowed = {p["parameter_name"]: p["python_type"]["description"] for p in generate["parameters"]}
    assert "fp32" in allowed["precision"] and "bf16" in allowed["precision"]
    assert all(m in allowed["mode"] for m in ("eager", "compile", "regional"))
    assert "eager" in allowed["on_cold"] and "wait" in allowed["on_cold"]
    assert "tiny-shapes" in allowed["preset"] and "1-200" in allowed["steps"]
    assert all(allowed.values()), [name for name, text in allowed.items() if not text]
    for name in ("/status", "/warm", "/restart", "/system", "/compare"):
        endpoint = endpoints[name]
        assert endpoint["description"], name
        labels = [p["label"] for p in endpoint["parameters"]] + [r["label"] for r in endpoint["returns"]]
        assert not [label for label in labels if re.fullmatch(r"\d+(st|nd|rd|th)|value_\d+", label)], (name, labels)
    assert [r["label"] for r in endpoints["/status"]["returns"]] == ["engines"]
    warm = {p["parameter_name"]: p["python_type"]["description"] for p in endpoints["/warm"]["parameters"]}
    assert [p["label"] for p in endpoints["/warm"]["parameters"]] == list(warm)
    assert "regional" in warm["mode"] and "all" in warm["size"] and "fp32" in warm["precision"]
