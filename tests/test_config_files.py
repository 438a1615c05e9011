"""Config inputs: JSON files (errors name the file, line and column; duplicate keys and NaN are
refused) and the types a config may be given as."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partita.config import ConfigError, load_config
from tests._config_helpers import DEEPSPEED_ZERO2


# ----------------------------------------------------------------------------- files and inputs


def test_load_from_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DEEPSPEED_ZERO2))
    for given in (path, str(path)):
        cfg = load_config(given)
        assert cfg.zero_optimization.stage == 2
        assert cfg.to_dict() == DEEPSPEED_ZERO2


def test_errors_from_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"zero_optimization": {"stage": 7}}')
    with pytest.raises(ConfigError, match=r"^Invalid partita config in .*bad\.json \(1 problem\):"):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=r"^config file not found: .*nope\.json"):
        load_config(path)


def test_not_a_json_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is not a \.json file; pass the path of a JSON file"):
        load_config(str(tmp_path / "ds.yaml"))
    folder = tmp_path / "dir.json"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(folder)


def test_invalid_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"invalid JSON in {path} at line 3 column 28: Expecting property name enclosed in double quotes")
    assert '"fp16": {"enabled": true,}' in message


def test_duplicate_keys_in_json(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match=r"duplicate keys in .*dup\.json: 'train_batch_size' appears more than once"):
        load_config(path)


def test_json_file_must_hold_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"must hold a JSON object \{\.\.\.\}, got a list"):
        load_config(path)


def test_json_nan_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nan.json"
    path.write_text('{"gradient_clipping": NaN}')
    with pytest.raises(ConfigError, match="NaN is not valid JSON"):
        load_config(path)


@pytest.mark.parametrize(("value", "name"), [([1], "list"), (3, "int"), (None, "NoneType"), (b"{}", "bytes")])
def test_other_config_types_are_refused(value: object, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^config must be a dict or the path of a \.json file .*, got {name}"):
        load_config(value)  # type: ignore[arg-type]
