"""One entry per lever, one field per flag: a step cache added to the registry (and nowhere else) is in the
vocabulary, the CLI's help, the UI's choices and the refusals; a field added to a config dataclass is a flag
whose parsed value comes back into the dataclass. No compile, no weights: eager and table-level only."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.errors import InvalidRequest, UnsupportedCombination
from engine.protocol import (
    STEP_CACHES,
    BatchingOptions,
    CacheParam,
    EngineOptions,
    Mode,
    RecipeOptions,
    StepCache,
    StepCacheEntry,
    StepCacheKind,
)
from engine.protocol.flagfields import NEGATED, OPTIONAL_BOOL, SWITCH, Decimal, OneOf, Whole, flag
from engine.protocol.stepcaches import ATTENTION, ParamRange

REPO = Path(__file__).resolve().parent.parent

FAKE = StepCacheEntry(
    "skip-every", "recompute the attention outputs every INTERVAL steps (a test's cache)",
    (CacheParam("interval", 4, ParamRange(2, 9)),), "PyramidAttentionBroadcastConfig", ATTENTION,
    lambda c, run: {"spatial_attention_block_skip_range": c.interval, "current_timestep_callback": run.timestep})


@pytest.fixture
def fake_cache(monkeypatch):
    monkeypatch.setitem(STEP_CACHES, FAKE.name, FAKE)
    return FAKE


def test_a_step_cache_added_to_the_registry_is_in_the_vocabulary(fake_cache):
    assert "skip-every" in StepCacheKind.values() and StepCacheKind.SKIP_EVERY == "skip-every"
    assert StepCacheKind("skip-every") is StepCacheKind.parse(" Skip-Every ")
    assert pickle.loads(pickle.dumps(StepCacheKind.SKIP_EVERY)) is StepCacheKind.SKIP_EVERY
    cache = StepCache.parse("skip-every:6")
    assert (cache.kind, cache.interval, str(cache)) == ("skip-every", 6, "skip-every:6")
    assert str(StepCache.parse("skip-every")) == "skip-every:4"  # its default
    assert "skip-every[:INTERVAL]" in StepCache.forms()
    with pytest.raises(InvalidRequest, match=r"interval 12 is out of range: allowed 2\.\.9; valid forms: .*skip-every"):
        StepCache.parse("skip-every:12")
    with pytest.raises(InvalidRequest, match="takes no threshold"):
        StepCache("skip-every", threshold=0.1)


def test_a_step_cache_added_to_the_registry_is_in_the_cli_help(fake_cache, capsys):
    from engine import cli

    with pytest.raises(SystemExit):
        cli.build_parser("generate").parse_args(["generate", "--help"])
    assert "skip-every[:INTERVAL]" in re.sub(r"\s+", "", capsys.readouterr().out)  # argparse wraps at hyphens


def test_a_step_cache_added_to_the_registry_is_offered_and_refused_by_its_entry(fake_cache):
    from engine import devices
    from engine.config.presets import load_presets
    from engine.pipeline import stepcache
    from ui import views

    preset, spec = load_presets()["tiny-shapes"], devices.get_device("cpu")
    rows = {r["name"]: r for r in stepcache.available_step_caches(preset, spec, "eager")}
    assert rows["skip-every"]["usable"] and rows["skip-every"]["ranges"] == {"interval": "2..9"}
    assert ("skip-every:4", "skip-every:4") in views.step_cache_choices(list(rows.values()))
    assert stepcache.check_step_cache("skip-every:3", preset, spec, "eager") == [
        "step cache skip-every:3: recompute the attention outputs every INTERVAL steps (a test's cache)"]
    # Its hook level says where it cannot run, in the same words as the built-in attention-level caches.
    with pytest.raises(UnsupportedCombination) as refused:
        stepcache.check_step_cache("skip-every", preset, spec, "regional")
    assert "its hooks sit on the attention layers inside the repeated blocks" in str(refused.value)
    assert "use eager, or first-block / magcache with regional" in str(refused.value)
    with pytest.raises(UnsupportedCombination, match="compile traces the whole denoiser"):
        stepcache.check_step_cache("skip-every", preset, spec, "compile")
    # How it applies is its entry's too: the diffusers config it names, with its arguments.
    config = stepcache.diffusers_config(StepCache.parse("skip-every:5"), steps=8, cfg=False, timestep=lambda: 1)
    assert type(config).__name__ == "PyramidAttentionBroadcastConfig"
    assert config.spatial_attention_block_skip_range == 5


def test_a_step_cache_gone_from_the_registry_is_unknown():
    assert "skip-every" not in StepCacheKind.values()
    with pytest.raises(InvalidRequest, match="unknown step cache 'skip-every'"):
        StepCache.parse("skip-every")


def _constants(tree: ast.AST) -> list[str]:
    """The string constants of a module, docstrings left out."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_module_but_the_registry_lists_the_step_caches():
    """A list of cache names in code (a help text, a table, choices) is a second table to keep in step: three or
    more names in one module's strings count as one. The bench (its own package) is not scanned."""
    names = [name for name in STEP_CACHES if name != "none"]
    home = REPO / "engine" / "protocol" / "stepcaches.py"
    listing = {}
    for path in [*(REPO / "engine").rglob("*.py"), *(REPO / "ui").rglob("*.py"), REPO / "app.py"]:
        if path == home:
            continue
        text = " ".join(_constants(ast.parse(path.read_text())))
        named = [n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
        if len(named) >= 3:
            listing[str(path.relative_to(REPO))] = named
    assert not listing, f"modules listing step caches instead of reading STEP_CACHES: {listing}"
    print(f"\nstep caches: {len(names)} entries in one table; modules listing them elsewhere: {len(listing)}")


# ------------------------------------------------------------------------------------------------
# Flags from config fields
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MadeUpOptions:
    """A config nobody wrote a flag for by hand."""

    warp_factor: int = field(default=3, metadata=flag("how fast ({default} by default)", check=Whole(1, 9)))
    ratio: float = field(default=0.5, metadata=flag("a ratio", check=Decimal(0, 1), metavar="R"))
    colour: str = field(default="red", metadata=flag("a colour", check=OneOf(lambda: ("red", "blue"), "colour")))
    loud: bool = field(default=False, metadata=flag("be loud", kind=SWITCH))
    tidy: bool = field(default=True, metadata=flag("leave it untidy", kind=NEGATED, name="--messy", dest="messy"))
    fancy: bool | None = field(default=None, metadata=flag("fancy or plain", kind=OPTIONAL_BOOL))
    from_env: str | None = field(default=None, metadata=flag("read from the environment", env="made_up"))
    internal: int = 7  # no flag


@dataclass(frozen=True)
class MoreBatching(BatchingOptions):
    batch_colour: str = field(default="grey", metadata=flag("the colour of a batch"))


def _parser(cls, defaults=None) -> argparse.ArgumentParser:
    from engine.config.flags import OneLineParser, add_fields

    parser = OneLineParser(prog="made-up")
    add_fields(parser, cls, defaults)
    return parser


def test_a_field_of_a_config_dataclass_is_a_flag_with_its_parsed_value():
    from engine.config.flags import argv_of, from_args

    parser = _parser(MadeUpOptions, {"made_up": "from-env"})
    help_text = re.sub(r"\s+", " ", parser.format_help())
    for shown in ("--warp-factor WARP_FACTOR how fast (3 by default)", "--ratio R", "--loud", "--messy",
                  "--fancy, --no-fancy", "--from-env"):
        assert shown in help_text, shown
    assert "--internal" not in help_text
    assert from_args(MadeUpOptions, parser.parse_args([])) == MadeUpOptions(from_env="from-env")
    args = parser.parse_args(["--warp-factor", "9", "--ratio", "0.25", "--colour", "BLUE", "--loud", "--messy",
                              "--no-fancy"])
    options = from_args(MadeUpOptions, args, internal=8)
    assert options == MadeUpOptions(9, 0.25, "blue", True, False, False, "from-env", 8)
    assert argv_of(MadeUpOptions, args) == ["--warp-factor", "9", "--ratio", "0.25", "--colour", "blue", "--loud",
                                            "--messy", "--no-fancy", "--from-env", "from-env"]
    assert from_args(MadeUpOptions, parser.parse_args(argv_of(MadeUpOptions, args)), internal=8) == options


@pytest.mark.parametrize("argv, said", [(["--warp-factor", "10"], "10 is out of range; allowed: 1..9"),
                                        (["--colour", "green"], "unknown colour 'green'; choose one of: red, blue")])
def test_a_made_up_flag_is_checked_as_it_is_parsed(argv, said, capsys):
    with pytest.raises(SystemExit) as stopped:
        _parser(MadeUpOptions).parse_args(argv)
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_a_field_added_to_an_engine_config_is_an_engine_flag():
    from engine.config.flags import from_args

    args = _parser(MoreBatching).parse_args(["--batch-colour", "teal", "--max-batch", "4"])
    assert from_args(MoreBatching, args) == MoreBatching(max_batch=4, batch_colour="teal")


def test_an_attention_backend_added_to_its_table_is_a_choice_a_row_and_a_refusal(monkeypatch):
    import app
    from engine import devices
    from engine.pipeline import attention

    monkeypatch.setitem(attention.BACKENDS, "made_up_flash",
                        attention.Backend("made_up_flash", "sdpa", "a backend of a test", dtypes=attention.HALF))
    args = app.build_parser().parse_args(["--attention-backend", "Made_Up_Flash"])
    assert args.attention_backend == "made_up_flash"
    spec = devices.get_device("cpu")
    rows = {r["name"]: r for r in attention.attention_table(spec, "fp32")}
    assert rows["made_up_flash"]["reason"] == "made_up_flash takes bf16 or fp16 only, not fp32"
    with pytest.raises(UnsupportedCombination, match="attention backend 'made_up_flash' cannot run on CPU"):
        attention.check_backend("made_up_flash", spec, "fp32")


@dataclass(frozen=True)
class TweakedRecipe(RecipeOptions):
    tiny_tweak: bool = field(default=False, metadata=flag("tweak the denoiser a little", kind=SWITCH))


def test_a_recipe_lever_is_its_field_and_one_row(monkeypatch):
    """The field is the flag; the row says how it applies, which modes it rules out and whether the graph
    changes with it."""
    from engine.config.flags import from_args
    from engine.pipeline import recipes

    assert set(recipes.RECIPE_LEVERS) <= {f.name for f in dataclasses.fields(RecipeOptions)}
    monkeypatch.setitem(recipes.RECIPE_LEVERS, "tiny_tweak", recipes.RecipeLever(
        "tiny_tweak", load=lambda pipe, denoiser: f"tweaked {denoiser}", graph=True,
        excludes={Mode.AOT: "a tweak cannot be exported"}))
    recipe = from_args(TweakedRecipe, _parser(TweakedRecipe).parse_args(["--tiny-tweak", "--fuse-qkv"]))
    assert recipe.tiny_tweak and recipe.fuse_qkv
    options = EngineOptions(recipe=dataclasses.replace(recipe, fuse_qkv=False))
    assert recipes.apply_load_steps(object(), "transformer", options) == ["tweaked transformer"]
    assert recipes.excluded_mode(options, Mode.AOT) == "a tweak cannot be exported"
    assert recipes.excluded_mode(options, Mode.EAGER) == ""
    assert recipes.graph_options(options.recipe)["tiny_tweak"] is True
    assert recipes.excluded_mode(EngineOptions(cpu_offload=True), Mode.COMPILE) == "CPU offload is on"
