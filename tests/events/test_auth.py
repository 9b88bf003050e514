"""Bearer keys: loading from flag, file and environment, header checks, loopback binds."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from events.auth import (
    ADMIN_KEY,
    API_KEY,
    AuthKeyError,
    BearerKey,
    add_key_arguments,
    challenge,
    is_loopback,
    load_key,
)

SECRET = "s3cr3t-Token_0.~+/=="


def test_a_key_accepts_exactly_its_bearer_header() -> None:
    key = BearerKey(SECRET, "--admin-key")
    assert key.accepts(f"Bearer {SECRET}")
    assert key.accepts(f"bearer {SECRET}")  # the scheme is case-insensitive (RFC 7235)
    assert key.accepts(f"  BEARER   {SECRET}  ")
    for header in [
        None,
        "",
        "Bearer",
        "Bearer ",
        SECRET,
        f"Basic {SECRET}",
        f"Bearer {SECRET}x",
        f"Bearer {SECRET[:-1]}",
        f"Bearer {SECRET.upper()}",
        f"Token {SECRET}",
    ]:
        assert not key.accepts(header), header


def test_repr_hides_the_secret() -> None:
    key = BearerKey(SECRET, "$KVROUTE_ADMIN_KEY")
    assert SECRET not in repr(key)
    assert repr(key) == "BearerKey(source='$KVROUTE_ADMIN_KEY')"


@pytest.mark.parametrize("secret", ["", "two words", "tab\there", "é", "a\nb", "=abc"])
def test_a_key_a_header_cannot_carry_is_refused(secret: str) -> None:
    with pytest.raises(AuthKeyError, match="the key from --api-key is empty or has characters"):
        BearerKey(secret, "--api-key")


def test_flag_wins_then_file_then_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "admin.key"
    key_file.write_text("from-file\nignored second line\n")
    env = {"KVROUTE_ADMIN_KEY": "from-env"}
    by_flag = load_key(ADMIN_KEY, "from-flag", None, env)
    assert by_flag is not None and by_flag.accepts("Bearer from-flag")
    assert by_flag.source == "--admin-key"
    by_file = load_key(ADMIN_KEY, None, key_file, env)
    assert by_file is not None and by_file.accepts("Bearer from-file")
    assert by_file.source == f"--admin-key-file {key_file}"
    by_env = load_key(ADMIN_KEY, None, None, env)
    assert by_env is not None and by_env.accepts("Bearer from-env")
    assert by_env.source == "$KVROUTE_ADMIN_KEY"
    by_env_file = load_key(API_KEY, None, None, {"KVROUTE_API_KEY_FILE": str(key_file)})
    assert by_env_file is not None and by_env_file.accepts("Bearer from-file")
    assert by_env_file.source == f"$KVROUTE_API_KEY_FILE {key_file}"
    assert load_key(ADMIN_KEY, None, None, {"KVROUTE_API_KEY": "x"}) is None


@pytest.mark.parametrize(
    ("value", "file", "env", "message"),
    [
        ("a", "f", {}, "give --admin-key or --admin-key-file, not both"),
        (None, None, {"KVROUTE_ADMIN_KEY": "a", "KVROUTE_ADMIN_KEY_FILE": "f"},
         r"set \$KVROUTE_ADMIN_KEY or \$KVROUTE_ADMIN_KEY_FILE, not both"),
        (None, "/nonexistent/admin.key", {}, "cannot read the key file '/nonexistent/admin.key'"),
        (None, None, {"KVROUTE_ADMIN_KEY": ""}, r"the key from \$KVROUTE_ADMIN_KEY is empty"),
    ],
)  # fmt: skip
def test_ambiguous_missing_or_empty_keys_are_errors(
    value: str | None, file: str | None, env: dict[str, str], message: str
) -> None:
    with pytest.raises(AuthKeyError, match=message):
        load_key(ADMIN_KEY, value, file, env)


def test_an_empty_key_file_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.key"
    empty.write_text("")
    with pytest.raises(AuthKeyError, match=r"--admin-key-file .*empty\.key is empty"):
        load_key(ADMIN_KEY, None, empty, {})


def test_parser_flags_default_to_none_so_the_environment_stays_out_of_argparse() -> None:
    parser = argparse.ArgumentParser()
    add_key_arguments(parser, ADMIN_KEY)
    add_key_arguments(parser, API_KEY)
    args = parser.parse_args(["--api-key-file", "/k", "--admin-key", "abc"])
    assert (args.admin_key, args.admin_key_file, args.api_key, args.api_key_file) == (
        "abc",
        None,
        None,
        "/k",
    )
    assert "$KVROUTE_ADMIN_KEY" in parser.format_help()


def test_challenges_follow_rfc_6750() -> None:
    assert challenge(None) == 'Bearer realm="kvroute"'
    assert challenge("") == 'Bearer realm="kvroute"'
    assert challenge("Bearer wrong") == 'Bearer realm="kvroute", error="invalid_token"'
    assert challenge("Basic dXNlcjpwdw==") == 'Bearer realm="kvroute", error="invalid_request"'


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("::ffff:10.0.0.1", False),
        ("0.0.0.0", False),
        ("", False),
        ("::", False),
        ("10.0.0.7", False),
        ("192.168.1.2", False),
        ("fe80::1", False),
        ("worker-3.cluster.local", False),
        ("127.0.0.1.nip.io", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
