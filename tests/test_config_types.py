"""Every setting is checked against its declared type, by name, however it arrives: `--set`,
TOML, grid specs; the command line refuses bad options without a traceback."""
from __future__ import annotations

import dataclasses
import typing

import pytest

from memstudy import cli
from memstudy.byte_sizes import parse_bytes
from memstudy.config import DataConfig, MeterConfig, RunConfig, TrainConfig, from_dict, set_value
from memstudy.errors import ConfigError
from memstudy.grid.spec import GridSpec, spec_from_dict
from memstudy.typecheck import describe, field_types, typed_value


@pytest.mark.parametrize("assignment, words", [
    ("train.lr=abc", ["train.lr", "a number", "'abc'"]),
    ('train.validate="yes"', ["train.validate", "true or false"]),
    ("train.validate=1", ["train.validate", "true or false"]),
    ("train.batch_size=2.5", ["train.batch_size", "an integer"]),
    ("train.batch_size=true", ["train.batch_size", "an integer"]),
    ("train.epochs=[1]", ["train.epochs", "an integer"]),
    ("meter.nvml=maybe", ["meter.nvml", "true or false"]),
    ("data.train_images=many", ["data.train_images", "an integer"]),
    ("world_size=two", ["world_size", "an integer"]),
    ("techniques=3", ["techniques", "a list of strings"]),
    ("budget=[1]", ["budget", "a string or an integer or a number or unset"]),
    ("train.image_size=true", ["train.image_size"]),
    ("train.max_steps=none=1", ["train.max_steps"]),
    ("train.nope=1", ["train.nope", "no such setting"]),
    ("nope.lr=1", ["no config section 'nope'"]),
    ("train=1", ["train", "section"]),
    ("train.lr", ["section.key=value"]),
])
def test_set_refuses_a_wrongly_typed_value_by_name(assignment, words):
    with pytest.raises(ConfigError) as err:
        set_value(RunConfig(), assignment)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_set_converts_what_the_type_allows():
    cfg = RunConfig()
    for assignment in ("train.lr=1", "train.max_steps=none", "budget=1e9", "train.image_size=256x192",
                       "techniques=amp:bf16,checkpoint", "label=free text", "train.device=cuda:1"):
        set_value(cfg, assignment)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)  # an integer widened to float
    assert cfg.train.max_steps is None and cfg.budget == 1e9
    assert cfg.train.image_size == "256x192" and cfg.techniques == ["amp:bf16", "checkpoint"]
    assert cfg.label == "free text" and cfg.train.device == "cuda:1"


@pytest.mark.parametrize("raw, words", [
    ({"train": {"validate": "yes"}}, ["train.validate", "true or false"]),
    ({"train": {"lr": "fast"}}, ["train.lr", "a number"]),
    ({"data": {"seed": 1.5}}, ["data.seed", "an integer"]),
    ({"meter": {"tensor": 1}}, ["meter.tensor", "a string"]),
    ({"world_size": "2"}, ["world_size", "an integer"]),
    ({"train": 3}, ["[train] must be a table"]),
    ({"train": {"lrr": 1}}, ["lrr", "[train]"]),
])
def test_toml_values_are_checked_by_name(raw, words):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    for word in words:
        assert word in str(err.value), str(err.value)


@pytest.mark.parametrize("raw, words", [
    ({"epochs": "x"}, ["grid epochs", "an integer or unset"]),
    ({"base": 3}, ["grid base", "a table"]),
    ({"timeout_s": "long"}, ["grid timeout_s"]),
    ({"budget": True}, ["grid budget"]),
    ({"batch_sizes": [1, "2"]}, ["grid batch_sizes"]),
    ({"base": {"train": {"lr": "x"}}}, ["train.lr"]),
])
def test_grid_spec_values_are_checked_by_name(raw, words):
    with pytest.raises(ConfigError) as err:
        spec = spec_from_dict(raw)
        from memstudy.grid import cell_config
        cell_config(spec, [], 256, 1, 0).check()
    for word in words:
        assert word in str(err.value), str(err.value)


def test_every_setting_has_a_checkable_type():
    """New fields are checked with no extra code, as long as their type is one typecheck knows:
    the default of every setting passes its own declared type."""
    for cls in (TrainConfig, DataConfig, MeterConfig, RunConfig, GridSpec):
        hints = field_types(cls)
        instance = cls()
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            if not dataclasses.is_dataclass(value):
                typed_value(f"{cls.__name__}.{f.name}", hints[f.name], value)
    assert describe(int | str | None) == "an integer or a string or unset"
    assert typing.get_origin(field_types(TrainConfig)["image_size"]) is not None  # a union


@pytest.mark.parametrize("text, expected", [
    ("1e9", 1_000_000_000), ("8GiB", 8 * 1024**3), ("512 MiB", 512 * 1024**2), (1e9, 10**9),
    ("2.5e3", 2500), (4096, 4096), ("1.5G", int(1.5 * 1024**3)),
])
def test_byte_sizes_accept_what_the_docs_offer(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["-1", "8 parsecs", "", True, -5, float("inf"), "1e"])
def test_byte_sizes_refuse_the_rest(text):
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(text, "budget")


# -- the command line ------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["run", "--set", "train.lr=abc"], ["train.lr must be a number"]),
    (["run", "--budget", "lots"], ["budget 'lots' is not a byte size"]),
    (["run", "--set", "train.validate=yes"], ["train.validate must be true or false"]),
    (["run", "-t", "nope"], ["unknown technique 'nope'"]),
    (["run", "-t", "checkpoint:placement=nowhere"], ["placement='nowhere' is not one of"]),
])
def test_bad_settings_end_in_a_named_error_not_a_traceback(argv, words, capsys, tmp_path):
    assert cli.main([*argv, "--db", str(tmp_path / "r.sqlite")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memstudy: error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    db = tmp_path / "r.sqlite"
    if db.exists():  # refused before anything ran: no run recorded
        from memstudy.store import ResultsDB
        assert ResultsDB(db).runs() == []


@pytest.mark.parametrize("argv, words", [
    (["run", "--batch-size", "abc"], ["--batch-size", "invalid int value: 'abc'"]),
    (["run", "--steps", "1.5"], ["--steps", "invalid int value"]),
    (["grid"], ["the following arguments are required: spec"]),
    (["report", "--format", "pdf"], ["--format", "invalid choice: 'pdf'"]),
    (["run", "--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    (["nope"], ["invalid choice: 'nope'"]),
])
def test_option_parser_errors_name_the_option(argv, words, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("command", ["run", "grid", "maxres", "report", "merge", "techniques"])
def test_db_is_accepted_after_every_subcommand(command):
    parser = cli.build_parser()
    extra = {"grid": ["spec.toml"], "merge": ["a.sqlite"]}.get(command, [])
    args = parser.parse_args([command, *extra, "--db", "after.sqlite"])
    assert args.db == "after.sqlite"
    args = parser.parse_args(["--db", "before.sqlite", command, *extra])
    assert args.db == "before.sqlite"
