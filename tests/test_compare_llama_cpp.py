"""scripts/compare_llama_cpp.py's helpers that need no llama-cpp-python: the prefill
chunking and the converter call (against a stand-in converter)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from compare_llama_cpp import make_gguf, prefill_chunks  # noqa: E402

from jaxserve.config import DEMO_MODEL_DIR  # noqa: E402


def test_prefill_chunks_take_whole_prompts_within_n_batch():
    assert prefill_chunks(128, 32, 2048) == [range(0, 64), range(64, 128)]
    assert prefill_chunks(5, 30, 64) == [range(0, 2), range(2, 4), range(4, 5)]
    assert prefill_chunks(1, 32, 2048) == [range(0, 1)]
    with pytest.raises(ValueError, match="1 to 16"):
        prefill_chunks(2, 17, 16)


# A stand-in for llama.cpp's convert_hf_to_gguf.py and its `conversion` package: it records
# what it was given and what the pre-tokenizer check answers.
FAKE_CONVERTER = """
import json, sys
from pathlib import Path
from conversion.base import TextModel
args = sys.argv[1:]
out = Path(args[args.index("--outfile") + 1])
out.write_text(json.dumps({"argv": args, "pre": TextModel().get_vocab_base_pre(None),
                           "files": sorted(p.name for p in Path(args[0]).iterdir())}))
"""
FAKE_BASE = """
class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError("BPE pre-tokenizer was not recognized")
"""


def test_make_gguf_stages_the_tokenizer_and_answers_the_pre_tokenizer(tmp_path):
    converter = tmp_path / "llama.cpp" / "convert_hf_to_gguf.py"
    (converter.parent / "conversion").mkdir(parents=True)
    converter.write_text(FAKE_CONVERTER)
    (converter.parent / "conversion" / "__init__.py").write_text("")
    (converter.parent / "conversion" / "base.py").write_text(FAKE_BASE)
    ckpt = tmp_path / "ckpt"  # a checkpoint without a tokenizer, like the random Qwen3-MoE
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"")
    out = make_gguf(str(converter), ckpt, Path(DEMO_MODEL_DIR), tmp_path / "m-f32.gguf")
    got = json.loads(out.read_text())
    assert got["pre"] == "default"
    assert got["argv"][1:] == ["--outtype", "f32", "--outfile", str(out)]
    assert got["files"] == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    assert not (tmp_path / "m-f32.hf").exists()  # the staging folder is gone


def test_an_importable_llama_cpp_without_converter_skips_the_column(monkeypatch):
    """compare_hf.py found llama_cpp importable, took this interpreter as --llama-python
    and then stopped with a usage error for the missing --llama-converter: now it skips
    the column with the reason; an explicit --llama-python still needs the converter."""
    import importlib.util

    import compare_hf

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "llama_cpp" else real(name, *a),
    )
    python, skipped = compare_hf.llama_python(None, None)
    assert python is None and "no --llama-converter" in skipped
    assert compare_hf.llama_python(None, "convert_hf_to_gguf.py") == (sys.executable, None)
    with pytest.raises(ValueError, match="--llama-python needs --llama-converter"):
        compare_hf.llama_python("/venv/bin/python", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert compare_hf.llama_python(None, None) == (None, None)


def test_compare_hf_rows_print_each_sides_spread_of_runs(capsys):
    """A row shows how far apart each side's repetitions were ((max - min) / median), so
    that a ratio inside the noise reads as such."""
    import compare_hf

    row = dict(
        model="demo", batch=8, jaxserve_tok_s=100.0, hf_tok_s=50.0, ratio=2.0, agreement=1.0,
        jaxserve_mfu=0.1, hf_mfu=0.05, ceiling_gflop_s=100.0, load_avg=1.0,
        jaxserve_runs=[90.0, 100.0, 130.0], hf_runs=[50.0, 50.0, 50.0],
        llama_tok_s=80.0, jaxserve_vs_llama=1.25, llama_agreement=1.0, llama_mfu=0.08,
        llama_runs=[80.0, 60.0, 84.0],
    )  # fmt: skip
    compare_hf.print_row(row)
    cells = capsys.readouterr().out.split()
    assert cells[3] == "40%"  # jaxserve: (130 - 90) / 100
    assert cells[cells.index("80.0") + 1] == "30%"  # llama.cpp: (84 - 60) / 80
