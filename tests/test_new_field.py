"""A newcomer adds a sampling field by declaring it once (engine/protocol/params.py) and it reaches every door.

The test does what a newcomer would: it copies the source, appends one declaration to `FIELDS` and nothing else,
then reads the field back from the edge's form, the gate's checked request (its check applied once), the CLI's
`generate` flags, the /generate API and its MCP tool description, the /v1 images door and the Generate page.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DECLARATION = '''
    Field("detail", float, None, "Detail", "a made-up sampling field, 0-1 (how much fine detail to draw)",
          check=lambda value, preset: (None if value in (None, "") else number("detail", value), ()),
          batch=_same, in_png=True, cli=dict(check=float), v1=V1, held=(float | None, None)),
'''

PROBE = r'''
import json, subprocess, sys
import gradio as gr
from engine.config.presets import get_preset
from engine.config.request import API_FIELDS, FORM_FIELDS, ImageRequest
from engine.config.validation import build_request
from engine.errors import InvalidRequest
from engine.protocol import GenerateRequest
from ui import generate, mcp, openai_api
from ui.handlers import UIDefaults

preset = get_preset("tiny-shapes")
request, _ = build_request(preset, ImageRequest("tiny-shapes", prompt="a red circle", detail="0.25"))
try:
    build_request(preset, ImageRequest("tiny-shapes", detail="lots"))
    refused = ""
except InvalidRequest as exc:
    refused = str(exc)
call = openai_api.read_call({"prompt": "a red circle", "detail": "0.5"}, UIDefaults(), "tiny-shapes",
                            openai_api.Caller.VISITOR, "1.2.3.4")
with gr.Blocks():
    widgets = generate.declared_widgets(preset)
cli = subprocess.run([sys.executable, "-m", "engine", "generate", "--help"], capture_output=True, text=True).stdout
print(json.dumps({
    "form": "detail" in FORM_FIELDS and "detail" in API_FIELDS,
    "checked": request.detail, "canonical": GenerateRequest.checked("a", 64, 64, 2, 1.0, 0, detail=0.75).detail,
    "refused": refused,
    "cli": "--detail" in cli and "fine detail" in cli,
    "mcp": "detail: a made-up sampling field" in mcp.DESCRIPTIONS["generate"],
    "v1": call.spec.detail,
    "page": [type(widgets["detail"]).__name__, widgets["detail"].label, widgets["detail"].visible],
}))
'''


def test_a_field_declared_once_reaches_every_door(tmp_path):
    copy = tmp_path / "src"
    for name in ("engine", "ui", "bench", "presets"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    params = copy / "engine" / "protocol" / "params.py"
    text = params.read_text()
    end = text.index("\n)\nBY_NAME")  # the end of FIELDS: a new field is appended
    params.write_text(text[:end] + "\n" + DECLARATION.strip("\n") + text[end:])
    env = {**os.environ, "PYTHONPATH": str(copy), "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["form"], "the edge's form and the /generate API take it"
    assert seen["checked"] == 0.25 and seen["canonical"] == 0.75, "the gate checks it once into the request"
    assert "detail must be a number" in seen["refused"], "its own check answers bad input, naming it"
    assert seen["cli"], "the CLI's generate has --detail with its help"
    assert seen["mcp"], "the MCP tool's description lists it with its help"
    assert seen["v1"] == "0.5", "the /v1 images door takes it as an extra body field"
    assert seen["page"] == ["Number", "Detail", True], "the Generate page shows a number box labelled from it"
