"""`jaxserve profile`'s manifest names the files of its own capture only, and an empty
--out is refused (no server, no JAX: the capture runs with its host timeline alone).

A user who profiled twice into one folder was told of both captures' XLA traces, and
the TensorBoard line pointed at the older one; an --out of a folder holding other files
listed them all (the manifest walked the whole folder). `--out ''` captured into the
current folder.
"""

from __future__ import annotations

import json

import pytest

from jaxserve.observability import profile_rpc
from jaxserve.observability.profile import ProfileSession


def test_manifest_lists_this_captures_files_only(tmp_path):
    out = tmp_path / "prof"
    old_run = out / "plugins" / "profile" / "2026_01_01_00_00_00"
    old_run.mkdir(parents=True)
    (old_run / "vm.trace.json.gz").write_bytes(b"old")
    (old_run / "vm.xplane.pb").write_bytes(b"old")
    (out / "notes").mkdir()
    (out / "notes" / "unrelated.txt").write_text("not a trace")

    session = ProfileSession(str(out), 0.01, jax_trace=False)
    # What jax.profiler.stop_trace would write: a run folder of its own.
    new_run = out / "plugins" / "profile" / "2026_01_01_00_00_05"
    new_run.mkdir()
    (new_run / "vm.trace.json.gz").write_bytes(b"new")
    (new_run / "vm.xplane.pb").write_bytes(b"new")
    manifest = session.finish()

    assert manifest == json.loads((out / "profile.json").read_text())
    assert manifest["trace_json"] == [str(new_run / "vm.trace.json.gz")]
    assert manifest["xplane"] == [str(new_run / "vm.xplane.pb")]
    assert sorted(manifest["files"]) == sorted(
        [str(out / "host_timeline.json"), str(new_run / "vm.trace.json.gz"),
         str(new_run / "vm.xplane.pb")]
    )  # fmt: skip
    described = profile_rpc.describe(manifest)
    assert str(old_run) not in described and str(new_run) in described


def test_manifest_lists_a_trace_rewritten_in_place(tmp_path):
    """Two captures within one second share jax's run folder name: the second rewrites
    the first's files, which are then its own."""
    run = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    run.mkdir(parents=True)
    trace = run / "vm.trace.json.gz"
    trace.write_bytes(b"first")
    old = trace.stat().st_mtime_ns
    session = ProfileSession(str(tmp_path), 0.01, jax_trace=False)
    trace.write_bytes(b"second")
    if trace.stat().st_mtime_ns == old:  # a coarse file clock: make the rewrite visible
        import os

        os.utime(trace, ns=(old + 1_000_000, old + 1_000_000))
    assert session.finish()["trace_json"] == [str(trace)]


@pytest.mark.parametrize("out", ["", "   "])
def test_an_empty_out_is_refused_not_the_current_folder(out, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="^out_dir: "):
        profile_rpc.request_profile("127.0.0.1:1", 1.0, out)
    assert list(tmp_path.iterdir()) == []  # nothing captured here


def test_the_tensorboard_command_can_be_pasted_for_a_folder_with_a_space(tmp_path):
    import shlex

    out = tmp_path / "my profiles"
    manifest = ProfileSession(str(out), 0.01, jax_trace=False).finish()
    manifest["xplane"] = [str(out / "plugins" / "profile" / "run" / "vm.xplane.pb")]
    line = next(x for x in profile_rpc.describe(manifest).splitlines() if "--logdir" in x)
    command = line.split("-> ", 1)[1].split(" (Profile tab)")[0]
    assert shlex.split(command) == ["tensorboard", "--logdir", str(out.resolve())]


def test_every_replicas_timeline_is_printed(tmp_path):
    """With replicas the combined manifest's host_timeline is replica 0's; the printed
    lines named only it, not replica 1's timeline."""
    each = {
        str(k): ProfileSession(str(tmp_path / f"replica-{k}"), 0.01, jax_trace=False).finish()
        for k in range(2)
    }
    manifest = {**each["0"], "out_dir": str(tmp_path), "replicas": {**each, "2": None}}
    described = profile_rpc.describe(manifest)
    for k in range(2):
        timeline = str((tmp_path / f"replica-{k}" / "host_timeline.json").resolve())
        assert f"engine loop timeline (replica {k}): {timeline}  -> " in described
    assert "replica 2" not in described  # no manifest: the error line says so
