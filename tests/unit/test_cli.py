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
