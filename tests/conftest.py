"""Session fixtures shared by every test file. Use them rather than building your own:
an engine compile costs tens of seconds on the 2-core test machine, a server start seconds.

Engines (one compiled `EngineCore` per config for the whole session; tests leave them idle):
- `tiny_moe_dir`: a tiny random Qwen3-MoE HF checkpoint (with a byte-level BPE tokenizer);
  `tiny_engine_config` / `tiny_engine`: the engine on it. Tests that need another KV pool
  size, token budget or prefix-cache setting swap in a fresh scheduler over the same
  compiled runner (`swap_scheduler`), which changes no compiled shape.
- `hf_model`: the tiny checkpoint in HF transformers, the independent reference.
- `demo_llm`: the offline `LLM` on the bundled demo model with `DEMO_ENGINE` settings
  (tests/server_harness.py); a `jaxserve serve` with `serve_flags(DEMO_ENGINE)` starts
  on the executables it compiled (the shared compilation cache below).
- `demo_greedy(dense, moe)`: the demo model's greedy tokens with the CPU dense / MoE
  kernels on or off (and so their packed weights), one engine per setting.

- `mesh_model_dir`: the tiny Qwen3-MoE every 8-device mesh holds
  (`sharding_utils.mesh_qwen3_moe_config`, seed 0, the session tokenizer);
  `mesh_engine(dp, tp)`: one compiled `EngineCore` per mesh on it
  (`sharding_utils.mesh_engine_config`), shared by tests/test_engine_mesh.py,
  test_multihost.py and test_eplb_multiprocess.py (tests leave them idle).

Servers: `mock_model_dir`, a model folder for the mock engine (tests/mock_engine.py), whose
server (`hostile_helpers.mock_server`) starts in about a second.

Compilation cache: one JAX persistent compilation cache for the session, in a temporary
folder (or `$JAXSERVE_TEST_CACHE_ROOT`, to keep it across runs), shared by this process,
the other pytest-xdist workers (scripts/test.sh runs two) and every process a test
starts: `JAXSERVE_CACHE_ROOT` is set for them, so the engine's default
`compilation_cache_dir` points into it. It never masks a compile count:
`CompileCounter` (jaxserve/engine/compile_counter.py) counts persistent-cache hits as
compilations, so "no compilation after warm-up" still means no executable was asked for.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from server_harness import cpu_xla_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 emulated CPU devices for the mesh tests (tests/test_sharding.py); single-device
# tests use the first. Compiled with LLVM's cheap pipeline (server_harness.cpu_xla_flags).
os.environ.setdefault("XLA_FLAGS", cpu_xla_flags(8))


def _session_cache_root() -> str:
    root = os.environ.get("JAXSERVE_TEST_CACHE_ROOT")
    if root:
        return root
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("JAXSERVE_CACHE_ROOT"):
        # A pytest-xdist worker: the folder the controller made when it loaded this file
        # (inherited; the controller removes it at exit), so that an executable one worker
        # compiled (each builds its own session engines) is a cache hit in the other.
        return os.environ["JAXSERVE_CACHE_ROOT"]
    root = tempfile.mkdtemp(prefix="jaxserve-test-cache-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


# Before jaxserve is imported: jaxserve.config reads it for its defaults.
os.environ["JAXSERVE_CACHE_ROOT"] = _session_cache_root()
SESSION_COMPILATION_CACHE_DIR = os.path.join(os.environ["JAXSERVE_CACHE_ROOT"], "jax_cache")

import pytest  # noqa: E402


def pytest_configure(config):
    # Every jit of this process too (kernels, models, sharding), not only engines'.
    from jaxserve.engine.builder import enable_compilation_cache

    enable_compilation_cache(SESSION_COMPILATION_CACHE_DIR)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which may not be installed
def pytest_xdist_make_scheduler(config, log):
    """Under `-n N --dist loadfile` (scripts/test.sh): a test file goes to one worker, so
    that its module fixtures (servers, engines) start once, and so does a folder of tests
    under tests/: http_api_tests/' files share one package-scoped server (~30 s to start)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FolderOrFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]  # tests/test_x.py or tests/folder/test_x.py
            parts = path.split("/")
            return "/".join(parts[:2]) if len(parts) > 2 and parts[0] == "tests" else path

    return FolderOrFileScheduling(config, log)


TINY_BLOCK_SIZE = 8
TINY_MAX_MODEL_LEN = 256
TINY_MAX_NUM_SEQS = 8
TINY_MAX_BATCHED_TOKENS = 64
TINY_NUM_BLOCKS = 192
TINY_DECODE_STEPS = 4


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """A random Qwen3-MoE HF folder (config.json, model.safetensors, tokenizer.json).

    No EOS id: generation runs to max_tokens unless a test sets stop ids itself.
    """
    from mock_engine import train_test_tokenizer
    from model_utils import tiny_qwen3_moe_config, write_hf_checkpoint

    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    tok = train_test_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    config = tiny_qwen3_moe_config(
        vocab_size=tok.get_vocab_size(), max_position_embeddings=TINY_MAX_MODEL_LEN
    )
    write_hf_checkpoint(config, path, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_engine_config(tiny_moe_dir):
    from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig

    # Shapes: T in (16, 32, 64) with R = 8, plain and full (penalty history, prompt
    # logits), plus the 4-step decode call at R = 4 and 8: 8 executables. Async scheduling and
    # multi-step decode are on, so every engine test runs the engine's deepest path;
    # tests that compare against them turn them off with `swap_scheduler`.
    return EngineConfig(
        model=str(tiny_moe_dir),
        cache=CacheConfig(block_size=TINY_BLOCK_SIZE, num_blocks=TINY_NUM_BLOCKS),
        scheduler=SchedulerConfig(
            max_num_seqs=TINY_MAX_NUM_SEQS,
            max_num_batched_tokens=TINY_MAX_BATCHED_TOKENS,
            async_scheduling=True,
            num_decode_steps=TINY_DECODE_STEPS,
        ),
        # The default compilation cache: the session's (see the module docstring).
    )


@pytest.fixture(scope="session")
def tiny_engine(tiny_engine_config):
    """One compiled EngineCore for the whole session (tests must leave it idle)."""
    from jaxserve.engine.core import EngineCore

    return EngineCore(tiny_engine_config)


@pytest.fixture(scope="session")
def hf_model(tiny_moe_dir):
    """The tiny checkpoint in HF transformers (torch, float32): the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    # No EOS: run to max_new_tokens. No pad id either: HF would mask prompt tokens equal
    # to it (the attention mask is passed explicitly instead).
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="session")
def mesh_model_dir(tmp_path_factory, tiny_moe_dir) -> Path:
    """Heads, KV heads and experts divisible by 8 devices (vocab 256, MESH_MAX_LEN
    positions, no EOS), with the session tokenizer for the `LLM` tests."""
    from model_utils import write_hf_checkpoint
    from sharding_utils import MESH_MAX_LEN, mesh_qwen3_moe_config

    path = tmp_path_factory.mktemp("mesh_qwen3_moe")
    write_hf_checkpoint(mesh_qwen3_moe_config(MESH_MAX_LEN, vocab_size=256), path, seed=0)
    shutil.copy(tiny_moe_dir / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture(scope="session")
def mesh_engine(mesh_model_dir):
    """`mesh_engine(dp, tp)`: the session's EngineCore on that mesh of the emulated
    devices (1, 1: one device, no mesh code), built on first use; tests leave it idle.
    Each call empties its prefix cache (`BlockManager.reset_prefix_cache`), so a test's
    requests never hit blocks that an earlier test's requests left, as on a new engine."""
    from sharding_utils import mesh_engine_config

    from jaxserve.engine.core import EngineCore

    engines: dict[tuple[int, int], EngineCore] = {}

    def get(dp: int, tp: int) -> EngineCore:
        if (dp, tp) not in engines:
            engines[dp, tp] = EngineCore(mesh_engine_config(mesh_model_dir, dp, tp))
        engine = engines[dp, tp]
        assert not engine.has_work(), "a test left the session's mesh engine busy"
        for bm in engine.block_managers:
            bm.reset_prefix_cache()
        return engine

    return get


@pytest.fixture(scope="session")
def compile_cache() -> str:
    """The session's JAX compilation cache folder (already the engines' default)."""
    return SESSION_COMPILATION_CACHE_DIR


@pytest.fixture(scope="session")
def mock_model_dir(tmp_path_factory) -> Path:
    """A model folder for the mock engine: tokenizer.json and config.json (read-only)."""
    from mock_engine import write_mock_model_dir

    return write_mock_model_dir(tmp_path_factory.mktemp("mock_model"))


@pytest.fixture
def model_copy(tmp_path) -> Path:
    """The demo model's files in a folder the test may break (weights linked, not copied)."""
    from jaxserve.config import DEMO_MODEL_DIR

    folder = tmp_path / "model"
    folder.mkdir()
    for f in DEMO_MODEL_DIR.iterdir():
        if f.suffix == ".safetensors":
            (folder / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="session")
def demo_llm():
    """The offline `LLM` on the bundled demo model, `DEMO_ENGINE` settings (tests leave
    it idle)."""
    from server_harness import DEMO_ENGINE

    from jaxserve import LLM
    from jaxserve.config import DEMO_MODEL_DIR

    return LLM(model=DEMO_MODEL_DIR, **DEMO_ENGINE)


@pytest.fixture(scope="session")
def demo_greedy():
    """`demo_greedy(dense, moe)`: the bundled demo model through the offline `LLM` (prefill
    and multi-step decode, batch 3, 12 greedy tokens each) with JAXSERVE_CPU_DENSE_KERNEL
    = dense and JAXSERVE_CPU_MOE_KERNEL = moe ("1" or "0"), every projection packable
    (`cpu_dense.MIN_WEIGHT_FLOATS` 1). Returns (token ids per prompt, {type name: count}
    of the runner's parameters), one engine per setting for the session (the CPU kernel
    tests compare the settings)."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import DEMO_MODEL_DIR
    from jaxserve.kernels import cpu_dense, cpu_moe

    prompts = [[1, 2, 3, 4, 5], [7] * 19, list(range(30, 41))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}

    def run(dense: str, moe: str):
        if (dense, moe) not in runs:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(cpu_dense, "MIN_WEIGHT_FLOATS", 1)
                mp.setenv(cpu_dense.ENV_VAR, dense)
                mp.setenv(cpu_moe.ENV_VAR, moe)
                llm = LLM(model=DEMO_MODEL_DIR, max_num_seqs=4, max_model_len=64,
                          num_blocks=32, block_size=16, compilation_cache_dir=None)  # fmt: skip
                kinds = collections.Counter(type(p).__name__ for p in llm.engine.runner._params)
                tokens = [o.token_ids for o in llm.generate(prompts, params)]
                del llm
            runs[dense, moe] = (tokens, dict(kinds))
        return runs[dense, moe]

    return run


@contextlib.contextmanager
def swap_scheduler(
    engine,
    num_blocks: int | None = None,
    enable_prefix_caching: bool = True,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    enable_chunked_prefill: bool = True,
    num_decode_steps: int | None = None,
    async_scheduling: bool | None = None,
):
    """Run the engine with a fresh scheduler and block pool, restoring the old ones after.

    A smaller `num_blocks` than the KV cache holds simply leaves the rest unused; budgets
    up to the compiled maxima need no new executable; `num_decode_steps` is 1 or the
    compiled one.
    """
    from jaxserve.engine.block_manager import BlockManager
    from jaxserve.engine.scheduler import Scheduler

    old = engine.scheduler
    bm = BlockManager(num_blocks or old.bm.num_blocks, old.bm.block_size, enable_prefix_caching)
    engine.scheduler = Scheduler(
        bm,
        max_num_seqs=max_num_seqs or old.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or old.max_num_batched_tokens,
        max_model_len=old.max_model_len,
        eos_token_ids=old.eos_token_ids,
        enable_chunked_prefill=enable_chunked_prefill,
        num_decode_steps=num_decode_steps or old.num_decode_steps,
        decode_steps_for_rows=old.decode_steps_for_rows,  # the compiled calls' steps
    )
    old_async = engine.async_scheduling
    if async_scheduling is not None:
        engine.async_scheduling = async_scheduling
    try:
        yield engine.scheduler
    finally:
        engine.scheduler = old
        engine.async_scheduling = old_async
