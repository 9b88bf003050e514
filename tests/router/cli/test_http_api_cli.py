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
from router.cli.router import main
from router.cli.router_config import RouterCliError, config_from_args, parse_worker_flag
from router.cli.router_flags import build_parser
from router.front.breaker import BreakerConfig
from router.front.config import RouterConfig
from router.front.proxy_contracts import ProxyConfig
from router.routing.cost import CostWeights
from router.workers.registry import WorkerRecord
from tests.support.paths import REPO_ROOT as ROOT


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
        ("w1=http://h:1,events=tcp://h:1,block-size=x", "Expected `int`, got `str`"),
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


def test_failover_flags_and_config_keys_map_onto_the_config(tmp_path: Path) -> None:
    def config(*argv: str) -> RouterConfig:
        return config_from_args(build_parser().parse_args(list(argv)), "redis://x")

    default = config()
    assert default.proxy == ProxyConfig(
        connect_timeout_s=2.0, first_byte_timeout_s=5.0, total_timeout_s=600.0, max_attempts=2
    )
    assert default.breaker == BreakerConfig(failure_threshold=3, cooldown_s=5.0)
    assert default.limits.body_read_timeout_s == 30.0
    flags = config(
        "--proxy-connect-timeout-s", "0.5", "--proxy-first-byte-timeout-s", "12",
        "--proxy-total-timeout-s", "90", "--max-attempts", "3", "--body-read-timeout-s", "4",
        "--circuit-failures", "5", "--circuit-cooldown-s", "2.5",
    )  # fmt: skip
    assert flags.proxy == ProxyConfig(
        connect_timeout_s=0.5, first_byte_timeout_s=12.0, total_timeout_s=90.0, max_attempts=3
    )
    assert flags.breaker == BreakerConfig(failure_threshold=5, cooldown_s=2.5)
    assert flags.limits.body_read_timeout_s == 4.0
    file = tmp_path / "router.toml"
    file.write_text(
        "proxy_first_byte_timeout_s = 45\nmax_attempts = 1\ncircuit_cooldown_s = 10\n"
        "body_read_timeout_s = 7.5\n"
    )
    from_file = config("--config", str(file), "--max-attempts", "2")
    assert (from_file.proxy.first_byte_timeout_s, from_file.proxy.max_attempts) == (45.0, 2)
    assert from_file.breaker.cooldown_s == 10.0
    assert from_file.limits.body_read_timeout_s == 7.5
    for argv, message in [
        (["--max-attempts", "0"], "max_attempts must be >= 1, got 0"),
        (["--proxy-first-byte-timeout-s", "0"], "first_byte_timeout_s must be > 0, got 0"),
        (["--proxy-connect-timeout-s", "-1"], "connect_timeout_s must be > 0, got -1"),
        (["--body-read-timeout-s", "0"], "body_read_timeout_s must be > 0, got 0"),
        (["--circuit-failures", "0"], "circuit failure threshold must be >= 1, got 0"),
        (["--circuit-cooldown-s", "0"], "circuit cooldown must be > 0 s, got 0"),
    ]:
        with pytest.raises(RouterCliError, match=message):
            config(*argv)


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
    flags += "--decode-weight --decision-log --chat-template --max-body-bytes --max-attempts "
    flags += "--proxy-connect-timeout-s --proxy-first-byte-timeout-s --proxy-total-timeout-s "
    flags += "--body-read-timeout-s --circuit-failures --circuit-cooldown-s"
    for flag in flags.split():
        assert flag in out


def test_unreachable_redis_is_a_clear_nonzero_exit(caplog: pytest.LogCaptureFixture) -> None:
    assert main(["--redis", "redis://127.0.0.1:1/0", "--port", "0"]) == 1
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in caplog.text


@pytest.mark.slow
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


def test_keys_come_from_a_flag_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def config(*argv: str) -> RouterConfig:
        return config_from_args(build_parser().parse_args(list(argv)), "redis://x")

    def bearer(key: str) -> str:
        return f"Bearer {key}"

    for name in ("KVROUTE_ADMIN_KEY", "KVROUTE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert (config().admin_key, config().api_key) == (None, None)
    key_file = tmp_path / "admin.key"
    key_file.write_text("from-file\n")
    admin = config("--admin-key-file", str(key_file)).admin_key
    assert admin is not None and admin.accepts(bearer("from-file"))
    api = config("--api-key", "from-flag").api_key
    assert api is not None and api.accepts(bearer("from-flag"))
    file_config = tmp_path / "router.json"
    file_config.write_text(json.dumps({"admin_key_file": str(key_file)}))
    admin = config("--config", str(file_config)).admin_key
    assert admin is not None and admin.accepts(bearer("from-file"))
    monkeypatch.setenv("KVROUTE_ADMIN_KEY", "from-env")
    admin = config().admin_key
    assert admin is not None and admin.accepts(bearer("from-env"))
    admin = config("--admin-key", "flag-wins").admin_key
    assert admin is not None and admin.accepts(bearer("flag-wins"))
    for argv, message in [
        (["--admin-key", "a", "--admin-key-file", str(key_file)], "not both"),
        (["--api-key-file", str(tmp_path / "none")], "cannot read the key file"),
        (["--api-key", "two words"], "characters a bearer token cannot carry"),
    ]:
        with pytest.raises(RouterCliError, match=message):
            config(*argv)


def test_registration_flags_map_onto_the_config(tmp_path: Path) -> None:
    _, secret = write_keypair(tmp_path, "router")
    args = build_parser().parse_args(
        ["--allow-worker-net", "10.0.0.0/8", "--allow-worker-net", "gpu-1", "--require-curve",
         "--client-key", str(secret), "--forward-authorization"]
    )  # fmt: skip
    config = config_from_args(args, "redis://x")
    assert config.allow_worker_nets == ("10.0.0.0/8", "gpu-1")
    assert (config.require_curve, config.proxy.forward_authorization) == (True, True)
    defaults = config_from_args(build_parser().parse_args([]), "redis://x")
    assert defaults.allow_worker_nets == ()
    assert (defaults.require_curve, defaults.proxy.forward_authorization) == (False, False)
    with pytest.raises(RouterCliError, match="--require-curve needs --client-key"):
        config_from_args(build_parser().parse_args(["--require-curve"]), "redis://x")
    with pytest.raises(RouterCliError, match="--allow-worker-net 'x y': expected a CIDR"):
        config_from_args(build_parser().parse_args(["--allow-worker-net", "x y"]), "redis://x")


def test_models_and_tokenizer_flags_map_onto_the_config(tmp_path: Path) -> None:
    spec = "v=http://h:8000,events=tcp://h:5557,kind=vllm,model=llama,model=llama-lora"
    assert parse_worker_flag(spec).models == ("llama", "llama-lora")
    args = build_parser().parse_args(
        ["--tokenizer", "/models/llama", "--tokenizer", "qwen=/models/qwen",
         "--tokenize-via-engine", "mistral", "--tokenize-cache-tokens", "1000",
         "--tokenize-timeout-s", "2.5", "--chat-template", "t.jinja"]
    )  # fmt: skip
    sources = config_from_args(args, "redis://x").tokenizers
    assert (sources.default_path, dict(sources.paths), sources.via_engine) == (
        "/models/llama",
        {"qwen": "/models/qwen"},
        frozenset({"mistral"}),
    )
    settings = (sources.cache_tokens, sources.timeout_s, sources.chat_template)
    assert settings == (1000, 2.5, "t.jinja")
    assert sources.source("qwen") == "/models/qwen"
    assert sources.source("mistral") == "engine"
    assert sources.source("other") == "/models/llama"
    bare = config_from_args(build_parser().parse_args(["--tokenize-via-engine"]), "redis://x")
    assert bare.tokenizers.source("any") == "engine"
    # The config file: a list of specs, a bare "via the engine" as true, model tables.
    toml = tmp_path / "router.toml"
    toml.write_text(
        'tokenizer = ["qwen=/models/qwen"]\ntokenize_via_engine = true\n'
        '[[workers]]\nworker_id = "v"\nurl = "http://h:8000"\nevents = "tcp://h:5557"\n'
        'kind = "vllm"\nmodels = ["qwen"]\n'
    )
    config = config_from_args(build_parser().parse_args(["--config", str(toml)]), "redis://x")
    assert config.tokenizers.source("qwen") == "/models/qwen"
    assert config.tokenizers.source("other") == "engine"
    assert config.workers[0].models == ("qwen",)
    for flags, message in [
        (["--tokenizer", "a", "--tokenizer", "b"], "--tokenizer given twice without a model"),
        (["--tokenizer", "m=a", "--tokenize-via-engine", "m"], "has both --tokenizer and"),
        (["--tokenizer", "=a"], "expected PATH or MODEL=PATH"),
    ]:
        with pytest.raises(RouterCliError, match=message):
            config_from_args(build_parser().parse_args(flags), "redis://x")
