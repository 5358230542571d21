"""megatrain reaches the Python children of a wrapped run (integrations/reach.py, integrations/boot/),
or says it did not; how ``python -m megatrain_hf.run`` and ``megatrain launch`` resolve their target.

A relaunching tool under ``python -m megatrain_hf.run`` trains with megatrain in its child (its
checkpoint holds megatrain's optimizer folder); a child that drops the environment trains plainly and
the wrapper warns; the boot chains an existing ``sitecustomize`` and enables megatrain when the Trainer
is imported; ``-m``, console scripts and a package's ``.py`` file resolve as their own commands would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatrain_hf.cli import main as cli_main
from megatrain_hf.integrations.reach import BOOT_DIR, child_env, report
from megatrain_hf.run import module_of, resolve
from tests.helpers import REPO_ROOT

TOOLS = REPO_ROOT / "tests" / "tools"


def _run(cmd, cwd, env_extra=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MEGATRAIN_ATTACH_DIR", None)
    env.update(env_extra or {})
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_a_relaunching_tool_trains_with_megatrain_in_its_child(tmp_path):
    proc = _run([sys.executable, "-m", "megatrain_hf.run", str(TOOLS / "relaunch.py"), "--out", "r.json",
                 "--output_dir", "o", "--max_steps", "2", "--save_steps", "2"], tmp_path)
    assert json.loads((tmp_path / "r.json").read_text())["engine"] is True
    assert (tmp_path / "o" / "checkpoint-2" / "megatrain_optimizer").is_dir()  # megatrain's optimizer files
    assert "no Trainer trained with megatrain" not in proc.stderr
    banner = [line for line in proc.stderr.splitlines() if "trains LlamaForCausalLM with megatrain" in line]
    assert len(banner) == 1, proc.stderr[-3000:]  # one line, through the child's default logging


@pytest.mark.slow
def test_a_child_out_of_reach_trains_plainly_and_the_wrapper_says_so(tmp_path):
    proc = _run([sys.executable, "-m", "megatrain_hf.run", str(TOOLS / "relaunch.py"), "--clear_env", "--out",
                 "r.json", "--output_dir", "o", "--max_steps", "1"], tmp_path)
    assert json.loads((tmp_path / "r.json").read_text())["engine"] is False
    assert "WARNING" in proc.stderr or "no Trainer trained with megatrain" in proc.stderr
    assert "no Trainer trained with megatrain anywhere" in proc.stderr, proc.stderr[-3000:]
    assert "did not inherit PYTHONPATH" in proc.stderr and "Fix: wrap the module that builds the Trainer" in proc.stderr


@pytest.mark.slow  # ~15 s: Python processes with the boot: in `make test`, not in `make test-fast`
def test_the_boot_chains_an_existing_sitecustomize_and_enables_on_trainer_import(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE_RAN'] = '1'\n")
    code = textwrap.dedent("""
        import os, sys
        print("chained", os.environ.get("OTHER_SITECUSTOMIZE_RAN"))
        print("megatrain imported at start-up", "megatrain_hf" in sys.modules, "torch" in sys.modules)
        import transformers.trainer
        from megatrain_hf.integrations.trainer import is_enabled
        from megatrain_hf.integrations.trainer.init_wrap import enabled_config
        print("enabled", is_enabled(), enabled_config().chunked_loss)
    """)
    env = child_env(json.dumps({"chunked_loss": False}), {"PATH": os.environ["PATH"],
                                                          "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{other}"})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == BOOT_DIR
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "chained 1" in proc.stdout
    assert "megatrain imported at start-up False False" in proc.stdout  # nothing heavy before the Trainer
    assert "enabled True False" in proc.stdout  # with the config of the environment


def test_without_a_config_the_boot_does_nothing(tmp_path):
    env = child_env("{}", {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO_ROOT)})
    env.pop("MEGATRAIN_CONFIG")
    code = "import sys; print(any(type(f).__name__ == '_Finder' for f in sys.meta_path))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


def test_report_names_the_tools_module_to_wrap(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        assert report(str(tmp_path), ["axolotl", "train", "cfg.yml"]) is False
    assert "python -m megatrain_hf.run -m axolotl.cli.train CONFIG.yml" in caplog.text
    (tmp_path / "attached-1-1.json").write_text(json.dumps({"kind": "attached", "pid": 1, "argv": []}))
    caplog.clear()
    assert report(str(tmp_path), ["axolotl", "train", "cfg.yml"]) is True and not caplog.text


# ------------------------------------------------------------------------------ the target
def test_a_module_a_console_script_and_a_package_file_resolve_as_their_commands(tmp_path):
    import importlib

    main_file = importlib.import_module("trl.cli.main").__file__
    assert resolve(["-m", "trl.cli.main", "sft"]) == ("module", "trl.cli.main", ["sft"])
    assert resolve(["trl", "sft", "--x"]) == ("entry", "trl", ["sft", "--x"])  # an installed console script
    # a package's file runs as its module, so that its relative imports work (llamafactory/cli.py)
    assert module_of(main_file) == "trl.cli.main"
    assert resolve([main_file, "sft"]) == ("module", "trl.cli.main", ["sft"])
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert resolve([str(script), "--a"]) == ("script", str(script), ["--a"])  # a file outside any package
    with pytest.raises(ValueError, match="no such script, module or console script: 'nope'"):
        resolve(["nope"])


def test_launch_takes_a_module_and_a_console_script(capsys):
    config = str(REPO_ROOT / "configs" / "megatrain_cpu.yaml")
    assert cli_main(["launch", "--config_file", config, "--dry_run", "-m", "trl.scripts.sft", "--x", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("-m megatrain_hf.run -m trl.scripts.sft --x 1")
    assert cli_main(["launch", "--config_file", config, "--dry_run", "trl", "sft"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("-m megatrain_hf.run trl sft")
    assert cli_main(["launch", "--config_file", config, "--dry_run", "trl.scripts.sft"]) == 2
    assert "(a module? put -m before it)" in capsys.readouterr().err
    assert cli_main(["launch", "--config_file", config, "--dry_run", "-m", "no_such_module_here"]) == 2
    assert "module 'no_such_module_here' cannot be imported here" in capsys.readouterr().err


@pytest.mark.slow
def test_launch_runs_a_module(tmp_path):
    cmd = [sys.executable, "-m", "megatrain_hf.cli", "launch", "--config_file",
           str(REPO_ROOT / "configs" / "megatrain_cpu.yaml"), "-m", "tests.tools.train_tiny", "--out", "m.json",
           "--output_dir", "o", "--max_steps", "1"]
    proc = _run(cmd, tmp_path)
    assert json.loads((tmp_path / "m.json").read_text())["engine"] is True
    assert "no Trainer trained with megatrain" not in proc.stderr
