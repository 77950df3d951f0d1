"""Where the server's API key and default set come from, and which options it takes (no
server starts)."""

from __future__ import annotations

import pytest

from flows.cli import main
from pipeline.config import parse
from pipeline.errors import ConfigError
from pipeline.server import ServerConfig, api_key, choose_default


def test_the_key_comes_from_a_file_or_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("  s3cret-from-file\n")
    assert api_key(None, {}) is None
    assert api_key(None, {"EMBEDPIPE_API_KEY": "s3cret"}) == "s3cret"
    assert api_key(str(key_file), {}) == "s3cret-from-file"
    assert api_key(None, {"EMBEDPIPE_API_KEY_FILE": str(key_file)}) == "s3cret-from-file"


@pytest.mark.parametrize(("flag", "env", "reason"), [
    ("KEYFILE", {"EMBEDPIPE_API_KEY": "a"}, "both EMBEDPIPE_API_KEY and an API key file"),
    (None, {"EMBEDPIPE_API_KEY": "  "}, "EMBEDPIPE_API_KEY is empty"),
    ("EMPTY", {}, "is empty"),
    ("MISSING", {}, "cannot read the API key file"),
    (None, {"EMBEDPIPE_API_KEY": "clé"}, "an HTTP header cannot carry"),
    (None, {"EMBEDPIPE_API_KEY": "a\tb"}, "an HTTP header cannot carry"),
])
def test_an_ambiguous_empty_or_unreadable_key_is_refused(tmp_path, flag, env, reason):
    (tmp_path / "KEYFILE").write_text("k")
    (tmp_path / "EMPTY").write_text("\n")
    with pytest.raises(ConfigError, match=reason):
        api_key(str(tmp_path / flag) if flag else None, env)


@pytest.mark.parametrize(("flag", "env", "reason"), [
    ("", {}, "--api-key-file is empty"),
    (" ", {"EMBEDPIPE_API_KEY": "a"}, "--api-key-file is empty"),
    (None, {"EMBEDPIPE_API_KEY_FILE": ""}, "EMBEDPIPE_API_KEY_FILE is empty"),
])
def test_an_empty_key_file_name_is_refused_not_served_without_a_key(flag, env, reason):
    """``--api-key-file "$KEYFILE"`` with the variable unset served with no key at all."""
    with pytest.raises(ConfigError, match=reason):
        api_key(flag, env)


@pytest.mark.parametrize(("names", "configured", "chosen"), [
    (["cls", "mean"], None, "mean"),
    (["a", "mean", "model"], None, "model"),
    (["zeta"], None, "zeta"),
    (["cls", "mean"], "cls", "cls"),
])
def test_the_default_set_is_configured_or_named_not_first_alphabetically(names, configured,
                                                                         chosen):
    assert choose_default(names, configured) == chosen


def test_the_default_set_is_never_guessed():
    with pytest.raises(ConfigError, match=r"several sets are served \(a, b\).*--default-set"):
        choose_default(["a", "b"], None)
    with pytest.raises(ConfigError, match="--default-set 'c' is not served"):
        choose_default(["a", "b"], "c")


@pytest.mark.parametrize(("option", "value", "reason"), [
    # the reload thread died on its first wait (OverflowError), the server served on unreloaded
    ("--reload-interval", "inf", "reload_interval_s: Input should be a finite number"),
    ("--reload-interval", "1e300", "reload_interval_s: Input should be less than or equal to "
                                   "86400"),
    ("--reload-interval", "nan", "reload_interval_s: Input should be a finite number"),
])
def test_a_wait_no_thread_can_make_is_refused_at_the_start(tmp_path, capsys, option, value,
                                                           reason):
    assert main(["serve", str(tmp_path), option, value]) != 0
    err = capsys.readouterr().err.strip()
    assert err == f"embedpipe serve: error: invalid server options: {reason}", err


@pytest.mark.parametrize("field", ["body_timeout_s", "queue_timeout_s", "keep_alive_s"])
def test_every_wait_of_the_server_is_finite_and_at_most_a_day(field):
    for value in (float("inf"), 86_401.0):
        with pytest.raises(ConfigError, match=field):
            parse(ServerConfig, {"out": "o", field: value}, "server options")
    assert getattr(ServerConfig(out="o", **{field: 86_400.0}), field) == 86_400.0
