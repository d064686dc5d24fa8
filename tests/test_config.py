import pytest

from shardwise.core.config import load_config, parse_override, to_toml
from shardwise.errors import ConfigError


def test_default_recipe_loads_and_round_trips(tmp_path):
    cfg = load_config(None)
    assert cfg.model.preset == "tiny" and cfg.parallel.strategy == "auto"
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    again = load_config(str(path))
    assert again == cfg


def test_overrides_are_typed():
    cfg = load_config("gpt-shakespeare", ["train.steps=7", "train.lr=1e-3", "parallel.strategy=ddp",
                                          "train.progress=false", "model.overrides={n_layer = 2}"])
    assert cfg.train.steps == 7 and cfg.train.lr == 1e-3 and cfg.parallel.strategy == "ddp"
    assert cfg.train.progress is False and cfg.model.overrides == {"n_layer": 2}
    assert parse_override("a.b=hello") == ("a.b", "hello")


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stpes'.*Did you mean 'steps'"):
        load_config(None, ["train.stpes=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trian'.*Did you mean 'train'"):
        load_config(None, ["trian.steps=3"])


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError, match=r"train.steps must be int, got 'many'"):
        load_config(None, ["train.steps=many"])


def test_unknown_strategy_lists_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown strategy 'ddpp'.*Did you mean 'ddp'.*Valid strategies: .*single"):
        load_config(None, ["parallel.strategy=ddpp"])


def test_unknown_recipe_lists_builtins():
    with pytest.raises(ConfigError, match=r"unknown recipe 'gpt-shakespear'.*gpt-shakespeare"):
        load_config("gpt-shakespear")


def test_malformed_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))


def test_missing_toml_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))


@pytest.mark.parametrize("override, message", [
    ("train.steps=0", "train.steps must be > 0"),
    ("train.micro_batch_size=-1", "micro_batch_size must be > 0"),
    ("parallel.precision=fp8", "unknown precision 'fp8'"),
    ("parallel.activation_checkpointing=some", "unknown activation_checkpointing mode"),
    ("data.val_fraction=1.5", "val_fraction must be between 0 and 1"),
])
def test_value_validation(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_an_older_torch_is_named_once_with_what_fails_there():
    from shardwise.torch_version import older_torch_note

    note = older_torch_note("2.11.0+cu130")
    assert note and "2.11.0+cu130" in note and "pipeline parallel" in note and "torch>=2.13" in note
    assert older_torch_note("2.13.0+cpu") is None and older_torch_note("2.14.1") is None
    assert older_torch_note("3.0.0") is None and older_torch_note("not-a-version") is None
