"""`jaxserve diagnose --seconds S` under the default scrape interval (0.5 s) samples
every S seconds instead of refusing --interval, a flag the user did not give ("--interval:
must be in (0, --seconds], got 0.5"); an --interval the user gave past --seconds is
still refused naming it, and so is one below 0.05 s (each scrape reads and parses the
whole /metrics page: 1e-9 would scrape it nonstop). Nothing listens at the --server
here: a run that gets past its flags ends with exit code 1, saying it cannot read the
metrics."""

from __future__ import annotations

from jaxserve.cli import build_parser


def _diagnose(capsys, *flags: str) -> tuple[int, list[str]]:
    args = build_parser().parse_args(["diagnose", "--server", "127.0.0.1:1", *flags])
    code = args.func(args)
    return code, capsys.readouterr().err.splitlines()


def test_a_short_window_without_interval_is_sampled(capsys):
    code, err = _diagnose(capsys, "--seconds", "0.1")
    assert code == 1 and len(err) == 1
    assert err[0].startswith("jaxserve diagnose: error: cannot read http://127.0.0.1:1/metrics")


def test_an_interval_given_past_the_window_is_refused(capsys):
    assert _diagnose(capsys, "--seconds", "0.1", "--interval", "0.5") == (
        2, ["jaxserve diagnose: error: --interval: must be in [0.05, --seconds], got 0.5"]
    )  # fmt: skip


def test_an_interval_below_the_minimum_is_refused(capsys):
    assert _diagnose(capsys, "--seconds", "3600", "--interval", "1e-9") == (
        2, ["jaxserve diagnose: error: --interval: must be in [0.05, --seconds], got 1e-09"]
    )  # fmt: skip


def test_a_window_under_the_minimum_interval_without_interval_is_sampled(capsys):
    code, err = _diagnose(capsys, "--seconds", "0.01")
    assert code == 1 and len(err) == 1
    assert err[0].startswith("jaxserve diagnose: error: cannot read http://127.0.0.1:1/metrics")
