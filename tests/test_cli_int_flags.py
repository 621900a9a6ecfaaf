"""The two wordings of an int flag's usage error, pinned: serve's flags
("not an integer", "must be in [low, high]" / "must be >= low") and generate's request
fields ("invalid int value", "must be within [low, high]"); both come from one parser
(`flag_types._bounded_int`)."""

from __future__ import annotations

import pytest

from jaxserve.cli import build_parser


@pytest.mark.parametrize(
    ("argv", "error"),
    [(["serve", "--port", "x"], "argument --port: not an integer: 'x'"),
     (["serve", "--port", "65536"], "argument --port: must be in [0, 65535], got 65536"),
     (["serve", "--port", "-1"], "argument --port: must be in [0, 65535], got -1"),
     (["serve", "--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
     (["serve", "--max-num-seqs", "1.5"], "argument --max-num-seqs: not an integer: '1.5'"),
     # serve --seed -1 used to start the engine and fail there, naming no flag
     (["serve", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
     (["generate", "hi", "--top-k", "y"], "argument --top-k: invalid int value: 'y'"),
     (["generate", "hi", "--top-k", "2147483648"],
      "argument --top-k: must be within [-2147483648, 2147483647], got 2147483648")],
)  # fmt: skip
def test_an_int_flag_out_of_range_or_not_an_int_says_so_in_its_wording(argv, error, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [(["serve", "--port", "0"], "port", 0),
     (["serve", "--port", "65535"], "port", 65535),
     (["serve", "--seed", "0"], "seed", 0),
     (["generate", "hi", "--top-k", "-2147483648"], "top_k", -2147483648)],
)  # fmt: skip
def test_an_int_flag_at_its_bounds_is_taken(argv, field, value):
    assert getattr(build_parser().parse_args(argv), field) == value
