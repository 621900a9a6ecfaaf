"""`jaxserve bench` names the flag of a bad --seed or --tokenizer in one line, exit code
2, before it asks the server anything (nothing listens at --server here: a run that got
that far would end with exit code 1, naming --server).

A trial found `--seed -1` ending with numpy's "expected non-negative integer" (no flag)
and `--tokenizer /missing` with "--dataset-path: model: no tokenizer.json in /missing".
"""

from __future__ import annotations

import pytest

from jaxserve.cli import build_parser


def _bench(capsys, *flags: str) -> tuple[int, list[str]]:
    args = build_parser().parse_args(
        ["bench", "--server", "127.0.0.1:1", "--num-prompts", "2", "--input-len", "4",
         "--output-len", "2", "--no-progress", *flags]
    )  # fmt: skip
    code = args.func(args)
    return code, capsys.readouterr().err.splitlines()


def test_a_negative_seed_names_the_flag(capsys):
    assert _bench(capsys, "--seed", "-1") == (
        2, ["jaxserve bench: error: --seed: must be >= 0, got -1"]
    )  # fmt: skip


def test_a_folder_without_a_tokenizer_names_the_tokenizer_flag(capsys, tmp_path):
    assert _bench(capsys, "--tokenizer", str(tmp_path)) == (
        2, [f"jaxserve bench: error: --tokenizer: no tokenizer.json in {tmp_path}"]
    )  # fmt: skip


def test_an_unreadable_tokenizer_names_the_tokenizer_flag(capsys, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    code, err = _bench(capsys, "--tokenizer", str(tmp_path))
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        f"jaxserve bench: error: --tokenizer: cannot load {tmp_path / 'tokenizer.json'}: "
    )


@pytest.mark.parametrize("seed", ["0", str(2**70)])
def test_a_good_seed_gets_as_far_as_the_server(capsys, seed):
    code, err = _bench(capsys, "--seed", seed)
    assert code == 1 and len(err) == 1 and "--server" in err[0], err
