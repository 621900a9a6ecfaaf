"""`save_hf_weights` and the Orbax-converted checkpoint of a model whose MoE blocks have
redundant expert slots (a mesh with num_redundant_experts, re-placed as EPLB would).

Oracle: the original HF checkpoint's tensors (safetensors, read directly): saving must
write each logical expert once, with its own weights, whatever slots hold it.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from model_utils import write_hf_checkpoint
from safetensors.numpy import load_file
from sharding_utils import mesh_qwen3_moe_config

from jaxserve.models.loader import save_hf_weights
from jaxserve.sharding.load import load_sharded_model
from jaxserve.sharding.mesh import build_mesh
from jaxserve.sharding.placement import placement_from_slots

NUM_EXPERTS, REDUNDANT = 16, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("redundant_slots_qwen3_moe")
    write_hf_checkpoint(mesh_qwen3_moe_config(32), path, seed=0)
    return path


def _replace(model, rng) -> None:
    """Re-place every MoE block's slots at random (every expert kept), moving the weights
    and tables as EPLB does: slot s gets the weights of expert new_p2l[s]."""
    state = dict(nnx.to_flat_state(nnx.state(model)))
    blocks = {p[:-1] for p in state if p[-1] == "physical_to_logical"}
    for block in blocks:
        p2l = np.asarray(state[(*block, "physical_to_logical")].get_value())
        extra = rng.integers(0, NUM_EXPERTS, REDUNDANT)
        new = rng.permutation(np.concatenate([np.arange(NUM_EXPERTS), extra]))
        first = {int(e): s for s, e in reversed(list(enumerate(p2l)))}
        for name in ("w_gate", "w_up", "w_down"):
            var = state[(*block, name)]
            value = np.asarray(jax.device_get(var.get_value()))
            logical = value[[first[e] for e in range(NUM_EXPERTS)]]
            var.set_value(jax.device_put(logical[new], var.get_value().sharding))
        tables = placement_from_slots(new, NUM_EXPERTS, REDUNDANT + 1)
        for name in ("logical_to_physical", "replica_counts", "physical_to_logical"):
            var = state[(*block, name)]
            var.set_value(jax.device_put(getattr(tables, name), var.get_value().sharding))


def test_save_hf_weights_writes_each_expert_once_from_its_slots(checkpoint, tmp_path):
    model, _ = load_sharded_model(checkpoint, build_mesh(8, 1), num_redundant_experts=REDUNDANT)
    _replace(model, np.random.default_rng(0))
    saved = load_file(str(save_hf_weights(model, tmp_path / "out")))
    original = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        original.update(load_file(str(f)))
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        np.testing.assert_array_equal(saved[name], tensor, err_msg=name)


def test_orbax_converted_checkpoint_restores_onto_redundant_slots(checkpoint, tmp_path):
    from jaxserve.convert import convert

    out = tmp_path / "converted"
    convert(checkpoint, out)  # one device: [E, ...] experts in the checkpoint
    model, _ = load_sharded_model(out, build_mesh(8, 1), num_redundant_experts=REDUNDANT)
    state = dict(nnx.to_flat_state(nnx.state(model)))
    blocks = [p[:-1] for p in state if p[-1] == "physical_to_logical"]
    assert blocks
    for block in blocks:
        p2l = np.asarray(state[(*block, "physical_to_logical")].get_value())
        assert len(p2l) == NUM_EXPERTS + REDUNDANT
        w = np.asarray(jax.device_get(state[(*block, "w_up")].get_value()))
        for s, e in enumerate(p2l):  # every replica slot holds its expert's weights
            np.testing.assert_array_equal(w[s], w[int(e)])
    saved = load_file(str(save_hf_weights(model, tmp_path / "hf")))
    original = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        original.update(load_file(str(f)))
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        np.testing.assert_array_equal(saved[name], tensor, err_msg=name)
