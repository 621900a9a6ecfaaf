"""The CPU kernel of the sparse MoE experts (`jaxserve.kernels.cpu_moe`).

Oracle: each token copy through its own expert in NumPy float64 (`moe_oracle`). The
kernel must build wherever a C++ compiler is on PATH (the test environment has one);
without one, the XLA path must run instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_oracle import expert_rows_oracle, random_experts

from jaxserve.kernels import cpu_moe
from jaxserve.models.moe_sparse import sparse_expert_ffn


def _uses_kernel(fn, *args) -> bool:
    """Whether the traced `fn(*args)` calls the kernel (an FFI custom call)."""
    return "ffi_call" in str(jax.make_jaxpr(fn)(*args))


def _case(num_tokens, top_k, num_experts, hidden, inter, seed, routing="random"):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.float32)
    if routing == "random":  # may repeat an expert within a token, and holds empty copies
        ids = rng.integers(0, num_experts + 1, (num_tokens, top_k))
    elif routing == "one expert":  # every copy on expert 1: many row blocks of one expert
        ids = np.ones((num_tokens, top_k))
    else:  # "all empty"
        ids = np.full((num_tokens, top_k), num_experts)
    experts = random_experts(num_experts, hidden, inter, seed=seed)
    return x, jnp.asarray(ids, jnp.int32), experts


def test_kernel_builds_where_a_compiler_is():
    assert cpu_moe.available() or cpu_moe.compiler() is None


# (num_tokens, top_k, num_experts, hidden, inter, routing) of the kernel's cases.
CASES = [
    # Experts whose [H, I] matrices hold up to kSmallExpertFloats (64 Ki) floats run
    # register tiles at any row count (AVX-512 or AVX2 builds), else the row path.
    (1, 2, 8, 16, 8, "random"),
    (3, 4, 8, 40, 24, "random"),  # widths that are not a multiple of a SIMD vector
    (17, 2, 6, 16, 8, "random"),
    (9, 4, 4, 32, 16, "one expert"),  # 36 rows of one expert: 9 blocks of 4
    (5, 2, 8, 16, 8, "all empty"),
    # Larger matrices (264 x 250 > 64 Ki floats): the row path below 8 rows an expert,
    # blocks of 4, odd widths.
    (5, 2, 4, 264, 250, "random"),
    (7, 1, 2, 250, 264, "one expert"),  # 7 rows: blocks of 4 and 3
    # From 8 rows per expert: register tiles, blocks of 4 to 8 rows and widths that
    # are not a multiple of 16 (masked lanes).
    (9, 4, 4, 264, 250, "one expert"),
    (40, 4, 8, 40, 24, "random"),
    (90, 3, 5, 48, 20, "random"),
    (23, 2, 4, 17, 33, "one expert"),  # 46 rows: one unit, blocks of 7 and 8
    (100, 3, 4, 32, 16, "one expert"),  # 300 rows: units of 60, split over threads
    # Panel-major on AVX-512: tiles of up to 24 rows (kPanelsTileRows), whose packing
    # transposes 16 rows x 16 columns at a time: 24 rows one block (16 + 8 packed), 25
    # two (13 + 12); hidden 80 = 5 x 16 columns.
    (24, 1, 2, 80, 32, "one expert"),
    (25, 1, 2, 80, 32, "one expert"),
    # AVX2 builds: units of 2-3 row blocks (8-18 rows) over widths that are a multiple
    # of 16 read the weights in k-chunks of 64 rows (cpu_moe_chunks.h), accumulating
    # across chunks: 144 and 160 rows are 2 chunks and a part; 13, 16 and 10 rows.
    (13, 4, 4, 144, 96, "random"),
    (16, 1, 2, 160, 80, "one expert"),
    (10, 1, 2, 128, 64, "one expert"),
]
# The panel-major weights (`ExpertPanels`) need the register tiles (AVX2 + FMA or AVX-512).
needs_tiles = pytest.mark.skipif(
    not cpu_moe.has_tiles(), reason="a CPU without AVX2 + FMA / AVX-512: nothing is packed"
)


@pytest.mark.parametrize("layout", ["row-major", pytest.param("panel-major", marks=needs_tiles)])
@pytest.mark.parametrize("num_tokens,top_k,num_experts,hidden,inter,routing", CASES)
def test_kernel_equals_the_row_oracle(
    num_tokens, top_k, num_experts, hidden, inter, routing, layout
):
    """Both layouts (panel-major: every expert on register tiles, even at one row)."""
    if not cpu_moe.available():
        pytest.fail("the CPU MoE kernel did not build (see the log)")
    x, ids, experts = _case(num_tokens, top_k, num_experts, hidden, inter, 3, routing)
    held = experts
    if layout == "panel-major":
        held = tuple(cpu_moe.ExpertPanels.pack(w) for w in experts)
    got = np.asarray(jax.jit(cpu_moe.moe_rows_ffn)(x, ids, *held))
    want = expert_rows_oracle(x, ids, *experts)
    # float32 sums of H and I products: within ~1e-6 of the outputs' scale of the float64
    # oracle (the larger matrices' outputs reach ~300).
    atol = max(1e-5, 2e-6 * np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)
    assert not got[np.asarray(ids) >= num_experts].any()  # empty copies give 0


def test_kernel_runs_inside_a_scan():
    """As in the multi-step decode call: the kernel inside a lax.scan, each step's output
    feeding the next step's input."""
    x, ids, experts = _case(2, 2, 8, 16, 8, 5)

    def step(h, _):
        y = cpu_moe.moe_rows_ffn(h, ids, *experts).sum(1)
        return jnp.tanh(y), None

    got = jax.jit(lambda h: jax.lax.scan(step, h, None, length=3)[0])(x)
    want = np.asarray(x, np.float64)
    for _ in range(3):
        want = np.tanh(expert_rows_oracle(want, ids, *experts).sum(1))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_default_path_uses_the_kernel_below_the_mean_group_limit():
    """sparse_expert_ffn (block_size None) calls the kernel below MAX_MEAN_GROUP routed
    rows per expert (MAX_MEAN_GROUP_TILED with AVX-512) and not from there, and equals
    the oracle either way."""
    num_experts, top_k = 4, 2
    mean_group = cpu_moe.MAX_MEAN_GROUP_TILED if cpu_moe.has_tiles() else cpu_moe.MAX_MEAN_GROUP
    limit = mean_group * num_experts // top_k  # tokens at the limit
    for num_tokens, kernel in ((1, True), (limit - 1, True), (limit, False)):
        x, ids, experts = _case(num_tokens, top_k, num_experts, 16, 8, num_tokens)
        fn = functools.partial(sparse_expert_ffn, block_size=None)
        assert _uses_kernel(fn, x, ids, *experts) == kernel, num_tokens
        np.testing.assert_allclose(
            np.asarray(jax.jit(fn)(x, ids, *experts)),
            expert_rows_oracle(x, ids, *experts),
            rtol=1e-5,
            atol=1e-5,
        )


def test_kernel_is_skipped_when_turned_off_or_not_float32(monkeypatch):
    x, ids, experts = _case(2, 2, 8, 16, 8, 7)
    fn = functools.partial(sparse_expert_ffn, block_size=None)
    monkeypatch.setenv(cpu_moe.ENV_VAR, "0")
    assert not _uses_kernel(fn, x, ids, *experts)
    monkeypatch.setenv(cpu_moe.ENV_VAR, "1")
    bf16 = [w.astype(jnp.bfloat16) for w in experts]
    assert not _uses_kernel(fn, x.astype(jnp.bfloat16), ids, *bf16)
    monkeypatch.setenv(cpu_moe.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=cpu_moe.ENV_VAR):  # a new function: a new trace
        jax.make_jaxpr(functools.partial(sparse_expert_ffn, block_size=None))(x, ids, *experts)


def test_without_a_compiler_the_xla_path_runs(monkeypatch, tmp_path, caplog):
    """No compiler: building raises a one-line reason, and the default path runs XLA's
    layouts with the same outputs."""
    monkeypatch.setattr(cpu_moe, "compiler", lambda: None)
    monkeypatch.setenv("JAXSERVE_CACHE_ROOT", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_moe._build()
    monkeypatch.setattr(cpu_moe, "available", lambda: False)
    x, ids, experts = _case(3, 2, 8, 16, 8, 9)
    fn = functools.partial(sparse_expert_ffn, block_size=None)
    assert not _uses_kernel(fn, x, ids, *experts)
    np.testing.assert_allclose(
        np.asarray(jax.jit(fn)(x, ids, *experts)),
        expert_rows_oracle(x, ids, *experts),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(RuntimeError, match="not available"):
        cpu_moe.moe_rows_ffn(x, ids, *experts)


def test_a_failed_build_names_the_command(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_moe, "SOURCE", tmp_path / "broken.cc")
    (tmp_path / "broken.cc").write_text("this is not C++\n")
    monkeypatch.setenv("JAXSERVE_CACHE_ROOT", str(tmp_path / "cache"))
    if cpu_moe.compiler() is None:
        pytest.fail("no C++ compiler on PATH: the test environment needs one (g++)")
    with pytest.raises(RuntimeError, match="broken.cc"):
        cpu_moe._build()
    assert not list((tmp_path / "cache" / "cpu_kernels").glob("*.so"))  # nothing half-built


def test_expert_panels_hold_each_16_column_panel_contiguously():
    """panels[e, p, k, j] = W[e, k, 16 p + j], zero past N; `unpack` is W again."""
    w = np.arange(2 * 3 * 20, dtype=np.float32).reshape(2, 3, 20)
    held = cpu_moe.ExpertPanels.pack(jnp.asarray(w))
    panels = np.asarray(held.panels)
    assert panels.shape == (2, 2, 3, 16) and held.shape == (2, 3, 20)
    for e, p, k, j in np.ndindex(panels.shape):
        want = w[e, k, 16 * p + j] if 16 * p + j < 20 else 0.0
        assert panels[e, p, k, j] == want, (e, p, k, j)
    np.testing.assert_array_equal(np.asarray(held.unpack()), w)
    assert held[...] is held


@needs_tiles
def test_xla_paths_take_expert_panels_unpacked(monkeypatch):
    """Where the kernel does not run on weights held panel-major (past the mean-group
    limit, an explicit block size, the kernel off at trace time, the dense oracle), the
    XLA paths get the logical arrays: the same outputs as the oracle, no kernel call."""
    from jaxserve.kernels import dispatch
    from jaxserve.models.moe_experts import moe_experts_local

    num_experts, top_k = 4, 2
    mean_group = cpu_moe.MAX_MEAN_GROUP_TILED
    limit = mean_group * num_experts // top_k  # tokens at the limit: XLA's path
    x, ids, experts = _case(limit, top_k, num_experts, 16, 24, 11)
    held = tuple(cpu_moe.ExpertPanels.pack(w) for w in experts)
    want = expert_rows_oracle(x, ids, *experts)
    small = (x[:5], ids[:5])
    calls = [
        (functools.partial(sparse_expert_ffn, block_size=None), (x, ids), want, "1"),
        (functools.partial(sparse_expert_ffn, block_size=4), small, want[:5], "1"),
        (functools.partial(sparse_expert_ffn, block_size=None), small, want[:5], "0"),
    ]
    for fn, (xs, ids_s), expected, env in calls:
        monkeypatch.setenv(cpu_moe.ENV_VAR, env)
        assert not _uses_kernel(fn, xs, ids_s, *held)
        np.testing.assert_allclose(
            np.asarray(jax.jit(fn)(xs, ids_s, *held)), expected, rtol=1e-5, atol=1e-5
        )
    monkeypatch.setenv(cpu_moe.ENV_VAR, "1")
    monkeypatch.setenv(dispatch.MOE_ENV_VAR, dispatch.MOE_DENSE)
    xs, ids_s = small
    weights = jnp.asarray(np.random.default_rng(1).random(ids_s.shape), jnp.float32)
    got = jax.jit(moe_experts_local)(xs, weights, ids_s, *held)
    combined = np.einsum("tk,tkh->th", np.asarray(weights, np.float64), want[:5])
    np.testing.assert_allclose(np.asarray(got), combined, rtol=1e-5, atol=1e-5)


def test_pack_experts_off_unavailable_other_dtypes_and_a_missing_path(monkeypatch):
    f32, bf16 = jnp.ones((2, 4, 8), jnp.float32), jnp.ones((2, 4, 8), jnp.bfloat16)
    index = {("a",): 0, ("b",): 1}
    monkeypatch.setenv(cpu_moe.ENV_VAR, "0")
    assert cpu_moe.pack_experts([f32], index, [("a",)]) == [f32]
    monkeypatch.setenv(cpu_moe.ENV_VAR, "1")
    monkeypatch.setattr(cpu_moe, "available", lambda: False)
    assert cpu_moe.pack_experts([f32], index, [("a",)]) == [f32]
    monkeypatch.setattr(cpu_moe, "available", lambda: True)
    monkeypatch.setattr(cpu_moe, "has_tiles", lambda: True)
    out = cpu_moe.pack_experts([f32, bf16], index, [("a",), ("b",)])
    assert isinstance(out[0], cpu_moe.ExpertPanels) and out[1] is bf16
    with pytest.raises(KeyError, match="w_gate"):
        cpu_moe.pack_experts([f32], index, [("layers", 0, "mlp", "w_gate")])


@needs_tiles
def test_engine_greedy_tokens_are_unchanged_by_the_packed_experts(demo_greedy):
    """The demo model's (4 MoE layers) greedy tokens with the experts held panel-major for
    the kernel and with the kernel off (its XLA path on the logical arrays): equal, and
    all three expert weights of each layer are packed only when the kernel is on."""
    on, held_on = demo_greedy("1", "1")
    off, held_off = demo_greedy("1", "0")
    assert held_on.get("ExpertPanels") == 4 * 3
    assert "ExpertPanels" not in held_off
    assert on == off
