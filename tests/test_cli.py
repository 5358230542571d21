"""The `megatrain` command line: help and version. In process where the exit code is main()'s return
value; one subprocess for the real console behaviour."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import megatrain_hf
from megatrain_hf.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ help, version
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_printed_to_stdout_with_exit_0(flag, capsys):
    assert main([flag]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: megatrain") and err == ""
    for command in COMMANDS:
        assert f"  {command}" in out
    assert "--version" in out


def test_no_arguments_prints_usage_to_stderr_with_exit_2(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: megatrain")


def test_version(capsys):
    assert main(["--version"]) == 0
    line = capsys.readouterr().out
    assert line.startswith(f"megatrain_hf {megatrain_hf.__version__} (")
    assert f"torch {torch.__version__}" in line and f"transformers {transformers.__version__}" in line
    assert line.count("\n") == 1


def test_unknown_command_exits_2_and_suggests(capsys):
    assert main(["estimat", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'estimat'" in err and "did you mean 'estimate'" in err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_subcommand_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: megatrain {command}")


def test_console_help_and_version_in_a_process():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "import sys; from megatrain_hf.cli import main; sys.exit(main())"
    run = [sys.executable, "-c", code]
    helped = subprocess.run(run + ["--help"], capture_output=True, text=True, env=env, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: megatrain") and helped.stderr == ""
    launch_help = subprocess.run(run + ["launch", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert launch_help.returncode == 0 and "--config_file" in launch_help.stdout
    bare = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: megatrain")
