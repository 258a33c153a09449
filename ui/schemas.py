"""JSON schemas of the API endpoints' results, for their API page, gradio_client's view_api() and the MCP tools'
listing (a `dict` return hint shows as "Any"). Each names the fields a caller reads; an object may carry more
(additionalProperties), so a field added later is no break."""

from __future__ import annotations

STR, NUM, INT, BOOL = {"type": "string"}, {"type": "number"}, {"type": "integer"}, {"type": "boolean"}


def optional(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def array(items: dict) -> dict:
    return {"type": "array", "items": items}


def obj(more: bool = True, **properties) -> dict:
    """An object with these properties (each a schema, or (schema, description))."""
    props = {name: ({**value[0], "description": value[1]} if isinstance(value, tuple) else value)
             for name, value in properties.items()}
    return {"type": "object", "properties": props, **({"additionalProperties": True} if more else {})}


ENGINE_NAME = (STR, "preset@device/precision, e.g. tiny-shapes@cpu/fp32")
BUCKET = obj(
    mode=STR, size=(STR, "WIDTHxHEIGHT"), batch=(INT, "images per pipeline call of this graph"),
    references=(array(STR), "an edit bucket's reference sizes, each WIDTHxHEIGHT ([]: text to image)"),
    state={"enum": ["cold", "queued", "compiling", "warm", "failed"]}, error=optional(STR),
    compile_s=optional(NUM), warmup_s=optional(NUM), requests_served=INT, batches_served=INT,
)
STATUS = array(obj(
    engine=ENGINE_NAME, state={"enum": ["loading", "ready", "down"]}, error=optional(STR), load_s=optional(NUM),
    notices=array(STR), modes=array(STR), pending=(INT, "requests waiting on it"), buckets=array(BUCKET),
))
SYSTEM = obj(
    devices=array(obj(name=STR, label=STR, available=BOOL, auto=BOOL, reason=(STR, "why it is not available"),
                      modes=array(STR), memory=STR)),
    versions=obj(), caches=obj(), environment=obj(),
    engines=array(obj(engine=ENGINE_NAME, state=STR, load_s=optional(NUM), notices=array(STR), error=optional(STR))),
    host=(obj(), "budgets and use per device, engines started and evicted, the compile scheduler, the policy"),
    web_server=(obj(), "the web edge's bounds and refusals"),
)
WARMED = obj(engine=ENGINE_NAME, mode=STR, queued=(array(STR), "the sizes it compiles now"))
RESTARTED = obj(engine=ENGINE_NAME, restarted=BOOL)
ADVICE_JOB = obj(
    job=(STR, "the id advise_poll takes"), state={"enum": ["running", "done", "failed", "cancelled"]},
    progress=(array(optional(INT)), "[configurations measured, of how many] (the total is null until known)"),
    desc=(STR, "what it measures now"), elapsed_s=NUM, error=optional(STR),
    result=optional(obj(pick=(optional(obj(preset=STR, device=STR, precision=STR, mode=STR, step_cache=STR,
                                            attention=STR)), "the recommended configuration (null: none)"),
                        rows=(array(obj()), "every configuration measured: speedup, quality, why kept or not"))),
)
