"""The `megatrain` command line: help and version, `estimate`'s units and refusals, `launch`'s checks of
the user's YAML, and every shipped config in configs/ through the launcher (--dry_run). In process
where the exit code is main()'s return value; one subprocess for the real console behaviour."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

import megatrain_hf
from megatrain_hf.cli import COMMANDS, main
from megatrain_hf.cli.launch import load_launch_config
from megatrain_hf.config import ENV_VAR
from megatrain_hf.integrations.reach import BOOT_DIR
from megatrain_hf.memory.shapes import format_count
from megatrain_hf.errors import MegatrainConfigError, UnsupportedModelError
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
SCRIPT = ROOT / "tests" / "tools" / "train_tiny.py"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


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


@pytest.mark.slow  # ~10 s: the console script in processes: in `make test`, not in `make test-fast`
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


# ------------------------------------------------------------------------------ estimate
@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0"), (789, "789"), (1_000, "1.00 K"), (90_432, "90.4 K"), (789_000, "789 K"), (999_499, "999 K"),
        (999_500, "1.00 M"), (45_600_000, "45.6 M"), (1_230_000_000, "1.23 B"), (6_738_415_616, "6.74 B"),
        (68_976_648_192, "69.0 B"), (123_400_000_000, "123 B"), (2 * 10**12, "2.00 T"),
    ],
)
def test_format_count(n, text):
    assert format_count(n) == text


def test_estimate_prints_small_models_in_a_unit_that_suits_them(capsys):
    assert main(["estimate", "--model", "tiny", "--host-gib", "8"]) == 0
    out = capsys.readouterr().out
    params = megatrain_hf.memory.PRESETS["tiny"].params()
    assert out.startswith(f"memory plan: tiny  ({format_count(params)} params, {format_count(params)} trainable)")
    assert f"{params / 1e3:.1f} K params" in out
    assert "0.00 B" not in out
    assert " M params (" in out  # the deepest / widest tiny-width models that fit 8 GiB: hundreds of millions


def test_estimate_keeps_the_rest_of_the_table(capsys):
    from megatrain_hf.memory import plan_memory

    assert main(["estimate", "--model", "llama-7b", "--host-gib", "125"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory plan: llama-7b  (6.74 B params, 6.74 B trainable), compute bf16\n")
    table = plan_memory(megatrain_hf.memory.PRESETS["llama-7b"], seq_len=4096, micro_batch=1, grad_accum=1).table()
    assert table.split("\n", 1)[1] in out
    assert "deepest: 35 layers = 7.35 B params" in out


def _engine_refusal(model) -> str:
    from megatrain_hf import attach

    with pytest.raises(UnsupportedModelError) as info:
        attach(model, device="cpu")
    return str(info.value)


def test_estimate_refuses_a_family_the_engine_refuses_with_its_message(tmp_path, capsys):
    model = transformers.OPTForCausalLM(transformers.OPTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                                ffn_dim=64, vocab_size=64, word_embed_proj_dim=32))
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(tmp_path)
    assert main(["estimate", "--config", str(tmp_path / "config.json")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"megatrain estimate: error: {_engine_refusal(model)}\n"


def test_estimate_refuses_bert_although_its_config_has_llama_like_sizes(tmp_path, capsys):
    transformers.BertConfig(architectures=["BertForMaskedLM"]).save_pretrained(tmp_path)
    assert main(["estimate", "--config", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "fits" not in out
    assert "model type 'bert' (BertForMaskedLM) is not supported by megatrain" in err
    assert "'llama'" in err and "register_family" in err


@pytest.mark.slow  # ~5-10 s: in `make test`, not in `make test-fast`
def test_estimate_accepts_every_supported_family(tmp_path, capsys):
    from tests.helpers import FAMILY_CONFIGS, tiny_model

    for family in FAMILY_CONFIGS:
        tiny_model(family).config.save_pretrained(tmp_path / family)
        assert main(["estimate", "--model", str(tmp_path / family), "--seq-len", "16", "--json"]) == 0, family
        assert json.loads(capsys.readouterr().out)["plan"]["total_params"] > 0


# ------------------------------------------------------------------------------ launch: the user's YAML
def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "user.yaml"
    path.write_text(text)
    return path


LOCAL = 'compute_environment: LOCAL_MACHINE\ndistributed_type: "NO"\nuse_cpu: true\n'


def test_unknown_accelerate_key_is_reported_against_the_users_file(tmp_path, capsys):
    path = _write(tmp_path, LOCAL + "mixed_precison: bf16\ncompute_dtype: bf16\n")
    assert main(["launch", "--config_file", str(path), str(SCRIPT)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "megatrain_launch_" not in err
    assert "['compute_dtype', 'mixed_precison']" in err
    assert "did you mean 'mixed_precision'" in err
    assert "'compute_dtype' is a megatrain option: move it under the `megatrain:` section" in err
    assert "Allowed top-level keys: [" in err and "'num_processes'" in err


def test_allowed_accelerate_keys_are_accelerates_own(tmp_path):
    import dataclasses

    from accelerate.commands.config.config_args import ClusterConfig

    with pytest.raises(MegatrainConfigError) as info:
        load_launch_config(str(_write(tmp_path, LOCAL + "bogus: 1\n")))
    for field in dataclasses.fields(ClusterConfig):
        assert repr(field.name) in str(info.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("distributed_type: NO\n", 'unquoted NO/no as the boolean false. Fix: quote it, distributed_type: "NO"'),
        ('distributed_type: "NO"\nmixed_precision: no\n', 'Fix: quote it, mixed_precision: "no"'),
        ('distributed_type: "NO"\nmixed_precision: bf17\n', "mixed_precision='bf17' is not one of"),
        ("distributed_type: MULTI\n", "distributed_type='MULTI' is not one of"),
        ("use_cpu: true\n", 'has no distributed_type, which accelerate'),
        ("compute_environment: LOCAL\ndistributed_type: \"NO\"\n", "compute_environment='LOCAL' is not one of"),
        ("megatrain:\n  compute_dtyp: bf16\n", "the `megatrain:` section of"),
    ],
)
def test_bad_launch_yaml_names_the_file_and_the_fix(tmp_path, capsys, text, message):
    path = _write(tmp_path, text)
    assert main(["launch", "--config_file", str(path), "--dry_run", str(SCRIPT)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatrain launch: error: ") and str(path) in err
    assert message in err


def test_launch_refuses_a_missing_script(tmp_path, capsys):
    assert main(["launch", "--config_file", str(ROOT / "configs" / "megatrain_cpu.yaml"), "nope.py"]) == 2
    assert "training script 'nope.py' does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the shipped configs
def test_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"megatrain_cpu.yaml", "megatrain_single_gpu.yaml", "accelerate_single_gpu.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_through_the_launcher(path, capsys):
    keys, config = load_launch_config(str(path))
    assert keys["compute_environment"] == "LOCAL_MACHINE"
    assert main(["launch", "--config_file", str(path), "--dry_run", str(SCRIPT), "--out", "a b.json"]) == 0
    out = capsys.readouterr().out.splitlines()
    comments = [line[4:] for line in out if line.startswith("#   ")]
    assert yaml.safe_load("\n".join(comments)) == keys  # the accelerate part, as it will be written
    command = shlex.split(out[-1])
    assert command[0] == f"PYTHONPATH={BOOT_DIR}" + "".join(os.pathsep + p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p and p != BOOT_DIR)  # megatrain's boot first (integrations/reach.py)
    assert command[1] == f"{ENV_VAR}={json.dumps(config.to_dict())}"
    assert command[2:6] == [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    assert command[7:] == ["-m", "megatrain_hf.run", str(SCRIPT), "--out", "a b.json"]


def test_cpu_config_is_cpu_only():
    keys, config = load_launch_config(str(ROOT / "configs" / "megatrain_cpu.yaml"))
    assert keys["use_cpu"] is True and keys["mixed_precision"] == "no" and keys["distributed_type"] == "NO"
    assert config.device == "cpu" and config.compute_dtype == "fp32"


# ------------------------------------------------------------------------------ packaging: ranges, make, CI
TESTED = ("torch", "transformers", "accelerate", "peft", "trl")


def _declared() -> dict:
    """{name: SpecifierSet} of the tested dependencies, from the dependencies and every extra (one range each)."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lists = [project["dependencies"], *project["optional-dependencies"].values()]
    declared: dict = {}
    for requirement in (Requirement(r) for requirements in lists for r in requirements):
        if requirement.name in TESTED:
            previous = declared.setdefault(requirement.name, requirement.specifier)
            assert previous == requirement.specifier, f"{requirement.name}: {previous} and {requirement.specifier}"
    return declared


def test_tested_dependencies_have_both_bounds_and_hold_what_is_installed():
    from importlib import metadata

    from packaging.version import Version

    declared = _declared()
    assert sorted(declared) == sorted(TESTED)
    for name, specifier in declared.items():
        operators = {s.operator for s in specifier}
        assert {">=", "<"} <= operators, f"{name}{specifier}: declare the tested range, lower and upper bound"
        installed = Version(metadata.version(name)).public  # 2.13.0+cpu -> 2.13.0
        assert specifier.contains(installed), f"{name} {installed} is installed but pyproject.toml says {specifier}"


def _make(*targets: str) -> str:
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    proc = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_test_shows_skip_reasons_and_test_fast_skips_slow_tests():
    assert '-m pytest -m "not gpu" -q -rs' in _make("test")
    assert '-m pytest -m "not gpu and not slow" --fast -q -rs' in _make("test-fast")
    assert "bash .ci/lower_bounds.sh" in _make("lower-bounds")
    assert "bash .ci/integrations.sh" in _make("test-integrations")  # the tools' own commands (docs/integrations.md)


def test_ci_runs_the_tests_then_the_lower_bounds_then_the_docs():
    steps = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    steps = [s for s in steps if s.startswith("make ")]
    assert steps == ["make test", "make lower-bounds", "make docs"]
