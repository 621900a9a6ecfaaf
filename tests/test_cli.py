"""`jaxserve serve` flags as a vLLM user types them: the positional model, vLLM's names as
aliases of ours, --version, help text with defaults, and Hugging Face model ids resolved
through a Hub cache the test writes (offline)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from jaxserve.cli import _engine_config, build_parser
from jaxserve.config import DEMO_MODEL_DIR, CacheConfig, EngineConfig, MeshConfig
from jaxserve.hub import looks_like_repo_id, resolve_model


def _config(*argv: str) -> EngineConfig:
    return _engine_config(build_parser().parse_args(["serve", *argv]))


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_positional_model_is_the_same_as_the_flag(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert _config(str(tmp_path)).model == _config("--model", str(tmp_path)).model == str(tmp_path)
    assert _config().model == str(DEMO_MODEL_DIR)
    with pytest.raises(ValueError, match="model: given twice"):
        _config(str(tmp_path), "--model", str(DEMO_MODEL_DIR))


def test_vllm_parallel_sizes_are_the_mesh():
    assert _config("--tensor-parallel-size", "4", "--data-parallel-size", "2").mesh == MeshConfig(
        2, 4
    )
    assert _config("-tp", "2").mesh == MeshConfig(1, 2)
    assert _config("--mesh", "dp=2,tp=2", "-tp", "2").mesh == MeshConfig(2, 2)
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 contradicts --mesh"):
        _config("--mesh", "dp=2,tp=2", "-tp", "4")
    # Accepted and the default here: experts are always spread over dp*tp devices.
    assert _config("--enable-expert-parallel", "-tp", "2").mesh == MeshConfig(1, 2)


def test_vllm_cache_and_scheduler_names():
    config = _config(
        "--max-model-len", "100", "--max-num-seqs", "3", "--max-num-batched-tokens", "40",
        "--block-size", "8", "--gpu-memory-utilization", "0.5", "--seed", "7",
    )  # fmt: skip
    assert (config.scheduler.max_model_len, config.scheduler.max_num_seqs) == (100, 3)
    assert config.scheduler.max_num_batched_tokens == 40
    assert (config.cache.block_size, config.cache.memory_fraction, config.seed) == (8, 0.5, 7)
    assert _config("--kv-memory-fraction", "0.3").cache.memory_fraction == 0.3
    assert _config().cache.memory_fraction == CacheConfig().memory_fraction


@pytest.mark.parametrize(
    "flags, enabled",
    [
        ((), True),
        (("--enable-prefix-caching",), True),
        (("--no-enable-prefix-caching",), False),
        (("--no-prefix-caching",), False),
    ],
)
def test_prefix_caching_flags(flags, enabled):
    assert _config(*flags).cache.enable_prefix_caching is enabled


@pytest.mark.parametrize(
    "flags, configured, on_cpu, on_gpu",
    [
        ((), None, False, True),
        (("--async-scheduling",), True, True, True),
        (("--no-async-scheduling",), False, False, False),
    ],
)
def test_async_scheduling_flag_and_the_backend_default(flags, configured, on_cpu, on_gpu):
    """Unset, async scheduling follows the backend (off for the CPU, on for an
    accelerator); the flag overrides it either way."""
    from jaxserve.config import resolve_async_scheduling

    value = _config(*flags).scheduler.async_scheduling
    assert value is configured
    assert resolve_async_scheduling(value, "cpu") is on_cpu
    assert resolve_async_scheduling(value, "gpu") is on_gpu
    assert resolve_async_scheduling(value, "tpu") is on_gpu


@pytest.mark.parametrize(
    "flag, field, high",
    [
        ("--num-decode-steps", "num_decode_steps", 64),
        ("--stream-interval", "stream_interval", 1024),
    ],
)
def test_scheduler_int_flags(capsys, flag, field, high):
    """--num-decode-steps (multi-step decode's steps per call) and --stream-interval
    (tokens per stream message) set their SchedulerConfig field (unset: the config's
    default); 0 and one past the top are refused at parsing, naming the flag, exit 2."""
    from jaxserve.config import SchedulerConfig

    assert getattr(_config().scheduler, field) == getattr(SchedulerConfig(), field)
    for value in (1, 8, high):
        assert getattr(_config(flag, str(value)).scheduler, field) == value
    for bad in (0, high + 1):
        with pytest.raises(SystemExit) as e:
            _config(flag, str(bad))
        assert e.value.code == 2
        assert flag in capsys.readouterr().err


def test_dtype_auto_reads_the_checkpoint(tmp_path):
    for written, want in [("bfloat16", "bfloat16"), ("float16", "float16"), ("int8", "float32")]:
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": written}))
        assert _config(str(tmp_path)).dtype == want
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))  # transformers 5
    assert _config(str(tmp_path)).dtype == "bfloat16"
    assert _config(str(tmp_path), "--dtype", "float32").dtype == "float32"
    assert _config("--dtype", "float16").dtype == "float16"


def test_served_model_name(tmp_path):
    assert _config(str(tmp_path)).served_model_name == tmp_path.name
    assert _config("--served-model-name", "mine").served_model_name == "mine"


def test_version_is_printed(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"jaxserve {version('jaxserve')}"


def test_every_serve_flag_says_its_default():
    missing = [
        "/".join(a.option_strings) or a.dest
        for a in _serve_parser()._actions
        if a.help != argparse.SUPPRESS
        and not isinstance(a, argparse._HelpAction)
        and a.dest != "enable_prefix_caching"  # --no-prefix-caching: "the same as" the other
        and "default" not in (a.help or "")
    ]
    assert not missing


def test_serve_help_writes_defaults_one_way_and_in_user_words():
    """Every default reads "(default: X)" (the admission and EPLB groups wrote
    "(default X)"), no help names an internal constant (--num-decode-steps named
    step_shapes.SMALL_BATCH_DECODE_STEPS), the counts of steps and tokens show as N,
    and --tls-cert says that the HTTP API is served over TLS too."""
    actions = {a.dest: a for a in _serve_parser()._actions}
    helps = {dest: a.help or "" for dest, a in actions.items()}
    assert [d for d, h in helps.items() if re.search(r"\(default [^:]", h)] == []
    assert [d for d, h in helps.items() if re.search(r"\b[a-z_]+\.[A-Z_]{4,}\b", h)] == []
    assert actions["num_decode_steps"].metavar == actions["stream_interval"].metavar == "N"
    assert "HTTP API" in helps["tls_cert"]


def test_usage_error_is_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--max-num-seqs", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "--max-num-seqs: must be >= 1, got 0" in out.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["serve"],
        ["generate", "hi"],
        ["bench"],
        ["diagnose", "--from", "b.json"],
        ["profile", "--server", "h:1", "--out", "d"],
    ],
)
def test_an_unknown_flag_is_named_by_its_subcommand(argv, capsys):
    """`jaxserve serve --bogus-flag` is `jaxserve serve: error: ...`, pointing at that
    subcommand's --help (argparse hands a subcommand's unknown arguments back to the top
    parser, whose error said only `jaxserve: error:`)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--bogus-flag"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"jaxserve {argv[0]}: error: unrecognized arguments: --bogus-flag "
        f"(see jaxserve {argv[0]} --help)"
    ]


def test_an_unknown_flag_before_the_subcommand_is_the_top_commands(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--bogus-flag", "generate", "hi"])
    assert capsys.readouterr().err.startswith("jaxserve: error: unrecognized arguments")


# ----- Hugging Face model ids -------------------------------------------------------------


def _write_hub_cache(home, repo_id: str, files: dict[str, str], revision: str = "0" * 40):
    """A Hub cache as huggingface_hub lays it out: refs/main names a snapshot folder."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_repo_id_shapes():
    assert looks_like_repo_id("Qwen/Qwen3-30B-A3B") and looks_like_repo_id("gpt2")
    assert looks_like_repo_id("org/name@main")
    assert not looks_like_repo_id("./models/x") and not looks_like_repo_id("/abs/x")
    assert not looks_like_repo_id("a/b/c")


def test_model_id_resolves_from_the_hf_cache_offline(offline_hub):
    snapshot = _write_hub_cache(offline_hub, "org/tiny", {"config.json": "{}"})
    assert resolve_model("org/tiny") == str(snapshot)
    config = _engine_config(build_parser().parse_args(["serve", "org/tiny"]), model=str(snapshot))
    assert config.model == str(snapshot) and config.served_model_name == "org/tiny"


def test_hf_hub_cache_variable_wins(offline_hub, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    snapshot = _write_hub_cache(other, "org/tiny", {"config.json": "{}"})
    monkeypatch.setenv("HF_HUB_CACHE", str(other / "hub"))
    assert resolve_model("org/tiny") == str(snapshot)


def test_model_id_missing_offline_names_the_cause(offline_hub):
    absent = "model: 'org/absent' is not a local folder.*HF_HUB_OFFLINE"
    with pytest.raises(ValueError, match=absent):
        resolve_model("org/absent")
    with pytest.raises(ValueError, match="neither a folder nor a Hugging Face model id"):
        resolve_model("no/such/folder")


def test_serve_a_model_id_from_the_cache(offline_hub):
    """`jaxserve serve org/name` end to end (mock engine): the frontend, the engine and the
    detokenizer all load the cached snapshot."""
    from mock_engine import write_mock_model_dir
    from server_harness import ServerProcess

    snapshot = _write_hub_cache(offline_hub, "org/mock", {})
    write_mock_model_dir(snapshot)
    srv = ServerProcess(
        "org/mock",  # type: ignore[arg-type]
        extra_args=("--engine-class", "mock_engine:MockEngineCore"),
    ).wait_ready()
    try:
        from jaxserve.frontend.client import JaxserveClient

        with JaxserveClient(srv.target) as client:
            assert client.server_info().max_model_len > 0
            assert client.complete([5, 6], max_tokens=3)[0].completion_tokens == 3
    finally:
        srv.terminate(15)


def test_kv_memory_fraction_sizes_the_cache_on_the_cpu(monkeypatch):
    """--gpu-memory-utilization works on the CPU too: that fraction of the host's available
    memory, in whole blocks; without it the CPU default (requests x length) stays."""
    import os

    import jax.numpy as jnp

    from jaxserve.engine import kv_sizing
    from jaxserve.models.config import ModelConfig

    hf = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    config = ModelConfig.from_hf(hf)
    pages, page = 1_000_000, 4096
    real_sysconf = os.sysconf
    fake = {"SC_AVPHYS_PAGES": pages, "SC_PAGE_SIZE": page}
    monkeypatch.setattr(os, "sysconf", lambda name: fake.get(name) or real_sysconf(name))
    block_bytes = 2 * hf["num_hidden_layers"] * 16 * hf["num_key_value_heads"] * hf["head_dim"] * 4
    got = kv_sizing.num_kv_blocks(config, 16, jnp.float32, 0.25, 4, 64)
    assert got == int(pages * page * 0.25) // block_bytes
    assert kv_sizing.num_kv_blocks(config, 16, jnp.float32, None, 4, 64) == 4 * 4 + 1


def test_every_generate_flag_says_its_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        "/".join(a.option_strings)
        for a in sub.choices["generate"]._actions
        if a.option_strings
        and not isinstance(a, argparse._HelpAction)
        and "default" not in (a.help or "")
    ]
    assert not missing


def test_serve_compiles_in_the_background_unless_told_otherwise():
    from jaxserve.config import EngineConfig

    assert EngineConfig().background_compile is False  # the offline LLM and tests
    assert _config().background_compile is True
    assert _config("--compile-all-at-start").background_compile is False


@pytest.mark.parametrize(
    ("argv", "cause"),
    [
        (["--block-size", "7"], "--block-size: must be a power of two from 1 to 256"),
        (["--block-size", "24"], "--block-size: must be a power of two from 1 to 256"),
        (["--block-size", "512"], "--block-size: must be a power of two from 1 to 256"),
        (["--served-model-name", ""], "--served-model-name: must not be empty"),
        (["--served-model-name", " "], "--served-model-name: must not be empty"),
    ],
)
def test_a_setting_the_engine_cannot_take_is_one_usage_line(argv, cause, capsys):
    """--block-size 7 (the GPU kernels read blocks in 8-row tiles and 64-key stages; vLLM
    offers powers of two) and an empty --served-model-name (clients send the name as
    `model`) are usage errors naming the flag, exit code 2; they used to be accepted."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", *argv])
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxserve serve: error: argument "), lines
    assert cause in lines[0]


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_every_power_of_two_block_size_is_taken(size):
    config = _config("--block-size", str(size))
    assert config.cache.block_size == size
    config.cache.validate()
    with pytest.raises(ValueError, match=r"^block_size \(--block-size\): must be a power of two"):
        CacheConfig(block_size=size + 3 if size > 1 else 3).validate()


def test_python_dash_m_jaxserve_is_the_command():
    """`python -m jaxserve` (a venv whose bin/ is not on PATH) runs the CLI; it used to
    say "No module named jaxserve.__main__"."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve", "--version"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.startswith("jaxserve "), out.stderr


def test_fewer_batched_tokens_than_sequences_is_refused_before_any_process():
    """The scheduler's rule (max_num_batched_tokens >= max_num_seqs), named by its flag
    when the flags are read; the engine used to find it after loading the weights."""
    with pytest.raises(ValueError, match=r"^max-num-batched-tokens: must be >= --max-num-seqs"):
        _config("--max-num-seqs", "4", "--max-num-batched-tokens", "2")
    with pytest.raises(ValueError, match=r"must be >= --max-num-seqs \(1024\), got 512"):
        _config("--max-num-seqs", "1024")
    config = _config("--max-num-seqs", "4", "--max-num-batched-tokens", "4")
    assert config.scheduler.max_num_batched_tokens == 4


@pytest.mark.parametrize("where", ["/proc/nope", "a file"])
@pytest.mark.parametrize(
    "command",
    # `jaxserve engine` (a replica joining a remote frontend) used to start its engine
    # process and fail there; nothing listens at its --frontend, so only the check answers.
    [["serve"], ["engine", "--frontend", "127.0.0.1:9", "--handshake-timeout-s", "1"]],
)
def test_a_compilation_cache_dir_that_cannot_be_one_is_refused_at_start(command, where, tmp_path):
    """It used to fail in the engine as "engine failed to start: [Errno 2] ...", exit 1:
    a bad setting, one line naming the flag, exit 2, before any process starts."""
    if where == "a file":
        where = tmp_path / "file"
        where.write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve", *command, "--compilation-cache-dir", str(where)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = out.stderr.splitlines()
    assert out.returncode == 2, out.stderr
    prefix = f"jaxserve {command[0]}: error: compilation-cache-dir: "
    assert len(lines) == 1 and lines[0].startswith(prefix), out.stderr
    assert "--compilation-cache-dir" in lines[0] and str(where) in lines[0]


_GENERATE = ["generate", "hi"]
_PROFILE = ["profile", "--server", "h:1", "--out", "d"]


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [(_GENERATE, "--timeout", "-1"), (_GENERATE, "--timeout", "0"),
     (_GENERATE, "--timeout", "nan"), (_GENERATE, "--timeout", "inf"),
     (_PROFILE, "--seconds", "-5"), (_PROFILE, "--seconds", "nan")],
)  # fmt: skip
def test_a_client_time_that_is_not_positive_is_a_usage_error(command, flag, value, capsys):
    """`generate --timeout -1` used to be sent as a deadline already past (exit 1 with
    DEADLINE_EXCEEDED): a bad setting, refused while parsing, naming the flag."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, flag, value])
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"error: argument {flag}: must be a finite number > 0" in lines[0]
    assert getattr(build_parser().parse_args([*command, flag, "1.5"]), flag[2:]) == 1.5


@pytest.mark.parametrize(
    ("flag", "value", "bounds"),
    [("--seed", "99999999999999999999999", "[-9223372036854775808, 9223372036854775807]"),
     ("--seed", "-9223372036854775809", "[-9223372036854775808, 9223372036854775807]"),
     ("--max-tokens", "2147483648", "[-2147483648, 2147483647]"),
     ("--top-k", "-2147483649", "[-2147483648, 2147483647]"),
     ("-n", "99999999999", "[-2147483648, 2147483647]")],
)  # fmt: skip
def test_a_generate_int_the_request_cannot_hold_names_the_flag_and_range(
    flag, value, bounds, capsys
):
    """`generate --seed 99999999999999999999999` used to say protobuf's "Value out of
    range: ..." without the flag: a usage error naming the flag and the field's range."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*_GENERATE, flag, value])
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert f"argument {flag}" in lines[0] and f"must be within {bounds}, got {value}" in lines[0]
    assert build_parser().parse_args([*_GENERATE, "--seed", "-5"]).seed == -5
    with pytest.raises(SystemExit):
        build_parser().parse_args([*_GENERATE, "--seed", "x"])
    assert "invalid int value: 'x'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "cause"),
    [(["--temperature", "nan"], "--temperature: must be >= 0, got nan"),
     (["--warmup-timeout", "nan"], "--warmup-timeout: must be >= 0, got nan")],
)  # fmt: skip
def test_bench_refuses_nan_where_it_refuses_negatives(argv, cause):
    from jaxserve.benchmark.cli import _check_flags

    with pytest.raises(ValueError, match=f"^{cause}$"):
        _check_flags(build_parser().parse_args(["bench", *argv]))


_SERVER_COMMANDS = [["generate", "hi"], ["bench"], ["diagnose"], ["profile", "--out", "d"]]


@pytest.mark.parametrize("command", _SERVER_COMMANDS)
@pytest.mark.parametrize(
    ("server", "port"),
    [("127.0.0.1:99999", 99999), ("127.0.0.1:0", 0), ("[::1]:65536", 65536),
     ("http://h:70000/v1", 70000)],
)  # fmt: skip
def test_a_server_port_out_of_range_is_a_usage_error(command, server, port, capsys):
    """`generate --server 127.0.0.1:99999` used to reach gRPC, which takes the port modulo
    65536 (a server on 34463 would answer): refused while parsing, in every client tool."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, "--server", server])
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert f"error: argument --server: port must be in [1, 65535], got {port}" in lines[0]


@pytest.mark.parametrize("command", _SERVER_COMMANDS)
@pytest.mark.parametrize(
    "server", ["127.0.0.1:65535", "[::1]:1", "h:50051", "http://h/v1", "unix:/tmp/s"]
)
def test_a_server_address_in_range_or_without_a_port_is_taken(command, server):
    if command[0] in ("generate", "profile") and server.startswith("http://"):
        return  # a URL is no gRPC target: the next test
    assert build_parser().parse_args([*command, "--server", server]).server == server


@pytest.mark.parametrize("command", [["generate", "hi"], ["profile", "--out", "d"]])
@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "https://h:50051"])
def test_a_grpc_client_given_an_http_url_says_to_give_host_port(command, url, capsys):
    # gRPC said only "Misformatted domain name" (and wait_until_serving timed out).
    from jaxserve.frontend.client import JaxserveClient

    words = f"{url} is an HTTP URL; the gRPC API takes HOST:PORT with serve's --port"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, "--server", url])
    assert e.value.code == 2
    assert f"error: argument --server: {words}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"^target: {re.escape(words)}"):
        JaxserveClient(url)


def test_the_client_refuses_a_target_port_out_of_range():
    from jaxserve.frontend.client import JaxserveClient

    with pytest.raises(ValueError, match=r"^target: port must be in \[1, 65535\], got 99999$"):
        JaxserveClient("127.0.0.1:99999")
    JaxserveClient("127.0.0.1:65535").close()
