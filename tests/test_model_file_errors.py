"""A model folder's files with values that parse but cannot be served: start-up ends with
one line naming the file and the field, exit code 2 (a bad setting, as the README says),
or logs one warning where the model still runs. No engine is started: the checks run
before any process (`jaxserve.preflight`) or in the frontend's own start.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from test_startup_errors import MOCK, one_error_line, serve

from jaxserve import preflight
from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.models.config import ModelConfig


def _demo_config(**changes) -> dict:
    hf = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    hf.update(changes)
    return hf


def _edit_config(folder: Path, **changes) -> None:
    (folder / "config.json").write_text(json.dumps(_demo_config(**changes)))


@pytest.mark.parametrize("value", [0, 1, -5])
def test_max_position_embeddings_below_two_is_named(value):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(_demo_config(max_position_embeddings=value))
    assert str(e.value) == f"config.json: max_position_embeddings must be >= 2, got {value}"


def test_two_positions_are_enough():
    assert ModelConfig.from_hf(_demo_config(max_position_embeddings=2)).max_position_embeddings == 2


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_theta": 0, "rope_parameters": None},
        {"rope_theta": -1.0, "rope_parameters": None},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},
        {"rope_theta": float("nan"), "rope_parameters": None},
    ],
)
def test_rope_theta_not_positive_is_named(changes):
    with pytest.raises(ValueError, match=r"^config\.json: rope_theta must be > 0, got "):
        ModelConfig.from_hf(_demo_config(**changes))


def test_deepseek_rope_theta_is_checked_too():
    from deepseek_utils import tiny_deepseek_v3_config  # imports transformers

    hf = {**tiny_deepseek_v3_config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    assert ModelConfig.from_hf(hf).rope_theta > 0
    hf["rope_theta"] = -10.0  # transformers 4.x's spelling, and 5.x's below
    hf["rope_parameters"] = {**(hf.get("rope_parameters") or {}), "rope_theta": -10.0}
    with pytest.raises(ValueError, match="rope_theta must be > 0, got -10.0"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("value", [0, -5])
def test_serve_refuses_max_position_embeddings_in_one_line(model_copy, value):
    # Before: "engine failed to start: KeyError: 16" (exit 1) or numpy's "negative
    # dimensions are not allowed", after the engine had started.
    _edit_config(model_copy, max_position_embeddings=value)
    code, lines = serve(str(model_copy), timeout=30)
    assert code == 2
    assert one_error_line(lines) == (
        f"jaxserve serve: error: model: {model_copy / 'config.json'}: "
        f"max_position_embeddings must be >= 2, got {value}"
    )


@pytest.mark.parametrize("value", [0, -4, 2.5, True])
def test_head_dim_below_one_or_not_an_integer_is_named(value):
    # 0 fell back to hidden_size // num_attention_heads without a word; -4 started the
    # engine, which then failed on numpy's "negative dimensions are not allowed".
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(_demo_config(head_dim=value))
    assert str(e.value) == f"config.json: head_dim must be an integer >= 1, got {value!r}"


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_size", "x"), ("num_attention_heads", "4"), ("vocab_size", [4096]),
     ("num_hidden_layers", True)],
)  # fmt: skip
def test_a_required_field_of_the_wrong_type_is_named(field, value):
    # int("x") alone raised "invalid literal for int() with base 10: 'x'", naming nothing;
    # "4" and true were taken as 4 and 1.
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(_demo_config(**{field: value}))
    assert str(e.value) == f"config.json: {field} must be int, got {value!r}"


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "num_hidden_layers"])
@pytest.mark.parametrize("value", [0, -4])
def test_a_size_below_one_is_named(field, value):
    # With head_dim given, num_attention_heads 0 failed on a checkpoint tensor's shape.
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(_demo_config(**{field: value}))
    assert str(e.value) == f"config.json: {field} must be >= 1, got {value}"


def test_head_dim_absent_or_null_is_hidden_size_over_heads():
    hf = _demo_config()
    expected = hf["hidden_size"] // hf["num_attention_heads"]  # HF's default
    del hf["head_dim"]
    assert ModelConfig.from_hf(hf).head_dim == expected
    assert ModelConfig.from_hf({**hf, "head_dim": None}).head_dim == expected
    assert ModelConfig.from_hf({**hf, "head_dim": 7}).head_dim == 7


def test_serve_refuses_head_dim_zero_in_one_line(model_copy):
    _edit_config(model_copy, head_dim=0)
    code, lines = serve(str(model_copy), timeout=30)
    assert code == 2
    assert one_error_line(lines) == (
        f"jaxserve serve: error: model: {model_copy / 'config.json'}: "
        "head_dim must be an integer >= 1, got 0"
    )


def test_eos_outside_the_vocabulary_is_one_warning(model_copy, caplog):
    _edit_config(model_copy, eos_token_id=999_999)
    gen = json.loads((model_copy / "generation_config.json").read_text())
    gen["eos_token_id"] = [0, 4096]  # 4096 = vocab_size: one past the last id
    (model_copy / "generation_config.json").write_text(json.dumps(gen))
    with caplog.at_level(logging.WARNING, logger="jaxserve.preflight"):
        preflight.check_model_folder(model_copy)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "eos_token_id 4096, 999999 of" in warnings[0]
    assert "outside the vocabulary [0, 4096)" in warnings[0]


def test_eos_inside_the_vocabulary_is_no_warning(model_copy, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve.preflight"):
        preflight.check_model_folder(model_copy)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_broken_tokenizer_json_is_a_bad_setting(model_copy):
    # Exit code 1 before, though the README gives 2 for a bad file of the model folder.
    (model_copy / "tokenizer.json").write_text('{"model": 1}')
    code, lines = serve(str(model_copy), *MOCK)
    assert code == 2
    assert one_error_line(lines).startswith(
        f"jaxserve serve: error: model: cannot load {model_copy / 'tokenizer.json'}: "
    )


def test_cache_root_that_is_a_file_names_the_variable(model_copy, tmp_path):
    # It named --compilation-cache-dir, a flag the user never passed.
    afile = tmp_path / "afile"
    afile.write_text("")
    code, lines = serve(str(model_copy), *MOCK, env={"JAXSERVE_CACHE_ROOT": str(afile)})
    assert code == 2
    assert one_error_line(lines) == (
        f"jaxserve serve: error: JAXSERVE_CACHE_ROOT: cannot create {afile}/jax_cache "
        f"(Not a directory); point JAXSERVE_CACHE_ROOT (now {afile}) at a writable folder, "
        "or pass --no-compilation-cache"
    )


def test_compilation_cache_dir_flag_is_named_when_given(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError) as e:
        preflight.check_compilation_cache_dir(str(afile))
    assert str(e.value) == (
        f"compilation-cache-dir: {afile} is not a folder; give --compilation-cache-dir a "
        "writable folder, or pass --no-compilation-cache"
    )


def test_chat_template_json_without_template_is_named_once(tmp_path):
    from jaxserve.frontend.http.chat_template import ChatTemplateError, load_chat_template

    path = tmp_path / "X.json"
    path.write_text('{"bos_token": "<s>"}')
    with pytest.raises(ChatTemplateError) as e:
        load_chat_template(DEMO_MODEL_DIR, path)
    assert str(e.value) == f"chat-template: {path} has no chat_template entry"


@pytest.mark.parametrize(("value", "shown"), [(5, "5"), ({"a": 1}, '{"a": 1}')])
def test_model_chat_template_not_a_string_is_named_at_start(model_copy, value, shown):
    # With --http-port (the only user of tokenizer_config.json), exit 2 before any
    # process starts; the file is the model folder's, so "model:", not the flag's name.
    config_path = model_copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": value}))
    code, lines = serve(str(model_copy), "--http-port", "0", *MOCK)
    assert code == 2
    assert one_error_line(lines) == (
        f"jaxserve serve: error: model: {config_path}: chat_template must be a string or a "
        f'list of {{"name", "template"}} objects, got {shown}'
    )


def test_model_chat_template_null_is_no_template(model_copy):
    from jaxserve.frontend.http.chat_template import load_chat_template

    config_path = model_copy / "tokenizer_config.json"
    config_path.write_text(json.dumps({"chat_template": None}))
    assert load_chat_template(model_copy) is None  # as transformers: no template


@pytest.mark.parametrize("text", ["", " \n\t\n"])
def test_empty_chat_template_is_refused_at_start(model_copy, tmp_path, text):
    # It was accepted; every chat request then got 400 "the chat renders to no tokens".
    path = tmp_path / "t.jinja"
    path.write_text(text)
    code, lines = serve(str(model_copy), "--chat-template", str(path), "--http-port", "0", *MOCK)
    assert code == 2
    assert one_error_line(lines) == (
        f"jaxserve serve: error: --chat-template: {path} is empty (no template text)"
    )
