"""`jaxserve serve` flags as a vLLM user types them, read into the `EngineConfig`: the
positional model, vLLM's names as aliases of ours, the defaults that follow the model or
the backend, and the settings the engine cannot take, refused while the flags are read.
The command's help and usage errors are test_cli_usage's; Hugging Face model ids
test_cli_hub's; the client tools' flags test_cli_client_flags'."""

from __future__ import annotations

import json

import pytest

from jaxserve.cli import _engine_config, build_parser
from jaxserve.config import DEMO_MODEL_DIR, CacheConfig, EngineConfig, MeshConfig


def _config(*argv: str) -> EngineConfig:
    return _engine_config(build_parser().parse_args(["serve", *argv]))


def test_positional_model_is_the_same_as_the_flag(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert _config(str(tmp_path)).model == _config("--model", str(tmp_path)).model == str(tmp_path)
    assert _config().model == str(DEMO_MODEL_DIR)
    with pytest.raises(ValueError, match="model: given twice"):
        _config(str(tmp_path), "--model", str(DEMO_MODEL_DIR))


@pytest.mark.parametrize("argv", [[""], ["  "], ["--model", ""]])
def test_an_empty_model_is_refused_not_the_demo(argv):
    """`serve ""` served the demo model, as if no model were named."""
    with pytest.raises(ValueError, match=r"^model: empty, got '\s*' \(leave it out"):
        _config(*argv)


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
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "torch.float16"}))
    assert _config(str(tmp_path)).dtype == "float16"


def test_dtype_auto_refuses_a_config_dtype_that_is_no_dtype(tmp_path, caplog):
    """A typo in config.json's dtype is one error naming the key, not float32 in silence;
    a real torch dtype the engine does not run is float32 with a WARNING naming it; an
    explicit --dtype needs no config dtype at all."""
    from jaxserve.config import resolve_dtype

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat61"}))
    with pytest.raises(ValueError, match=r"config.json: dtype 'bfloat61' is not a dtype"):
        resolve_dtype("auto", tmp_path)
    assert resolve_dtype("bfloat16", tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float8_e4m3fn"}))
    with caplog.at_level("WARNING", logger="jaxserve.config"):
        assert resolve_dtype("auto", tmp_path) == "float32"
    assert "torch_dtype float8_e4m3fn is not served; serving float32" in caplog.text
    assert _config(str(tmp_path), "--dtype", "float32").dtype == "float32"
    assert _config("--dtype", "float16").dtype == "float16"


def test_served_model_name(tmp_path):
    assert _config(str(tmp_path)).served_model_name == tmp_path.name
    assert _config("--served-model-name", "mine").served_model_name == "mine"


def test_serve_compiles_in_the_background_unless_told_otherwise():
    from jaxserve.config import EngineConfig

    assert EngineConfig().background_compile is False  # the offline LLM and tests
    assert _config().background_compile is True
    assert _config("--compile-all-at-start").background_compile is False


def _demo_kv_on_a_host(monkeypatch, pages: dict, page: int):
    """The demo model's config and its KV bytes per block of 16 float32 tokens (K and V
    of every layer and KV head), on a host whose os.sysconf says `pages` of `page` bytes."""
    import os

    from jaxserve.models.config import ModelConfig

    hf = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    real_sysconf = os.sysconf
    fake = {**pages, "SC_PAGE_SIZE": page}
    monkeypatch.setattr(os, "sysconf", lambda name: fake.get(name) or real_sysconf(name))
    block_bytes = 2 * hf["num_hidden_layers"] * 16 * hf["num_key_value_heads"] * hf["head_dim"] * 4
    return ModelConfig.from_hf(hf), block_bytes


def test_kv_memory_fraction_sizes_the_cache_on_the_cpu(monkeypatch):
    """--gpu-memory-utilization works on the CPU too: that fraction of the host's available
    memory, in whole blocks; without it the CPU default (requests x length) stays."""
    import jax.numpy as jnp

    from jaxserve.engine import kv_sizing

    pages, page = 1_000_000, 4096
    config, block_bytes = _demo_kv_on_a_host(monkeypatch, {"SC_AVPHYS_PAGES": pages}, page)
    got = kv_sizing.num_kv_blocks(config, 16, jnp.float32, 0.25, 4, 64)
    assert got == int(pages * page * 0.25) // block_bytes
    assert kv_sizing.num_kv_blocks(config, 16, jnp.float32, None, 4, 64) == 4 * 4 + 1


def test_num_blocks_past_all_of_the_hosts_memory_is_refused(monkeypatch):
    """--num-blocks is checked against the host's physical memory (the whole of it: the
    user may know better than what is free now); past it the allocation ended in a bare
    MemoryError. The limit is exact: the block count that just fits is taken."""
    import jax.numpy as jnp

    from jaxserve.engine import kv_sizing

    pages, page = 1000, 4096
    config, block_bytes = _demo_kv_on_a_host(monkeypatch, {"SC_PHYS_PAGES": pages}, page)
    fits = pages * page // block_bytes
    kv_sizing.check_num_blocks(fits, config, 16, jnp.float32)
    with pytest.raises(ValueError, match=f"^num_blocks: {fits + 1} blocks of 16 tokens need "):
        kv_sizing.check_num_blocks(fits + 1, config, 16, jnp.float32)


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


def test_fewer_batched_tokens_than_sequences_is_refused_before_any_process():
    """The scheduler's rule (max_num_batched_tokens >= max_num_seqs), named by its flag
    when the flags are read; the engine used to find it after loading the weights."""
    with pytest.raises(ValueError, match=r"^max-num-batched-tokens: must be >= --max-num-seqs"):
        _config("--max-num-seqs", "4", "--max-num-batched-tokens", "2")
    with pytest.raises(ValueError, match=r"must be >= --max-num-seqs \(1024\), got 512"):
        _config("--max-num-seqs", "1024")
    config = _config("--max-num-seqs", "4", "--max-num-batched-tokens", "4")
    assert config.scheduler.max_num_batched_tokens == 4
