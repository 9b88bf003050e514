"""``kvroute router``: flags, config files (TOML and JSON), clear failures, a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from events.curve import CurveKeyError, CurveKeyPair, load_public_key, write_keypair
from router.cli.main import COMMANDS
from router.cli.router import (
    RouterCliError,
    build_parser,
    config_from_args,
    main,
    parse_worker_flag,
)
from router.routing.cost import CostWeights
from router.workers.registry import WorkerRecord

ROOT = Path(__file__).resolve().parents[2]


def test_worker_flag_maps_onto_a_record() -> None:
    spec = "w1=http://127.0.0.1:8101,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558"
    spec += ",topic=kv,block-size=32"
    assert parse_worker_flag(spec) == WorkerRecord(
        worker_id="w1",
        http_url="http://127.0.0.1:8101",
        events_endpoint="tcp://127.0.0.1:5557",
        replay_endpoint="tcp://127.0.0.1:5558",
        topic="kv",
        block_size=32,
    )
    vllm = parse_worker_flag("v=http://h:8000,events=tcp://h:5557,kind=vllm")
    assert (vllm.kind, vllm.replay_endpoint, vllm.block_size) == ("vllm", None, 16)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("w1", "expected ID=HTTP_URL,events=ENDPOINT"),
        ("w1=127.0.0.1:8000,events=tcp://h:1", "expected ID=HTTP_URL,events=ENDPOINT"),
        ("w1=http://h:1", "events=ENDPOINT is required"),
        ("w1=http://h:1,events=tcp://h:1,colour=red", "bad option 'colour=red'"),
        ("w1=http://h:1,events=tcp://h:1,block-size=x", "invalid literal for int()"),
        ("w 1=http://h:1,events=tcp://h:1", "worker id 'w 1' is not valid"),
    ],
)
def test_bad_worker_flags_say_what_is_expected(spec: str, message: str) -> None:
    with pytest.raises(RouterCliError) as info:
        parse_worker_flag(spec)
    assert message in str(info.value)


def test_server_key_and_client_key_load_the_curve_key_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker_public, _ = write_keypair(tmp_path, "worker")
    _, router_secret = write_keypair(tmp_path, "router")
    spec = f"w=http://h:1,events=tcp://h:2,server_key={worker_public}"
    args = build_parser().parse_args(["--worker", spec, "--client-key", str(router_secret)])
    config = config_from_args(args, "redis://x")
    assert [w.server_key for w in config.workers] == [load_public_key(worker_public).decode()]
    assert config.client_keys == CurveKeyPair.load(router_secret)
    monkeypatch.setenv("KVROUTE_CLIENT_KEY", str(router_secret))
    from_env = config_from_args(build_parser().parse_args([]), "redis://x")
    assert from_env.client_keys == CurveKeyPair.load(router_secret)
    monkeypatch.delenv("KVROUTE_CLIENT_KEY")
    fresh = config_from_args(build_parser().parse_args([]), "redis://x").client_keys
    assert fresh != CurveKeyPair.load(router_secret)
    with pytest.raises(RouterCliError, match="server_key: cannot read CURVE key file"):
        parse_worker_flag(f"w=http://h:1,events=tcp://h:2,server_key={tmp_path / 'none.key'}")
    missing = ["--client-key", str(tmp_path / "none.key_secret")]
    with pytest.raises(CurveKeyError, match="cannot read CURVE key file"):
        config_from_args(build_parser().parse_args(missing), "redis://x")


def test_config_file_toml_and_json_with_flags_winning(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text(
        'namespace = "prod"\nport = 9000\npolicy = "least_loaded"\ndecode_weight = 2.5\n'
        '[[workers]]\nworker_id = "a"\nurl = "http://h:1"\nevents = "tcp://h:2"\n'
        '[[workers]]\nworker_id = "b"\nurl = "http://h:3"\nevents = "tcp://h:4"\nblock_size = 8\n'
    )
    args = build_parser().parse_args(["--config", str(toml), "--port", "9100", "--worker",
                                      "c=http://h:5,events=tcp://h:6"])  # fmt: skip
    config = config_from_args(args, "redis://127.0.0.1:6379/0")
    assert (config.namespace, config.port, config.policy) == ("prod", 9100, "least_loaded")
    assert config.policy_config.weights.decode == 2.5
    assert config.policy_config.weights.prefill == CostWeights().prefill  # default kept
    assert [(w.worker_id, w.block_size) for w in config.workers] == [("a", 16), ("b", 8), ("c", 16)]
    assert config.host == "127.0.0.1"

    as_json = tmp_path / "router.json"
    settings = {
        "temperature": 0.5,
        "max_prompt_tokens": 100,
        "route_hold_s": 0.5,
        "workers": ["d=http://h:7,events=tcp://h:8"],
    }
    as_json.write_text(json.dumps(settings))
    config = config_from_args(build_parser().parse_args(["--config", str(as_json)]), "redis://x")
    assert config.policy_config.weights.temperature == 0.5
    assert config.limits.max_prompt_tokens == 100
    assert config.route_hold_s == 0.5
    assert [w.worker_id for w in config.workers] == ["d"]

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"colour": "red"}))
    with pytest.raises(RouterCliError, match="unknown settings colour"):
        config_from_args(build_parser().parse_args(["--config", str(bad)]), "redis://x")
    negative = tmp_path / "negative.json"
    negative.write_text(json.dumps({"decode_weight": -1}))
    with pytest.raises(RouterCliError, match="decode must be finite and >= 0"):
        config_from_args(build_parser().parse_args(["--config", str(negative)]), "redis://x")


def test_replica_id_from_flag_environment_or_config_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def replica_id(*argv: str) -> str | None:
        return config_from_args(build_parser().parse_args(list(argv)), "redis://x").replica_id

    assert replica_id() is None  # a random one per start
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"replica_id": "from-file"}))
    assert replica_id("--config", str(config)) == "from-file"
    monkeypatch.setenv("KVROUTE_REPLICA_ID", "router-1")
    assert replica_id("--config", str(config)) == "router-1"
    assert replica_id("--replica-id", "eu-west.2") == "eu-west.2"
    with pytest.raises(RouterCliError, match="--replica-id 'a b' is not valid"):
        replica_id("--replica-id", "a b")


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert COMMANDS["router"].module == "router.cli.router"
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    flags = "--redis --namespace --host --port --worker --config --policy --prefill-weight "
    flags += "--decode-weight --decision-log --chat-template --max-body-bytes"
    for flag in flags.split():
        assert flag in out


def test_unreachable_redis_is_a_clear_nonzero_exit(caplog: pytest.LogCaptureFixture) -> None:
    assert main(["--redis", "redis://127.0.0.1:1/0", "--port", "0"]) == 1
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in caplog.text


def test_router_process_serves_and_stops_on_sigterm(redis_url: str, namespace: str) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router",
            "router",
            "--redis",
            redis_url,
            "--namespace",
            namespace,
            "--port",
            "0",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["router"].startswith("http://127.0.0.1:")
        with urllib.request.urlopen(ready["router"] + "/health", timeout=30) as resp:
            health = json.loads(resp.read())
        assert (health["status"], health["index"], health["num_workers"]) == ("ok", "live", 0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
