"""Start-up failures of `jaxserve serve` end with one line on stderr naming the cause, a
non-zero exit code and no traceback (unless --log-level debug). Each case runs the real
command as a subprocess, as a user would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from server_harness import cpu_xla_flags, ep_test_threshold, free_port

from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.models.config import SUPPORTED_ARCHITECTURES

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
MOCK = ("--engine-class", "mock_engine:MockEngineCore")
# A start's INFO lines are held back for this long (jaxserve.logs.START_LOG_HOLD_ENV):
# however slow this machine, a failing start fails before they would be let go.
HOLD_ENV = {"JAXSERVE_START_LOG_HOLD_S": "600"}


def serve(*argv: str, timeout: float = 60, env: dict | None = None):
    """`jaxserve serve ARGV` to its end: (exit code, stderr lines)."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", *argv],
        capture_output=True, text=True, timeout=timeout, cwd=REPO_DIR,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIR), **(env or {})},
    )  # fmt: skip
    return out.returncode, out.stderr.splitlines()


def one_error_line(lines: list[str]) -> str:
    assert len(lines) == 1, "\n".join(lines)
    assert lines[0].startswith("jaxserve serve: error: "), lines[0]
    return lines[0]


def test_missing_model_folder(tmp_path):
    code, lines = serve(str(tmp_path / "absent" / "dir"))
    assert code == 2
    assert "model: " in one_error_line(lines) and "absent" in lines[0]


def test_folder_without_config_json(tmp_path):
    code, lines = serve(str(tmp_path))
    assert code == 2 and f"model: {tmp_path} has no config.json" in one_error_line(lines)


def test_broken_config_json_names_file_and_position(model_copy):
    (model_copy / "config.json").write_text('{\n  "architectures": ["Qwen3MoeForCausalLM"],,\n}')
    code, lines = serve(str(model_copy))
    assert code == 2
    line = one_error_line(lines)
    assert f"{model_copy / 'config.json'}: not valid JSON" in line and "line 2 column" in line


def test_config_missing_a_field_names_it(model_copy):
    hf = json.loads((model_copy / "config.json").read_text())
    del hf["num_attention_heads"]
    (model_copy / "config.json").write_text(json.dumps(hf))
    code, lines = serve(str(model_copy))
    assert code == 2 and "missing required field 'num_attention_heads'" in one_error_line(lines)


def test_unsupported_architecture_lists_the_supported(model_copy):
    (model_copy / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    code, lines = serve(str(model_copy))
    line = one_error_line(lines)
    assert code == 2 and "'GPT2LMHeadModel' is not supported" in line
    assert all(name in line for name in SUPPORTED_ARCHITECTURES)


def test_a_failed_start_with_http_port_ends_with_its_cause_alone(model_copy):
    """The demo model has no chat template: with --http-port the frontend warns so, and
    that warning came before the engine's cause, reading as the reason it failed."""
    hf = json.loads((model_copy / "config.json").read_text())
    hf["num_experts_per_tok"] = 9  # of 8 experts: the engine refuses it
    (model_copy / "config.json").write_text(json.dumps(hf))
    code, lines = serve(str(model_copy), "--http-port", "0", "--metrics-port", "0")
    assert code == 2 and "num_experts_per_tok=9" in one_error_line(lines)


def test_folder_without_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    code, lines = serve(str(model_copy))
    assert code == 2 and "no *.safetensors weights" in one_error_line(lines)


def test_unknown_log_level():
    code, lines = serve("--log-level", "loud")
    assert code == 2 and "unknown log level 'loud'" in one_error_line(lines)


def test_chat_template_without_http_port(model_copy):
    code, lines = serve(str(model_copy), "--chat-template", "t.jinja", *MOCK)
    assert code == 2 and "chat-template: " in one_error_line(lines) and "--http-port" in lines[0]


@pytest.mark.parametrize(
    "text, cause", [(None, "cannot read"), ("{% for m in messages %}{{ m }", "not a valid Jinja")]
)
def test_bad_chat_template_is_a_bad_setting(model_copy, tmp_path, text, cause):
    template = tmp_path / "t.jinja"
    if text is not None:
        template.write_text(text)
    code, lines = serve(
        str(model_copy), "--chat-template", str(template), "--http-port", "0", *MOCK
    )
    assert code == 2 and f"chat-template: {cause}" in one_error_line(lines)


def test_max_model_len_above_the_models_limit_fails_before_any_process_starts():
    # The real engine (no mock) would say so only after starting and loading the model.
    code, lines = serve(str(DEMO_MODEL_DIR), "--max-model-len", str(10**9), timeout=30)
    limit = json.loads((DEMO_MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    assert code == 2
    line = one_error_line(lines)
    assert line.startswith(f"jaxserve serve: error: --max-model-len: {10**9} tokens"), line
    assert f"limit of {limit}" in line and f"--max-model-len {limit} or less" in line


def test_busy_port(model_copy):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, lines = serve(str(model_copy), "--port", str(port), *MOCK)
    assert code == 1
    assert f"port: cannot bind 127.0.0.1:{port} ([Errno" in one_error_line(lines)


def test_busy_http_port_fails_before_any_process_starts(model_copy):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The real engine (no mock): it would take many seconds to compile; preflight
        # ends it well before.
        code, lines = serve(str(model_copy), "--http-port", str(port), timeout=30)
    assert code == 1
    line = one_error_line(lines)
    assert f"http-port: cannot bind 127.0.0.1:{port} ([Errno" in line
    assert "choose another --http-port" in line


def test_one_port_for_two_services_is_one_line(model_copy):
    code, lines = serve(str(model_copy), "--port", "50999", "--metrics-port", "50999", *MOCK)
    assert code == 2  # a bad setting (README), not a port the system refused
    assert "metrics-port: 50999 is also --port" in one_error_line(lines)
    code, lines = serve(str(model_copy), "--port", "50999", "--http-port", "50999", *MOCK)
    assert code == 2 and "http-port: 50999 is also --port" in one_error_line(lines)


def test_ready_line_names_the_http_address(tmp_path):
    import urllib.request

    from mock_engine import write_mock_model_dir

    model = write_mock_model_dir(tmp_path / "mock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", str(model), "--port", "0",
         "--http-port", "0", *MOCK],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO_DIR,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIR)},
    )  # fmt: skip
    try:
        before = []
        for line in proc.stderr:
            if "jaxserve ready" in line:
                break
            before.append(line)
        ready = line
        assert "(gRPC), OpenAI HTTP API on http://127.0.0.1:" in ready, ready
        # The start's INFO lines, held back while it might fail, are printed before ready.
        for said in ("admission limits: ", "HTTP (OpenAI API) listening on", "gRPC listening"):
            assert any(said in x for x in before), (said, before)
        url = ready.split("OpenAI HTTP API on ")[1].split()[0]
        with urllib.request.urlopen(f"{url}/models", timeout=10) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid", "notahost"])
def test_bad_host(model_copy, host):
    code, lines = serve(str(model_copy), "--host", host, *MOCK)
    # A bad setting (exit 2, as README says), not the system refusing: it used to be 1.
    assert code == 2 and "host: cannot " in one_error_line(lines) and host in lines[0]


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_ipv6_host_serves(mock_model_dir):
    from jaxserve.frontend.client import JaxserveClient

    model = mock_model_dir
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", str(model), "--host", "::1",
         "--port", "0", *MOCK],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO_DIR,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIR)},
    )  # fmt: skip
    try:
        port, lines = None, []
        for line in proc.stderr:
            lines.append(line)
            if "gRPC listening on [::1]:" in line:
                port = int(line.split("[::1]:")[1].split(";")[0])
            if "jaxserve ready" in line:
                break
        assert port, "no listening line"
        # Every line that prints the address brackets it, as the config block does (the
        # listening and ready lines printed "::1:PORT").
        assert f" on [::1]:{port} (gRPC)" in lines[-1], lines[-1]
        assert not [x for x in lines if "::1:" in x and "[::1]:" not in x], lines
        with JaxserveClient(f"[::1]:{port}") as client:
            assert client.complete([5, 6], max_tokens=2)[0].completion_tokens == 2
    finally:
        proc.terminate()
        proc.wait(30)


# ----- failures only the engine can see (it has the devices) ------------------------------

MESH_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(4)}


def test_mesh_that_cannot_hold_the_model_is_one_line():
    # The demo model has 8 experts: not divisible by 3 devices. A bad setting: exit 2.
    code, lines = serve("--mesh", "dp=1,tp=3", "--log-level", "warning", env=MESH_ENV, timeout=120)
    assert code == 2
    line = one_error_line(lines)
    assert "engine failed to start: mesh dp=1,tp=3 cannot hold" in line
    assert "num_experts=8 is not divisible" in line


def test_engine_error_at_info_is_one_line_and_debug_shows_the_traceback():
    """At the default --log-level (INFO) an engine that fails to start prints one line:
    the INFO lines of the start (the frontend's admission limits and listening address,
    the engine's loading progress) used to come first, 3-4 lines in all."""
    code, lines = serve("--mesh", "dp=1,tp=3", env={**MESH_ENV, **HOLD_ENV}, timeout=120)
    assert code == 2
    line = one_error_line(lines)
    assert line.startswith("jaxserve serve: error: engine failed to start: mesh dp=1,tp=3")
    code, lines = serve("--mesh", "dp=1,tp=3", "--log-level", "debug", env=MESH_ENV, timeout=120)
    assert code == 2 and any("Traceback" in line for line in lines)
    assert lines[-1].startswith("jaxserve serve: error: engine failed to start: mesh dp=1,tp=3")


def test_num_blocks_past_the_hosts_memory_names_the_flag():
    """--num-blocks whose KV cache cannot fit in the host's memory at all: it ended in
    "engine failed to start: MemoryError" (exit 1) when the block manager was built."""
    from jaxserve.engine.kv_sizing import kv_block_bytes
    from jaxserve.models.config import ModelConfig

    config = ModelConfig.from_hf(json.loads((Path(DEMO_MODEL_DIR) / "config.json").read_text()))
    per_block = kv_block_bytes(config, 16, np.float32)
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    blocks = host // per_block + 1  # one block more than the host holds in all
    code, lines = serve("--num-blocks", str(blocks), "--log-level", "warning", timeout=120)
    line = one_error_line(lines)
    assert code == 2, line
    assert line.startswith(
        f"jaxserve serve: error: engine failed to start: --num-blocks: {blocks} blocks of 16 "
        "tokens need "
    ), line
    assert "this host has in all" in line


def test_more_devices_than_visible_is_a_bad_setting():
    """--mesh dp=3 on one device: the engine finds it; `serve` exits 2, as for the other
    bad settings (it used to exit 1, the code for the system refusing)."""
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    code, lines = serve("--mesh", "dp=3,tp=1", "--log-level", "warning", env=env, timeout=120)
    line = one_error_line(lines)
    assert code == 2, line
    assert "engine failed to start: mesh dp=3,tp=1 needs 3 devices, but only 1" in line


def test_truncated_weights_file_is_a_bad_setting(model_copy):
    """A truncated *.safetensors is a broken model folder, like a broken config.json: exit
    2 with one line naming the file (README: 2 for a bad setting, 1 when the system
    refused; nothing refused here). At the default --log-level: the engine's "loading
    weights: 0/51" line, logged before the fault, is held back with the others."""
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    weights.write_bytes(data[: len(data) // 2])
    code, lines = serve(str(model_copy), env={"JAX_PLATFORMS": "cpu", **HOLD_ENV})
    line = one_error_line(lines)
    assert code == 2, line
    assert f"{weights}: not a readable safetensors file" in line


# ----- several processes ------------------------------------------------------------------


def test_follower_ends_within_seconds_when_the_leader_fails_to_start(model_copy):
    """Process 0 fails at start (its gRPC port is busy: a failure only it sees); process
    1, already waiting in jax.distributed.initialize (300 s timeout), ends within
    seconds with one line naming the leader's cause."""
    import time

    coordinator = f"127.0.0.1:{free_port()}"
    run = ("--num-processes", "2", "--coordinator-address", coordinator, "--log-level", "warning")
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", str(model_copy), *run]
    follower = subprocess.Popen(
        [*cmd, "--process-id", "1"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
        text=True, cwd=REPO_DIR, env=env,
    )  # fmt: skip
    try:
        time.sleep(3)  # the follower is waiting for the coordinator
        assert follower.poll() is None
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            start = time.monotonic()
            leader = subprocess.run(
                [*cmd, "--process-id", "0", "--port", str(port)],
                capture_output=True, text=True, timeout=60, cwd=REPO_DIR, env=env,
            )  # fmt: skip
        assert leader.returncode == 1
        assert "port: cannot bind" in one_error_line(leader.stderr.splitlines())
        _, stderr = follower.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        follower.kill()
    assert follower.returncode == 2 and took < 15, (took, stderr)
    line = one_error_line(stderr.splitlines())
    assert "process 0 (the leader) failed to start: --port: cannot bind" in line


@pytest.mark.parametrize(
    "process_id, expected",
    [
        # A follower with no process 0: it waited in jax.distributed.initialize for 300 s,
        # then aborted with a C++ stack trace; now it waits for the coordinator's port.
        ("1", ["nothing accepted a connection (Connection refused) within 2 s",
               "--coordinator-address"]),
        # A leader whose follower never joins: its coordinator answers, nobody joins, and
        # JAX aborted it at its join timeout; now jaxserve's watchdog ends it.
        ("0", ["the run's 2 processes did not all join within 2 s", "--num-processes 2"]),
    ],
    ids=["follower_without_a_leader", "leader_whose_followers_never_join"],
)  # fmt: skip
def test_a_process_whose_run_never_forms_ends_in_one_line(process_id, expected):
    """One process of a 2-process run whose other process never comes ends at
    JAXSERVE_INIT_TIMEOUT_S (2 s here) with one line naming the wait and the flag to
    check, exit code 2 (the wait named is the one set, not what was left of it)."""
    run = ("--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2")
    env = {"JAX_PLATFORMS": "cpu", "JAXSERVE_INIT_TIMEOUT_S": "2", **HOLD_ENV}
    code, lines = serve(*run, "--process-id", process_id, env=env)
    assert code == 2
    line = one_error_line(lines)
    for fragment in expected:
        assert fragment in line, line


def test_follower_ends_when_the_leaders_engine_fails_after_joining(model_copy):
    """Process 0's engine fails after jax.distributed.initialize (its checkpoint lacks a
    tensor; the follower's is whole): the follower, already in the run's start-up, ends
    within seconds naming the leader's cause, not by JAX's heartbeat with a C++ trace."""
    import time

    from safetensors.numpy import load_file, save_file

    weights = model_copy / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.norm.weight"]
    weights.unlink()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    coordinator = f"127.0.0.1:{free_port()}"
    flags = ["--mesh", "dp=2,tp=2", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
             "--max-model-len", "32", "--num-blocks", "8", "--log-level", "warning",
             "--ep-replicated-max-tokens", str(ep_test_threshold(2, 16))]  # fmt: skip
    env = {
        **os.environ, "PYTHONPATH": str(TESTS_DIR), "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": cpu_xla_flags(2),
        "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": "2",
    }  # fmt: skip
    serve_cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0"]
    follower = subprocess.Popen(
        [*serve_cmd, str(DEMO_MODEL_DIR), *flags], stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL, text=True, cwd=REPO_DIR, env={**env, "JAX_PROCESS_ID": "1"},
    )  # fmt: skip
    try:
        leader = subprocess.run(
            [*serve_cmd, str(model_copy), *flags], capture_output=True, text=True, timeout=300,
            cwd=REPO_DIR, env={**env, "JAX_PROCESS_ID": "0"},
        )  # fmt: skip
        left = time.monotonic()
        assert leader.returncode == 2, leader.stderr  # a broken checkpoint: a bad setting
        assert "missing tensor 'model.norm.weight'" in leader.stderr.splitlines()[-1]
        _, stderr = follower.communicate(timeout=60)
        took = time.monotonic() - left
    finally:
        follower.kill()
    assert follower.returncode == 2 and took < 15, (took, stderr)
    last = stderr.splitlines()[-1]
    assert "process 0 (the leader) failed to start" in last and "model.norm.weight" in last
