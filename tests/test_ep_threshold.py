"""A given MoE replicated-token threshold (`--ep-replicated-max-tokens`,
`MeshConfig.ep_replicated_max_tokens`, `LLM(ep_replicated_max_tokens=...)`): the model on
the mesh takes it as given and the start-up measurement does not run; unset, the engine
measures as before. Out-of-range values are refused naming the flag. The measurement
itself is tests/test_sharding.py's and test_warmup.py's."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest
from sharding_utils import mesh_engine_config

from jaxserve.cli import build_parser
from jaxserve.config import EngineConfig, MeshConfig
from jaxserve.engine import builder
from jaxserve.llm import build_engine_config
from jaxserve.serve_config import engine_config
from jaxserve.sharding import ep_calibration

FLAG = "--ep-replicated-max-tokens"


def _mesh_config(model_dir, threshold: int | None):
    config = mesh_engine_config(model_dir, 2, 4)
    config.mesh.ep_replicated_max_tokens = threshold
    return config


@pytest.mark.parametrize("given", [0, 12])
def test_a_given_threshold_is_the_models_and_nothing_is_measured(
    mesh_model_dir, monkeypatch, caplog, given
):
    def measure(*args, **kwargs):
        raise AssertionError(f"measured although {FLAG} was given")

    monkeypatch.setattr(ep_calibration, "measure_replicated_max_tokens", measure)
    with caplog.at_level(logging.INFO, logger=builder.__name__):
        model, _, mesh = builder._load_on_mesh(_mesh_config(mesh_model_dir, given), jnp.float32)
    assert dict(mesh.shape) == {"dp": 2, "tp": 4}
    assert model.parallel.replicated_max_tokens == given
    assert (
        f"MoE on dp=2,tp=4: replicated-token path for steps of <= {given} tokens, all_to_all "
        f"above (given by {FLAG}, not measured)"
    ) in caplog.text


def test_without_a_threshold_the_engine_measures_at_its_step_sizes(mesh_model_dir, monkeypatch):
    calls = []

    def measure(mesh, token_counts, *shapes):
        calls.append(list(token_counts))
        return 5  # no step size: only the measured value can reach the model

    monkeypatch.setattr(ep_calibration, "measure_replicated_max_tokens", measure)
    config = _mesh_config(mesh_model_dir, None)
    model, _, _ = builder._load_on_mesh(config, jnp.float32)
    assert model.parallel.replicated_max_tokens == 5
    # dp=2 x (the 16-token bucket, the 4-row decode bucket).
    assert calls == [[2 * 4, 2 * 16]]


def test_the_flag_the_keyword_and_the_config_json_carry_it():
    args = ["--mesh", "dp=2,tp=4", FLAG, "24"]
    assert engine_config(build_parser().parse_args(["serve", *args])).mesh == MeshConfig(2, 4, 24)
    assert engine_config(build_parser().parse_args(["serve"])).mesh.ep_replicated_max_tokens is None
    engine = build_parser().parse_args(["engine", "--frontend", "127.0.0.1:5000", FLAG, "0"])
    assert engine.ep_replicated_max_tokens == 0
    # mesh="dp=D,tp=T" names dp and tp only, before or after the keyword.
    for kwargs in (
        {"mesh": "dp=2,tp=4", "ep_replicated_max_tokens": 24},
        {"ep_replicated_max_tokens": 24, "mesh": "dp=2,tp=4"},
    ):
        assert build_engine_config("m", **kwargs).mesh == MeshConfig(2, 4, 24)
    # Replicas and headless engines get their config as JSON.
    config = EngineConfig(mesh=MeshConfig(2, 4, 24))
    assert EngineConfig.from_dict(config.to_dict()).mesh.ep_replicated_max_tokens == 24


@pytest.mark.parametrize(
    ("value", "error"),
    [("-1", f"argument {FLAG}: must be >= 0, got -1"),
     ("8.5", f"argument {FLAG}: not an integer: '8.5'")],
)  # fmt: skip
def test_a_bad_flag_value_is_one_usage_line_naming_the_flag(value, error, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", FLAG, value])
    assert e.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"jaxserve serve: error: {error} (see jaxserve serve --help)"


def test_a_bad_keyword_or_config_value_names_the_flag(mesh_model_dir):
    with pytest.raises(ValueError, match=f"ep_replicated_max_tokens \\({FLAG}\\): must be an"):
        build_engine_config("m", mesh="dp=2,tp=4", ep_replicated_max_tokens=-1)
    with pytest.raises(ValueError, match="got '8'"):
        build_engine_config("m", ep_replicated_max_tokens="8")
    # An EngineConfig built by hand: the engine refuses it before loading anything.
    with pytest.raises(ValueError, match=f"\\({FLAG}\\): must be an integer >= 0 tokens"):
        builder._load_on_mesh(_mesh_config(mesh_model_dir, -4), jnp.float32)
