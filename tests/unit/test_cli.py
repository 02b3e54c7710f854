"""The command assembles every subcommand module and never hides one that fails to import."""
from __future__ import annotations

import pytest

from nicoffload.cli import app as cli


def test_every_subcommand_module_registers():
    p = cli.build_parser()
    sub = next(a for a in p._actions if a.dest == "command")
    assert {"agg", "testbed", "worker", "allreduce", "demo", "bench", "train-demo",
            "aggregator-userspace"} <= set(sub.choices)


def test_a_module_that_fails_to_import_fails_loudly(monkeypatch):
    monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", [*cli.SUBCOMMAND_MODULES, "nicoffload.cli.no_such_module"])
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        cli.build_parser()


def test_the_command_says_the_installation_is_broken(monkeypatch, capsys):
    monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", [*cli.SUBCOMMAND_MODULES, "nicoffload.cli.no_such_module"])
    assert cli.main(["demo", "--help"]) == 78
    err = capsys.readouterr().err
    assert "installation is broken" in err and "no_such_module" in err


def test_names_that_would_leave_the_bpf_filesystem_are_refused():
    """``--iface ..`` or ``--netns ../x`` must never name a directory above the pins."""
    from nicoffload.agg.control import pin_dir, state_file
    from nicoffload.errors import InputError

    for netns, iface in ((None, ".."), (None, "."), (None, "a/b"), ("..", "eth0"), ("x/..", "eth0"), (None, ""),
                         (None, "sixteen-chars-xx"), (None, "eth 0")):
        for f in (pin_dir, state_file):
            with pytest.raises(InputError):
                f(netns, iface)
    assert pin_dir("nco-a-agg", "eth0").name == "eth0"


def test_inputs_in_any_order_or_byte_order_and_outputs_that_cannot_be_written(tmp_path):
    import numpy as np

    from nicoffload.errors import InputError
    from nicoffload.lab.inputs import check_output, load_input, save_output

    np.save(tmp_path / "f.npy", np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)))
    np.save(tmp_path / "b.npy", np.arange(5, dtype=np.int32).astype(">i4"))
    f, b = load_input(tmp_path / "f.npy"), load_input(tmp_path / "b.npy")
    assert f.flags.c_contiguous and np.array_equal(f, np.arange(12).reshape(3, 4))
    assert b.dtype == np.int32 and list(b) == [0, 1, 2, 3, 4]
    for bad in (tmp_path / "no" / "dir.npy", tmp_path):
        with pytest.raises(InputError):
            check_output(bad)
    with pytest.raises(InputError, match="could not be written"):
        save_output(tmp_path / "no" / "dir.npy", f)
    check_output(tmp_path / "ok.npy")


def test_what_is_recorded_is_read_from_the_state_files(tmp_path):
    """A namespace whose name holds "__" (testbed a__b) is found under its own name; a load
    killed while it wrote its state (only the .tmp, cut short) by the file's name."""
    import json

    from nicoffload.ebpf import loadstate

    loadstate.save(loadstate.state_file(tmp_path, "nco-a__b-agg", "eth0"), {"netns": "nco-a__b-agg", "iface": "eth0"})
    loadstate.save(loadstate.state_file(tmp_path, None, "veth1"), {"netns": None, "iface": "veth1"})
    (tmp_path / "nco-c-agg__eth0.tmp").write_text('{"netns": "nco-c')
    assert loadstate.recorded(tmp_path) == [(None, "veth1"), ("nco-a__b-agg", "eth0"), ("nco-c-agg", "eth0")]
    assert loadstate.recorded(tmp_path, "nco-a__b") == [("nco-a__b-agg", "eth0")]
    assert json.loads((tmp_path / "root__veth1.json").read_text())["iface"] == "veth1"


def test_strays_of_gone_namespaces_are_removed_and_a_live_ones_files_kept(tmp_path):
    """``testbed clean`` removes what aggregators of namespaces now gone left in their state
    directory (a lock of an AF_XDP engine, a hidden temporary file), never a live namespace's
    (whose name may hold ``__``), nor another prefix's."""
    from nicoffload.ebpf import loadstate

    names = ["nco-a__b-agg__eth0.json", "nco-a__b-agg__eth0.afxdp.lock", "nco-a-agg__eth0.afxdp.lock",
             ".nco-c-agg__eth0.afxdp.json.tmp", "nco-c-agg__eth0.afxdp.log", "other-agg__eth0.lock"]
    for n in names:
        (tmp_path / n).write_text("")
    removed = loadstate.remove_strays(tmp_path, "nco-", live=["nco-a__b-agg", "nco-z"])
    assert sorted(removed) == sorted(str(tmp_path / n) for n in names[2:5])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[:2] + names[5:])
    assert loadstate.remove_strays(tmp_path, "", live=[]) == []  # no prefix: nothing goes
