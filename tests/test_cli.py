"""``python -m flashlab``: one table of entry points, each row a module with a main, all named by --help.

The benchmark commands must answer --help and print recorded tables on a machine without a GPU.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from flashlab import bench, cli, records


@pytest.mark.parametrize("name", cli.COMMANDS)
def test_every_row_is_a_module_with_a_main(name):
    module_name, text = cli.COMMANDS[name]
    module = importlib.import_module(module_name)
    assert callable(module.main) and text
    if "." in name:  # run on its own: `python -m NAME`
        assert module_name == name


@pytest.mark.parametrize("name", bench.KINDS)
def test_every_benchmark_kind_is_a_module_with_a_main_and_a_parser(name):
    module = importlib.import_module(bench.KINDS[name][0])
    assert callable(module.main) and callable(module.parser)


def test_help_names_every_entry_point():
    res = subprocess.run([sys.executable, "-m", "flashlab", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for name in cli.COMMANDS:
        assert f"  {name} " in res.stdout or f"  {name}\n" in res.stdout, name
    assert "python -m MODULE" in res.stdout  # the dotted rows say how they are run


def test_bench_help_names_every_kind(capsys):
    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    for kind in bench.KINDS:
        assert f"  {kind} " in out, kind


@pytest.mark.parametrize("kind", bench.KINDS)
def test_each_kind_answers_help_without_a_gpu(kind, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", kind, "--help"])
    assert exit_.value.code == 0
    assert f"python -m flashlab bench {kind}" in capsys.readouterr().out


def test_selfcheck_answers_help_and_refuses_rungs_without_forward(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["selfcheck", "--help"])
    assert exit_.value.code == 0 and "backward-decode" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["selfcheck", "backward-decode", "lean"])
    assert exit_.value.code == 2


def test_unknown_command_or_kind_is_refused(capsys):
    assert cli.main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
    assert cli.main(["bench", "bench8"]) == 2 and "unknown kind 'bench8'" in capsys.readouterr().err
    assert cli.main(["flashlab.numba_cuda"]) == 2  # a module run on its own is no command
    assert cli.main([]) == 2


@pytest.mark.parametrize("kind, name", [("forward", "benchmarks/ladder"), ("backward", "ch8/bwd"),
                                        ("decode", "ch8/decode"), ("memory", "ch8/memory"), ("train", "ch8/train")])
def test_table_prints_a_recorded_file_without_a_gpu(kind, name, capsys):
    assert cli.main(["bench", kind, "--table", str(records.record_path(name))]) == 0
    out = capsys.readouterr().out
    prov = records.read_record(name)["provenance"]
    assert out.startswith(f"{prov['gpu']}, {prov['date_utc']}, `{prov['command']}`")
    assert all(r["impl"] in out for r in records.read_record(name)["rows"])
