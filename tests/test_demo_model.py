"""The bundled demo model (`jaxserve/demo_model/`, written by scripts/train_tiny_moe.py).

Checks that the committed folder is a valid Hugging Face checkpoint (transformers loads
it), that jaxserve's loader computes the same logits as transformers on it, and that the
model learned something: its greedy completions (by transformers, independent of
jaxserve) of code prompts look like Python.
"""

from __future__ import annotations

import json
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.models.loader import load_model

FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
MAX_FOLDER_BYTES = 30 * 10**6
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CODE_PROMPTS = (
    "import ",
    "def ",
    "class Foo:\n    def __init__(self",
    "for i in range(",
    '    """Return the',
)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def jax_model():
    model, _ = load_model(DEMO_MODEL_DIR, dtype=jnp.float32)
    return model


def greedy_continuation(hf_model, hf_tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The text transformers' greedy `generate` appends to `prompt`."""
    ids = hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return hf_tokenizer.decode(out[0, ids.shape[1] :])


def test_folder_has_hf_files_within_size_limit():
    sizes = {name: (DEMO_MODEL_DIR / name).stat().st_size for name in FILES}
    assert sum(sizes.values()) <= MAX_FOLDER_BYTES, sizes
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["model_type"] == "qwen3_moe"


def test_eos_token_agrees_across_files(hf_tokenizer, hf_model):
    eos = hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert hf_tokenizer.eos_token_id == eos
    assert hf_model.config.eos_token_id == eos
    assert hf_model.generation_config.eos_token_id == eos
    assert hf_model.generation_config.do_sample is False


def test_tokenizer_prepends_bos_and_round_trips_source_text(hf_tokenizer):
    # Byte-level BPE: any text, including non-ASCII, decodes back to itself; the model was
    # trained on BOS-led windows, so every encoding starts with BOS.
    text = (DEMO_MODEL_DIR.parent / "config.py").read_text() + "\nπ = 'ünïcode 🙂'\n"
    ids = hf_tokenizer(text)["input_ids"]
    assert ids[0] == hf_tokenizer.bos_token_id
    assert hf_tokenizer.decode(ids[1:]) == text
    assert len(ids) < len(text) / 2  # BPE merges learned: well under one token per 2 bytes


# Every prompt runs through the (eager) JAX model padded to this many tokens, so all of
# them share one shape: each new length compiled every op again (about 2.5 s a prompt).
# The padding comes after the prompt; attention is causal, so the prompt's logits are
# those of the prompt alone, and only they are compared.
PADDED_LEN = 16


@pytest.mark.parametrize("prompt", CODE_PROMPTS)
def test_jaxserve_logits_match_transformers(jax_model, hf_model, hf_tokenizer, prompt):
    ids = hf_tokenizer(prompt)["input_ids"]
    assert len(ids) <= PADDED_LEN
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0].numpy()
    tokens = jnp.asarray(ids + [0] * (PADDED_LEN - len(ids)), jnp.int32)
    hidden, _ = jax_model(tokens, jnp.arange(PADDED_LEN, dtype=jnp.int32), None, None)
    got = np.asarray(jax_model.compute_logits(hidden))[: len(ids)]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("prompt", ["import ", "\nimport ", "import os\nimport "])
def test_import_continues_with_stdlib_module(hf_model, hf_tokenizer, prompt):
    continuation = greedy_continuation(hf_model, hf_tokenizer, prompt, max_new_tokens=6)
    name = IDENTIFIER.match(continuation)
    assert name, f"{prompt!r} continued with {continuation!r}, not a module name"
    assert name.group() in sys.stdlib_module_names, f"{prompt!r} -> {continuation!r}"


@pytest.mark.parametrize("prompt", ["def ", "    def "])
def test_def_continues_with_identifier_and_paren(hf_model, hf_tokenizer, prompt):
    continuation = greedy_continuation(hf_model, hf_tokenizer, prompt, max_new_tokens=8)
    assert re.match(r"[A-Za-z_][A-Za-z0-9_]*\(", continuation), f"{prompt!r} -> {continuation!r}"


@pytest.mark.parametrize("port", ["abc", "0", "70000", "12a", "-5", "999999"])
def test_the_demo_script_says_a_port_that_is_not_one_is_not_a_port(port, tmp_path):
    """`JAXSERVE_PORT=abc bash scripts/demo.sh` said "port abc is in use": a bad setting,
    named as such, exit 2, before the venv is set up. (PATH holds only `dirname`: a script
    that went on to set up a venv would find no Python and stop at once.)"""
    import shutil
    import subprocess

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "dirname").symlink_to(shutil.which("dirname"))
    script = DEMO_MODEL_DIR.parents[1] / "scripts" / "demo.sh"
    env = {"PATH": str(tmp_path / "bin"), "HOME": str(tmp_path), "JAXSERVE_PORT": port,
           "JAXSERVE_VENV": str(tmp_path / "venv")}  # fmt: skip
    out = subprocess.run(
        [shutil.which("bash"), str(script)], capture_output=True, text=True, timeout=30, env=env
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"error: JAXSERVE_PORT={port} is not a port number (give one in 1-65535)\n"


def test_the_demo_scripts_default_prompt_completes_without_a_loop(hf_model, hf_tokenizer):
    """scripts/demo.sh streams the greedy completion of its default prompt: it must read
    as code, not a loop (the old default "import " gave "sys" and then "import sys" on
    every line). Greedy by transformers, which the logits test ties to jaxserve's."""
    script = (DEMO_MODEL_DIR.parents[1] / "scripts" / "demo.sh").read_text()
    prompt = re.search(r'prompt="\$\{1:-(.*?)\}"', script).group(1)
    max_tokens = int(re.search(r"--max-tokens (\d+)", script).group(1))
    text = prompt + greedy_continuation(hf_model, hf_tokenizer, prompt, max_tokens)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    assert len(lines) >= 3 and max(map(lines.count, lines)) <= 2, text
    words = IDENTIFIER.findall(text)
    assert max(map(words.count, words)) <= len(words) / 4, text
