import re
from pathlib import Path

import pytest

from messages.settings import SettingsBounds
from runtime.config import ConfigError, is_loopback, load_config
from runtime.sizes import format_size, parse_size


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(
        'node_id = "from-file"\nmemory_limit = "1GiB"\ntelemetry_interval = 7\n'
        '[serving]\nslots = 2\nflash_attn = "off"\n'
    )
    env = {"MESH_ACTOR_MEMORY_LIMIT": "2GiB", "MESH_ACTOR_SERVING_SLOTS": "8"}
    config = load_config({"data_dir": str(tmp_path), "memory_limit": "3GiB"}, env, {"kv_unified": True})
    assert config.node_id == "from-file"
    assert config.memory_limit_bytes == 3 << 30
    assert config.telemetry_interval_s == 7.0
    assert config.telemetry_ttl_s == 21.0  # three intervals when not configured
    assert config.serving.slots == 8
    assert config.serving.flash_attn == "off"
    assert config.serving.kv_unified is True

    config = load_config({"data_dir": str(tmp_path)}, env)
    assert config.memory_limit_bytes == 2 << 30


def test_nats_table_in_file_configures_urls_and_credentials(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('[nats]\nurls = ["nats://a:4222", "nats://b:4222"]\nuser = "u"\n')
    config = load_config({"data_dir": str(tmp_path), "node_id": "n"}, {})
    assert config.nats.urls == ("nats://a:4222", "nats://b:4222")
    assert config.nats.user == "u"


@pytest.mark.parametrize(
    ("flags", "env", "needle"),
    [
        ({"memory_limit": "lots"}, {}, "--memory-limit"),
        ({"node_id": "bad id!"}, {}, "--node-id"),
        ({"nats_port": None}, {"MESH_ACTOR_NATS_PORT": "99999"}, "MESH_ACTOR_NATS_PORT"),
        ({"nats": "localhost:4222"}, {}, "not a URL"),
        ({"telemetry_interval": "5", "telemetry_ttl": "5"}, {}, "must be longer"),
        ({}, {"MESH_ACTOR_SERVING_SLOTS": "0"}, "serving settings"),
        ({}, {"MESH_ACTOR_SERVING_CACHE_TYPE_K": "q3_k"}, "cache_type_k"),
        ({}, {"MESH_ACTOR_DIRECT_PATH": "sometimes"}, "MESH_ACTOR_DIRECT_PATH"),
    ],
)
def test_invalid_values_name_their_source(
    tmp_path: Path, flags: dict[str, str], env: dict[str, str], needle: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config({"data_dir": str(tmp_path), "node_id": "n", **flags}, env)


def test_malformed_config_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("node_id = [unclosed\n")
    with pytest.raises(ConfigError, match=r"config\.toml"):
        load_config({"data_dir": str(tmp_path)}, {})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("512MiB", 512 << 20), ("8G", 8 << 30), ("1.5GiB", 3 << 29), ("2GB", 2 * 10**9), ("1k", 1024)],
)
def test_sizes_parse(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1G", "1.5", "12 parsecs", "0", "1e9", "99999999999TiB"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(1536 << 20) == "1.50 GiB"
    assert format_size(100) == "100 B"


def test_unknown_keys_in_the_config_file_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('node_id = "n"\nmemroy_limit = "1GiB"\n')
    with pytest.raises(ConfigError, match="memroy_limit"):
        load_config({"data_dir": str(tmp_path)}, {})
    (tmp_path / "config.toml").write_text('[nats]\nurl = "nats://a:4222"\n')
    with pytest.raises(ConfigError, match=r"unknown key 'url' in \[nats\]"):
        load_config({"data_dir": str(tmp_path)}, {})


def test_top_level_nats_url_in_the_config_file_is_used(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('nats = "nats://a:4222,nats://b:4222"\nnats_token = "t"\n')
    config = load_config({"data_dir": str(tmp_path), "node_id": "n"}, {})
    assert config.nats.urls == ("nats://a:4222", "nats://b:4222") and config.nats.token == "t"


def test_nats_password_comes_from_a_file_never_from_argv(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\nignored second line\n")
    config = load_config({"data_dir": str(tmp_path), "nats": "nats://a:4222", "nats_password_file": str(secret)}, {})
    assert config.nats.password == "s3cret"
    env = {"MESH_ACTOR_NATS_PASSWORD_FILE": str(secret)}
    assert load_config({"data_dir": str(tmp_path)}, env).nats.password == "s3cret"
    assert load_config({"data_dir": str(tmp_path)}, {"MESH_ACTOR_NATS_PASSWORD": "env"}).nats.password == "env"


@pytest.mark.parametrize("content", ["", "\n"])
def test_an_empty_password_file_is_refused(tmp_path: Path, content: str) -> None:
    secret = tmp_path / "secret"
    secret.write_text(content)
    with pytest.raises(ConfigError, match="empty"):
        load_config({"data_dir": str(tmp_path), "nats_password_file": str(secret)}, {})


def test_a_password_given_twice_or_a_missing_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a\n")
    with pytest.raises(ConfigError, match="not both"):
        load_config({"data_dir": str(tmp_path), "nats_password_file": str(secret)}, {"MESH_ACTOR_NATS_PASSWORD": "b"})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({"data_dir": str(tmp_path), "nats_password_file": str(tmp_path / "missing")}, {})


def test_bounds_of_a_models_own_settings_come_from_flags_environment_and_file(tmp_path: Path) -> None:
    assert load_config({"data_dir": str(tmp_path)}, {}).bounds == SettingsBounds()  # everything by default
    (tmp_path / "config.toml").write_text('[bounds]\nmax_slots = 8\ncache_types = ["f16", "q8_0"]\n')
    config = load_config({"data_dir": str(tmp_path)}, {"MESH_ACTOR_BOUNDS_SPEC_TYPES": "draft-mtp, ngram-simple"})
    assert config.bounds.max_slots == 8 and config.bounds.cache_types == ("f16", "q8_0")
    assert config.bounds.spec_types == ("draft-mtp", "ngram-simple")
    flagged = load_config({"data_dir": str(tmp_path)}, {}, None, {"max_slots": 2, "flash_attn": "on"})
    assert flagged.bounds.max_slots == 2 and flagged.bounds.flash_attn == ("on",)
    with pytest.raises(ConfigError, match="bounds"):
        load_config({"data_dir": str(tmp_path)}, {"MESH_ACTOR_BOUNDS_CACHE_TYPES": "f16,q3"})


def test_what_a_server_is_for_is_a_models_setting_not_a_nodes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kind is a model's own"):
        load_config({"data_dir": str(tmp_path)}, {"MESH_ACTOR_SERVING_KIND": "embedding"})
    (tmp_path / "config.toml").write_text('[serving]\npooling = "mean"\n')
    with pytest.raises(ConfigError, match="pooling is a model's own"):
        load_config({"data_dir": str(tmp_path)}, {})
    (tmp_path / "config.toml").write_text('[bounds]\nkinds = ["generate"]\n')  # a node may serve no embeddings
    assert load_config({"data_dir": str(tmp_path)}, {}).bounds.kinds == ("generate",)


def test_the_api_key_comes_from_a_file_or_the_environment_never_argv(tmp_path: Path) -> None:
    keyfile = tmp_path / "key"
    keyfile.write_text("s3cret\n")
    beyond = {"data_dir": str(tmp_path), "http": "0.0.0.0:8080"}
    assert load_config({**beyond, "api_key_file": str(keyfile)}, {}).api_key == "s3cret"
    assert load_config(beyond, {"MESH_ACTOR_API_KEY": "env"}).api_key == "env"
    with pytest.raises(ConfigError, match="once"):
        load_config({**beyond, "api_key_file": str(keyfile)}, {"MESH_ACTOR_API_KEY": "env"})
    with pytest.raises(ConfigError, match="beyond loopback"):
        load_config(beyond, {})


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.4.5.6", True), ("::1", True), ("localhost", True),
     ("127.evil.example.com", False), ("0.0.0.0", False), ("10.0.0.1", False), ("example.com", False)],
)  # fmt: skip
def test_only_loopback_addresses_are_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_the_client_share_is_a_fraction_of_each_node_half_by_default(tmp_path: Path) -> None:
    assert load_config({"data_dir": str(tmp_path)}, {}).client_share == 0.5
    assert load_config({"data_dir": str(tmp_path), "client_share": "0.25"}, {}).client_share == 0.25
    assert load_config({"data_dir": str(tmp_path)}, {"MESH_ACTOR_CLIENT_SHARE": "1"}).client_share == 1.0
    for bad in ("0", "1.5", "-0.1", "half"):
        with pytest.raises(ConfigError, match="--client-share"):
            load_config({"data_dir": str(tmp_path), "client_share": bad}, {})


def test_the_direct_data_path_is_on_unless_turned_off(tmp_path: Path) -> None:
    assert load_config({"data_dir": str(tmp_path)}, {}).direct_path is True
    assert load_config({"data_dir": str(tmp_path), "direct_path": False}, {}).direct_path is False
    assert load_config({"data_dir": str(tmp_path)}, {"MESH_ACTOR_DIRECT_PATH": "false"}).direct_path is False
    (tmp_path / "config.toml").write_text("direct_path = false\n")
    assert load_config({"data_dir": str(tmp_path)}, {}).direct_path is False
