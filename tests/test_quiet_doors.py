"""Issue 50, items 2 and 3: every error path of the /v1 door is typed and quiet, and API keys resist guessing.

The hostile run: `"n": "²"` (passes isdigit(), fails int()), 4,500-digit numbers and deeply nested JSON each
answered HTTP 500 with a traceback (300 calls wrote 323 KB of log); 1,296 key guesses from one address in 11 s
got 1,295 × 401 and a 200, no 429, no log line, no counter in /metrics.
"""

from __future__ import annotations

import ipaddress
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import engine_manager, launch_demo

from engine.config import strict
from engine.errors import InvalidRequest
from ui import quietlog

KEY = "visitor-key-of-the-quiet-doors"
ADMIN = "admin-token-of-the-quiet-doors"
GOOD = {"model": "tiny-shapes", "prompt": "a red circle on a blue background", "size": "64x64", "steps": 1}
DIGITS = "9" * 4500
MALFORMED = [  # (body text, what the 400 names)
    ('{"model": "tiny-shapes", "prompt": "x", "n": "\u00b2"}', "n must be a whole number"),
    ('{"model": "tiny-shapes", "prompt": "x", "n": "\u0661\u0662"}', "n must be a whole number"),
    ('{"model": "tiny-shapes", "prompt": "x", "n": "' + DIGITS + '"}', "more than 40 digits"),
    ('{"model": "tiny-shapes", "prompt": "x", "n": ' + DIGITS + "}", "more than 40 digits"),
    ('{"model": "tiny-shapes", "prompt": "x", "stream": true, "partial_images": "' + "7" * 5000 + '"}',
     "more than 40 digits"),
    ('{"model": "tiny-shapes", "prompt": "x", "seed": "\u00b2"}', "seed must be a whole number"),
    ('{"model": "tiny-shapes", "prompt": "x", "steps": 1e999999}', "is out of range"),
    ('{"model": "tiny-shapes", "prompt": "x", "n": NaN}', "NaN is not a JSON number"),
    ("[" * 100_000 + "]" * 100_000, "nests arrays or objects more than 32 deep"),
    ('{"a": ' * 5000 + "1" + "}" * 5000, "nests arrays or objects more than 32 deep"),
    ('{"model": "tiny-shapes", "prompt": "x", "n": 1', "the body must be JSON"),
    ("\xff\xfe", "the body must be JSON"),
]


def test_the_strict_grammar_reads_ascii_digits_only_and_bounds_digits_and_nesting():
    assert strict.whole("12", "n") == 12 and strict.whole(" -3 ", "n") == -3 and strict.whole(7, "n") == 7
    for bad in ("\u00b2", "\u0661\u0662", "1.5", "", "1e3", True, None, 1.0, "9" * 41):
        with pytest.raises(InvalidRequest):
            strict.whole(bad, "n")
    assert strict.loads('{"a": [1, 2.5, "[[[["]}') == {"a": [1, 2.5, "[[[["]}
    assert strict.depth('{"a": "]]]{{{", "b": [[]]}') == 3
    with pytest.raises(InvalidRequest, match="more than 40 digits"):
        strict.loads("1" * 41)


@pytest.fixture(scope="module")
def app(cache_dir, tmp_path_factory):
    """Public mode, keys required, behind a trusted loopback proxy: each request names its own address."""
    from engine.serving.manager import HostPolicy
    from ui.edge import EdgeConfig
    from ui.handlers import UIDefaults

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEY + "\n")
    policy = HostPolicy(public=True, presets=("tiny-shapes",))
    with engine_manager(cache_dir, policy=policy) as manager:
        demo, url = launch_demo(manager, UIDefaults(preset="tiny-shapes", device="cpu", mode="eager",
                                                    admin_token=ADMIN, api_keys=str(keys)),
                                edge=EdgeConfig(trusted_proxies=(ipaddress.ip_network("127.0.0.1/32"),)))
        try:
            yield url.rstrip("/"), manager
        finally:
            demo.close()


def post(http: httpx.Client, url: str, body: str | bytes, address: str, key: str = KEY) -> httpx.Response:
    return http.post(url + "/v1/images/generations", content=body.encode("latin-1") if isinstance(body, str) and
                     body.startswith("\xff") else body,
                     headers={"authorization": f"Bearer {key}", "content-type": "application/json",
                              "x-forwarded-for": address})


def test_300_malformed_v1_calls_from_10_addresses_are_400s_without_a_traceback(app, caplog):
    url, manager = app
    calls = [(body, words, f"10.5.0.{i % 10}") for i in range(300) for body, words in [MALFORMED[i % len(MALFORMED)]]]
    with caplog.at_level(logging.INFO), httpx.Client(timeout=60) as http:
        answers = [(post(http, url, body, address), words) for body, words, address in calls]
    for answer, words in answers:
        assert answer.status_code == 400, (answer.status_code, answer.text[:200])
        assert words in answer.json()["error"]["message"], (words, answer.text[:200])
    served = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]  # the server's lines
    assert not any(r.exc_info for r in served)
    assert len(served) <= quietlog.TOTAL, [r.getMessage()[:100] for r in served]
    assert sum(len(r.getMessage()) for r in served) < 20_000  # the hostile run: 323,220 bytes


def test_an_unexpected_v1_failure_is_counted_and_logged_in_one_line(app, caplog, monkeypatch):
    from ui.openai_api import OpenAIRoutes

    url, _ = app

    def broken(self, caller, path):
        raise RuntimeError("a bug in the listing")

    monkeypatch.setattr(OpenAIRoutes, "models", broken)
    with caplog.at_level(logging.DEBUG, logger="ui.visitors"), httpx.Client(timeout=30) as http:
        answers = [http.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}",
                                                          "x-forwarded-for": "10.6.0.1"}) for _ in range(12)]
        metrics = http.get(url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    assert {a.status_code for a in answers} == {500}
    assert "unexpected RuntimeError" in answers[0].json()["error"]["message"]
    records = [r for r in caplog.records if r.name == "ui.visitors" and r.levelno >= logging.WARNING]
    assert len(records) <= quietlog.PER_CLIENT and not any(r.exc_info for r in records)
    assert any(r.exc_info for r in caplog.records if r.levelno == logging.DEBUG)  # the traceback, at debug only
    count = next(line for line in metrics.splitlines() if line.startswith('showcase_unexpected_errors_total{kind='
                                                                          '"RuntimeError"}'))
    assert float(count.split()[-1]) >= 12


def test_1296_key_guesses_from_one_address_are_throttled_counted_and_logged_within_the_budget(app, caplog):
    url, _ = app
    guesses = [f"guess-{i:04d}-of-a-visitor-key" for i in range(1296)]

    def guess(key: str) -> httpx.Response:
        return http.get(url + "/v1/models", headers={"authorization": f"Bearer {key}", "x-forwarded-for": "10.7.0.1"})

    with caplog.at_level(logging.INFO), httpx.Client(timeout=60, limits=httpx.Limits(max_connections=8)) as http, \
            ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(guess, guesses))
        right_but_shut = guess(KEY)
        other_address = http.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}",
                                                              "x-forwarded-for": "10.7.0.2"})
        metrics = http.get(url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    codes = [a.status_code for a in answers]
    assert set(codes) <= {401, 429} and 200 not in codes
    throttled = codes[20:].count(429)
    assert throttled >= 0.95 * len(codes[20:]), f"{throttled} of {len(codes[20:])} answered 429"
    shut = next(a for a in answers if a.status_code == 429)
    assert int(shut.headers["retry-after"]) >= 1 and "too many wrong API keys" in shut.json()["error"]["message"]
    assert right_but_shut.status_code == 429  # while shut, no key is compared: a guess cannot be confirmed
    assert other_address.status_code == 200  # other addresses are not shut out
    failed = next(line for line in metrics.splitlines() if 'reason="failed API key"' in line)
    assert float(failed.split()[-1]) == codes.count(401)
    lines = [r for r in caplog.records if r.name == "ui.visitors"]
    assert 1 <= len(lines) <= quietlog.PER_CLIENT + 1 and not any(r.exc_info for r in caplog.records)


def test_a_validation_error_a_handler_raises_is_one_line_never_a_traceback_nor_counted_unexpected(caplog):
    """Compare's validation errors (gr.Error) logged a traceback the first time per code location."""
    import gradio as gr

    from ui.compare import CompareHandlers

    budget = quietlog.LogBudget()
    try:
        raise gr.Error("pick 2–12 configurations; these choices make 1", title="Invalid request")
    except gr.Error as exc:
        caught = exc
    with caplog.at_level(logging.DEBUG, logger="ui.visitors"):
        assert budget.failure(quietlog.QUEUE, "an event", caught) == 400
    assert not any(r.exc_info for r in caplog.records) and not budget.unexpected
    with pytest.raises(gr.Error) as refused:
        CompareHandlers._configs(None, ["cpu"], ["fp32"], [], [])  # no mode picked: no configuration
    assert refused.value.print_exception is False  # Gradio prints no traceback for it


def test_gradios_per_session_tables_are_bounded_past_the_state_cap(manager):
    """Sessions crept about 8 KB each past the 500-session state cap: a streaming run's last outputs, the
    messages and event ids of sessions nobody reads. Each table now keeps at most twice the cap."""
    from ui import build_demo
    from ui.blocks import STATE_SESSIONS
    from ui.sessions import SESSIONS_PER_STATE

    demo = build_demo(manager.serving())
    cap = SESSIONS_PER_STATE * STATE_SESSIONS
    for i in range(3 * cap):
        demo.pending_diff_streams[f"s{i}"]["run"] = [None] * 12  # as Gradio's handle_streaming_diffs does
        demo.pending_streams[f"s{i}"].setdefault("run", {})
        demo._queue.pending_event_ids_session[f"s{i}"] = {f"e{i}"}
        demo._queue.pending_messages_per_session[f"s{i}"] = object()
    for table in (demo.pending_diff_streams, demo.pending_streams, demo._queue.pending_event_ids_session,
                  demo._queue.pending_messages_per_session):
        assert len(table) == cap and f"s{3 * cap - 1}" in table and "s0" not in table
    with pytest.raises(KeyError):
        demo._queue.pending_event_ids_session["never"]  # still a dict's answer to a session it does not have
    demo.close()


@pytest.mark.parametrize("steps", ["\u00b2", "9" * 4500, "\u0661\u0662"])
def test_the_gradio_apis_number_fields_are_typed_errors_never_unexpected_ones(steps):
    """The page's and /generate's run feed read steps with isdigit() (then int() failed on "²" and 4,500
    digits); the memory lever field read block counts the same way."""
    from engine.config.presets import get_preset
    from engine.config.request import ImageRequest
    from engine.config.validation import build_request
    from engine.protocol import MemoryLevers
    from ui.common import _steps_or_none

    assert _steps_or_none(steps) is None and _steps_or_none("8") == 8
    with pytest.raises(InvalidRequest, match="steps"):
        build_request(get_preset("tiny-shapes"), ImageRequest(preset="tiny-shapes", prompt="x", steps=steps))
    with pytest.raises(InvalidRequest, match="memory lever"):
        MemoryLevers.parse(f"group:block:{steps[:100]}")


@pytest.mark.parametrize("path", ["/gradio_api/call/generate", "/gradio_api/queue/join", "/gradio_api/run/predict"])
def test_the_gradio_apis_deep_or_long_json_is_a_400_without_a_traceback(app, caplog, path):
    url, _ = app
    with caplog.at_level(logging.INFO), httpx.Client(timeout=60) as http:
        answers = [http.post(url + path, content=body, headers={"content-type": "application/json",
                                                                  "x-forwarded-for": "10.8.0.1"})
                   for body in ("[" * 100_000 + "]" * 100_000, '{"data": [' + DIGITS + "]}")]
    assert [a.status_code for a in answers] == [400, 400], [a.text[:200] for a in answers]
    assert "more than 32 deep" in answers[0].json()["detail"] and "40 digits" in answers[1].json()["detail"]
    assert not any(r.exc_info for r in caplog.records if not r.name.startswith(("httpx", "httpcore")))


def test_a_results_line_and_stats_name_the_ray_node_that_served_it():
    from ui.generate_views import run_summary, stats_rows

    result = {"engine": "tiny-shapes@cpu/fp32", "mode": "eager", "bucket": "64x64", "steps": 2, "seed": 1,
              "node": "h100-a", "timings": {"step_ms": [5.0, 5.0], "total_ms": 20.0, "median_step_ms": 5.0}}
    assert "on node h100-a" in run_summary(result)
    assert any(row[0] == "engine" and row[1].endswith("on node h100-a") for row in stats_rows(result))
    assert "on node" not in run_summary({**result, "node": None})


def test_a_full_queue_group_still_takes_a_caller_holding_less_than_an_equal_share():
    """The group's bound (--queue-size) refused everyone once a few clients filled it; now the full group still
    takes a client holding fewer events than an equal share, up to twice its bound, and refuses the heavy ones."""
    from types import SimpleNamespace

    from ui.edge import EdgeConfig, EdgeGuard

    def event(address: str):
        return SimpleNamespace(request=SimpleNamespace(headers={}, client=SimpleNamespace(host=address)))

    guard = EdgeGuard(EdgeConfig(group_queue=8, client_events=None, sockets=None))
    waiting = [event(f"10.0.0.{i % 2}") for i in range(8)]  # two clients, 4 events each: the group is full
    guard.streams.queue = SimpleNamespace(event_queue_per_concurrency_id={"engines": SimpleNamespace(queue=waiting)},
                                          active_jobs=[])
    assert "The queue is full" in guard._admit("engines", "10.0.0.0")  # a heavy client: refused
    assert guard._admit("engines", "10.0.0.9") is None  # a newcomer: 0 of an equal share of 8 / 3
    guard._release("engines", "10.0.0.9")
    waiting.extend(event(f"10.1.0.{i}") for i in range(8))  # twice the bound: no one more
    assert "The queue is full" in guard._admit("engines", "10.0.0.9")
