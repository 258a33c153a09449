"""Prometheus /metrics (engine/serving/telemetry.py, ui/metrics.py) and the console's request ids and filters
(engine/worker/logs.py)."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest
from helpers import engine_manager, launch_demo
from prometheus_client.parser import text_string_to_metric_families

from engine.config.request import ImageRequest
from engine.errors import BudgetExceeded, Cancelled, EngineCrashed, InvalidRequest, NotAllowed
from engine.serving.telemetry import Telemetry, outcome_of
from engine.worker import logs
from ui.metrics import MetricsRoute

PROMPT = "a red circle on a blue background"
REQUEST = dict(preset="tiny-shapes", device="cpu", precision="fp32", mode="eager", size="64x64", steps=2,
               prompt=PROMPT)


def samples(text: str, name: str) -> list:
    """Every sample called `name` in an exposition text, parsed by prometheus_client's own parser."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def value(text: str, name: str, **labels) -> float:
    return sum(s.value for s in samples(text, name) if all(s.labels.get(k) == v for k, v in labels.items()))


# -- fast: no engine ---------------------------------------------------------------------------------------


def test_outcomes_name_why_a_request_was_refused():
    assert outcome_of(None) == ("ok", "")
    assert outcome_of(Cancelled("stopped")) == ("cancelled", "")
    assert outcome_of(NotAllowed("no")) == ("refused", "not_offered")
    assert outcome_of(BudgetExceeded("full")) == ("refused", "no_room")
    assert outcome_of(InvalidRequest("steps")) == ("refused", "invalid")
    assert outcome_of(EngineCrashed("died")) == ("failed", "EngineCrashed")


def test_two_apps_in_one_process_keep_their_own_figures():
    a, b = Telemetry(), Telemetry()
    a.request_ended({"engine": "e@cpu/fp32", "mode": "eager", "bucket": "64x64"}, error=InvalidRequest("x"))
    assert value(a.scrape().decode(), "showcase_requests_total", outcome="refused", reason="invalid") == 1
    assert samples(b.scrape().decode(), "showcase_requests_total") == []


def _series(text: str) -> set:
    return {(s.name, tuple(sorted(s.labels.items()))) for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_a_thousand_distinct_step_cache_parameters_add_no_series():
    """Issue 37: the step cache's parameters were a label value, so each distinct threshold a visitor sent added
    series for good. Labels come from closed sets: after the first request of each kind, none is added."""
    from engine.protocol import EngineKey, StepCache
    from engine.protocol.requests import GenerateResult, Timings
    from engine.protocol.vocabulary import BucketKey

    telemetry = Telemetry()
    key = EngineKey("tiny-shapes", "cpu", "fp32")
    timings = Timings(step_ms=(1.0, 1.0), encode_ms=1.0, denoise_ms=2.0, decode_ms=1.0, total_ms=4.0)

    def served(cache: str) -> None:
        result = GenerateResult("r", key, BucketKey("eager", "64x64"), b"", timings, warm=True, eager_fallback=False,
                                recompiles=0, peak_memory_bytes=None, steps=4, step_cache=StepCache.parse(cache),
                                cached_steps=(2,))
        telemetry.request_ended({}, result=result)

    kinds = ("first-block:0.3", "magcache:0.1", "taylorseer:2:1", "faster-cache:3", "pyramid:3")
    for cache in kinds:
        served(cache)
    before = _series(telemetry.scrape().decode())
    for i in range(1000):  # 1,000 distinct parameter sets, 200 per kind
        served([f"first-block:{0.001 + i * 0.005:.4f}", f"magcache:{0.002 + i * 0.004:.4f}",
                f"taylorseer:{i % 199 + 1}:{i % 7 + 1}", f"faster-cache:{i % 199 + 1}", f"pyramid:{i % 199 + 1}"][i % 5])
    after = _series(telemetry.scrape().decode())
    assert after == before
    caches = {s.labels["step_cache"] for s in samples(telemetry.scrape().decode(), "showcase_step_cache_hits_total")}
    assert caches == {"first-block", "magcache", "taylorseer", "faster-cache", "pyramid"}


def _metrics_app(route: MetricsRoute):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    return Starlette(routes=[Route("/", lambda request: PlainTextResponse("page"))], middleware=[route.middleware()])


def test_public_metrics_need_the_admin_token():
    from starlette.testclient import TestClient

    telemetry = Telemetry()
    telemetry.request_ended({}, error=NotAllowed("no"))
    with TestClient(_metrics_app(MetricsRoute(telemetry, public=True, admin_token="s3cret"))) as client:
        refused = client.get("/metrics")
        assert refused.status_code == 401 and "admin token" in refused.json()["detail"]
        assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        scraped = client.get("/metrics", headers={"Authorization": "Bearer s3cret"})
        assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
        assert value(scraped.text, "showcase_requests_total", reason="not_offered") == 1
        assert client.get("/metrics?token=s3cret").status_code == 200
        assert client.get("/").text == "page"  # every other path is the app's
    with TestClient(_metrics_app(MetricsRoute(telemetry, public=True, admin_token=None))) as client:
        off = client.get("/metrics")
        assert off.status_code == 404 and "--admin-token" in off.json()["detail"]
    with TestClient(_metrics_app(MetricsRoute(telemetry, public=False, admin_token=None))) as client:
        assert client.get("/metrics").status_code == 200  # a developer's own machine


def test_edge_refusals_are_exported_by_reason():
    from ui.edge import EdgeConfig, EdgeGuard
    from ui.sockets import SocketBounds

    guard = EdgeGuard(EdgeConfig(sockets=SocketBounds()))
    guard.refused["body size"] += 2
    guard.sockets.refused["header timeout"] += 3  # a connection closed before its request existed
    telemetry = Telemetry()
    MetricsRoute(telemetry, public=False, admin_token=None, edge=guard)
    scraped = telemetry.scrape().decode()
    assert value(scraped, "showcase_edge_refusals_total", reason="body size") == 2
    assert value(scraped, "showcase_edge_refusals_total", reason="header timeout") == 3


def test_json_lines_carry_the_request_id():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs._RequestId())
    handler.setFormatter(logs.JsonFormatter("web"))
    logger = logging.getLogger("engine.test_telemetry")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with logs.request_context("abc123def456"):
            logger.info("inside")
        logger.info("outside")
    finally:
        logger.removeHandler(handler)
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["request_id"] == "abc123def456" and inside["message"] == "inside" and inside["process"] == "web"
    assert outside["request_id"] is None and outside["level"] == "INFO"


def test_harmless_third_party_messages_are_dropped_and_nothing_else():
    logs.quiet_third_party()
    said = [
        ("torchao", "Failed to load /x/torchao/_C_mxfp8.cpython-310.so: Could not load", False),
        ("torchao", "Failed to load /x/torchao/_C_other.so: a real problem", True),
        ("torchao.kernel.intmm", "Warning: Detected no triton, on systems without Triton certain kernels will not "
                                 "work", False),
        ("transformers.utils.import_utils", "`CLIPImageProcessor` requires torchvision (not installed); falling "
                                            "back to `CLIPImageProcessorPil`", False),
        ("diffusers.pipelines.pipeline_utils", "Expected types for text_encoder: (CLIPTextModel,), got "
                                               "T5EncoderModel.", True),
        ("diffusers.loaders.lora_base", "No LoRA keys associated to CLIPTextModel found with the "
                                        "prefix='text_encoder'. This is safe to ignore if ...", False),
        ("diffusers.loaders.lora_base", "No LoRA keys associated to FluxTransformer2DModel found with the "
                                        "prefix='transformer'. This is safe to ignore if ...", True),
    ]
    for name, message, shown in said:
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        logger = logging.getLogger(name)  # the library's own logger (diffusers' does not propagate)
        logger.addHandler(handler)
        try:
            logger.warning(message)
        finally:
            logger.removeHandler(handler)
        assert (stream.getvalue().strip() == message) is shown, (name, message)


def test_an_unknown_log_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="text or json"):
        logs.log_format("yaml")


# -- slow: a manager of its own (exact counts), its app ----------------------------------------------------


@pytest.fixture(scope="module")
def fresh_manager(cache_dir):
    with engine_manager(cache_dir) as manager:
        yield manager


@pytest.mark.slow
def test_a_requests_log_lines_carry_its_id(fresh_manager):
    """The first request starts its engine; the line saying so (the manager's residency) carries the request's id."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs._RequestId())
    handler.setFormatter(logs.JsonFormatter("web"))
    logger = logging.getLogger("engine.serving.residency")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        result = fresh_manager.generate(ImageRequest(**REQUEST))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines, "the manager logged nothing while starting the engine"
    assert {line["request_id"] for line in lines} == {result.request_id}
    assert logs.REQUEST_ID.get() is None  # reset when the request ended


@pytest.mark.slow
def test_metrics_count_the_requests_sent_through_the_app(fresh_manager):
    from gradio_client import Client

    from ui.handlers import UIDefaults

    before = fresh_manager.telemetry.scrape().decode()
    demo, url = launch_demo(fresh_manager, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager"))
    try:
        client = Client(url, verbose=False)
        sent = 3
        for seed in range(sent):
            client.predict(prompt=PROMPT, preset="tiny-shapes", device="cpu", precision="fp32", mode="eager",
                           size="64x64", steps="2", seed=str(seed), api_name="/generate")
        with pytest.raises(Exception, match="steps"):
            client.predict(prompt=PROMPT, preset="tiny-shapes", device="cpu", precision="fp32", mode="eager",
                           size="64x64", steps="0", api_name="/generate")
        scraped = httpx.get(url + "metrics", timeout=30)
    finally:
        demo.close()
    assert scraped.status_code == 200
    text = scraped.text
    engine = dict(engine="tiny-shapes@cpu/fp32")
    ok = dict(engine, mode="eager", bucket="64x64", outcome="ok")
    assert value(text, "showcase_requests_total", **ok) - value(before, "showcase_requests_total", **ok) == sent
    assert value(text, "showcase_requests_total", outcome="refused", reason="invalid") \
        - value(before, "showcase_requests_total", outcome="refused", reason="invalid") == 1
    for histogram in ("showcase_queue_wait_seconds_count", "showcase_denoise_seconds_count",
                      "showcase_request_seconds_count"):
        assert value(text, histogram, bucket="64x64", **engine) - value(before, histogram, bucket="64x64", **engine) \
            == sent
    assert value(text, "showcase_batch_size_count", **engine) >= sent
    assert value(text, "showcase_engines", state="ready", **engine) == 1
    assert value(text, "showcase_buckets", mode="eager", state="warm", **engine) >= 1
    assert value(text, "showcase_engine_memory_bytes", device="cpu", **engine) > 0
    assert value(text, "showcase_memory_budget_bytes", device="cpu") > 0
