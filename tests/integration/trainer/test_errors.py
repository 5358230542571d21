"""Bad input: each case raises the documented error type with advice on what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import RandomTokens, tiny_model, training_args
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, attach
from megatrain_hf.errors import (HostMemoryError, IncompatibleOptionsError, MegatrainConfigError, PinnedMemoryError,
                                  TrainingDataError, UnsupportedModelError, UsageError)
from transformers import Trainer, TrainerCallback
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


def test_unsupported_architecture():
    from transformers import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(OPTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, ffn_dim=64,
                                     vocab_size=64, word_embed_proj_dim=32))
    with pytest.raises(UnsupportedModelError, match=r"'opt'.*not supported.*supported: \[.*'llama'.*register_family"):
        attach(model, device="cpu")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"fp16": True}, r"Use bf16 \(TrainingArguments\(bf16=True\)"),
        ({"bf16_full_eval": True}, "Unset it"),
        # torch_compile compiles the streamed layers (tests/parity/test_compile.py); refused with dropout (this
        # model's attention_dropout=0.1) and with a mode that captures CUDA graphs
        ({"torch_compile": True}, r"compile=True.*with dropout in the model.*Fix: set the model's dropout"),
        ({"torch_compile": True, "torch_compile_mode": "reduce-overhead"}, r"captures CUDA graphs.*Fix"),
    ],
)
def test_refused_training_arguments(tmp_path, overrides, message):
    from transformers import Trainer

    try:
        args = training_args(tmp_path, **overrides)
    except ValueError as exc:  # some combinations are refused by TrainingArguments itself on CPU
        pytest.skip(f"TrainingArguments refuses {overrides} here already: {exc}")
    model = tiny_model("llama")
    with pytest.raises(IncompatibleOptionsError, match=message):
        Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[MegaTrainPlugin()])
    assert "forward" not in vars(model.model.layers[0])  # nothing attached, model untouched


@pytest.mark.parametrize("field, value, message", [("deepspeed", {"zero_optimization": {"stage": 3}}, "DeepSpeed"), ("fsdp", "full_shard", "FSDP")])
def test_refused_with_deepspeed_or_fsdp(tmp_path, field, value, message):
    args = training_args(tmp_path)
    object.__setattr__(args, field, value)
    with pytest.raises(IncompatibleOptionsError, match=f"{message}.*use one"):
        MegaTrainPlugin().check_args(args)


def test_non_fp32_model_refused():
    model = tiny_model("llama").to(torch.bfloat16)
    with pytest.raises(UnsupportedModelError, match="dtype=torch.float32"):
        attach(model, device="cpu")


def test_model_not_on_cpu_refused():
    model = tiny_model("llama").to("meta")
    with pytest.raises(UnsupportedModelError, match="needs the model on the CPU"):
        attach(model, device="cpu")


def test_attach_twice_refused():
    model = tiny_model("llama")
    engine = attach(model, device="cpu")
    with pytest.raises(UsageError, match="detach"):
        attach(model, device="cpu")
    engine.detach()


def test_cuda_without_cuda_refused():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(IncompatibleOptionsError, match="CUDA is not available"):
        attach(tiny_model("llama"), device="cuda")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compute_dtype": "fp16"}, "fp16 is not supported"),
        ({"device": "gpu0"}, "not a torch device"),
        ({"pin_memory": "yes"}, "allowed: True, False or 'auto'"),
        ({"device_update": "yes"}, r"device_update='yes'; allowed: True or False"),
    ],
)
def test_bad_config_values(kwargs, message):
    with pytest.raises(MegatrainConfigError, match=message):
        MegaTrainConfig(**kwargs)


def test_unknown_config_keys():
    with pytest.raises(MegatrainConfigError, match=r"unknown megatrain option\(s\) \['slots_typo'\].*allowed"):
        MegaTrainConfig.from_dict({"slots_typo": 3})


def test_bad_env_config(monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CONFIG", "{not json")
    with pytest.raises(MegatrainConfigError, match="MEGATRAIN_CONFIG is not valid JSON"):
        MegaTrainConfig.from_env()


def test_plugins_kwarg_rejects_other_objects(tmp_path):
    from transformers import Trainer

    with pytest.raises(TypeError, match="accepts MegaTrainPlugin"):
        Trainer(model=tiny_model("llama"), args=training_args(tmp_path), plugins=[object()])


def test_two_plugins_refused(tmp_path):
    from transformers import Trainer

    with pytest.raises(MegatrainConfigError, match="pass one"):
        Trainer(
            model=tiny_model("llama"),
            args=training_args(tmp_path),
            callbacks=[MegaTrainPlugin()],
            plugins=[MegaTrainPlugin()],
        )


def test_accelerator_fp16_refused():
    from megatrain_hf import MegaTrainAccelerator

    with pytest.raises(IncompatibleOptionsError, match="mixed_precision='bf16'"):
        MegaTrainAccelerator(cpu=True, mixed_precision="fp16")


def _launch(args, tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "megatrain_hf.cli", "launch", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def test_launch_missing_config(tmp_path):
    proc = _launch(["--config_file", "nope.yaml", "train.py"], tmp_path)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "configs/" in proc.stderr


def test_launch_refuses_python_tags_in_yaml(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("megatrain: !!python/object/apply:os.system ['touch pwned']\n")
    proc = _launch(["--config_file", str(evil), "train.py"], tmp_path)
    assert proc.returncode == 2
    assert "safe_load" in proc.stderr
    assert not (tmp_path / "pwned").exists()


def test_launch_unknown_megatrain_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("compute_environment: LOCAL_MACHINE\nmegatrain:\n  compute_dtyp: bf16\n")
    proc = _launch(["--config_file", str(cfg), "train.py"], tmp_path)
    assert proc.returncode == 2
    assert "compute_dtyp" in proc.stderr and "allowed" in proc.stderr and str(cfg) in proc.stderr


def test_launch_unknown_accelerate_key_names_the_users_file(tmp_path):
    cfg = tmp_path / "user.yaml"
    cfg.write_text('compute_environment: LOCAL_MACHINE\ndistributed_type: "NO"\nnum_processs: 1\n')
    (tmp_path / "train.py").write_text("raise SystemExit('the script must not run')\n")
    proc = _launch(["--config_file", str(cfg), "train.py"], tmp_path)
    assert proc.returncode == 2
    assert str(cfg) in proc.stderr and "megatrain_launch_" not in proc.stderr  # not the temporary file
    assert "['num_processs']" in proc.stderr and "did you mean 'num_processes'" in proc.stderr
    assert "must not run" not in proc.stderr


def test_host_ram_short_raises_before_allocating(monkeypatch):
    import megatrain_hf.memory.host as memory

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 1024)
    model = tiny_model("llama")
    with pytest.raises(HostMemoryError, match=r"(?s)GiB.*Fix"):
        attach(model, device="cpu")
    assert "forward" not in vars(model.model.layers[0])


def test_host_staging_auto_drops_the_copy_when_that_makes_it_fit(monkeypatch, caplog):
    import megatrain_hf.memory.host as memory
    from megatrain_hf.memory import DEFAULT_HEADROOM_BYTES, host_breakdown_for_units
    from megatrain_hf.models.families import family_of

    model = tiny_model("llama")
    units = family_of(model).locate(model)
    tiers = host_breakdown_for_units(list(zip(units.names, units.modules)), compute_dtype=torch.bfloat16)
    with_staging = sum(tiers.values())
    current = sum(p.numel() * p.element_size() for p in model.parameters())
    # RAM for the plan without the staging copy, not with it
    available = with_staging - tiers["staging"] // 2 + DEFAULT_HEADROOM_BYTES - current
    monkeypatch.setattr(memory, "available_host_bytes", lambda: available)
    with caplog.at_level("INFO", logger="megatrain_hf"):
        engine = attach(model, device="cpu", bf16=True)
    assert not engine.store.staging.enabled and all(b.staging_host is None for b in engine.store.buffers)
    assert "drops the bf16 host copy" in caplog.text
    engine.detach()
    for staging in (True,):  # asked for explicitly: refuse instead
        with pytest.raises(HostMemoryError, match="GiB"):
            attach(tiny_model("llama"), MegaTrainConfig(host_staging=staging), device="cpu", bf16=True)
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 1024)  # not even without it
    with pytest.raises(HostMemoryError, match="GiB"):
        attach(tiny_model("llama"), device="cpu", bf16=True)


def test_empty_train_dataset_refused_with_a_clear_message(tmp_path):
    class Empty(torch.utils.data.Dataset):
        def __len__(self):
            return 0

        def __getitem__(self, i):
            raise IndexError(i)

    trainer = Trainer(model=tiny_model("llama"), args=training_args(tmp_path), train_dataset=Empty(),
                      callbacks=[MegaTrainPlugin()])
    with pytest.raises(TrainingDataError, match=r"train_dataset \(Empty\) is empty: 0 examples"):
        trainer.train()


def test_sequence_longer_than_max_position_embeddings_refused():
    model = tiny_model("llama")
    engine = attach(model, device="cpu")
    limit = model.config.max_position_embeddings
    ids = torch.randint(0, 128, (1, limit + 1))
    with pytest.raises(TrainingDataError, match=rf"{limit + 1} tokens, more than the model's max_position_embeddings"):
        model(input_ids=ids, labels=ids)
    ok = ids[:, :limit]
    model(input_ids=ok, labels=ok).loss.backward()  # at the limit: trains
    with torch.no_grad():  # inference is HF's business (generation past the limit, rope scaling)
        model(input_ids=ids)
    # packed documents restart their positions: explicit position_ids stay within the limit
    positions = torch.cat([torch.arange(limit), torch.arange(1)]).unsqueeze(0)
    model(input_ids=ids, labels=ids, position_ids=positions).loss.backward()
    with pytest.raises(TrainingDataError, match="max_position_embeddings"):  # and the next plain call is checked again
        model(input_ids=ids, labels=ids)
    engine.detach()


@pytest.mark.parametrize("kind", ["torch", "datasets"])
def test_a_too_long_example_is_refused_before_training_starts(tmp_path, kind):
    """A sized dataset's longest example is checked when train() starts, not at the step that meets it."""
    limit = tiny_model("llama").config.max_position_embeddings
    data = RandomTokens(n=12)
    rows = [data[i]["input_ids"].tolist() for i in range(len(data))]
    rows[9] = rows[9] * 5  # 80 tokens > 64
    if kind == "datasets":
        datasets = pytest.importorskip("datasets")
        dataset = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    else:
        dataset = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in rows]
    trainer = Trainer(model=tiny_model("llama"), args=training_args(tmp_path, per_device_train_batch_size=1),
                      train_dataset=dataset, callbacks=[MegaTrainPlugin()])
    steps = []
    trainer.add_callback(type("Steps", (TrainerCallback,), {"on_step_end": lambda self, *a, **k: steps.append(1)})())
    with pytest.raises(TrainingDataError, match=rf"example 9 of train_dataset .* has 80 tokens, more than the model's "
                                         rf"max_position_embeddings={limit}"):
        trainer.train()
    assert not steps


def test_rope_scaled_models_may_train_past_max_position_embeddings():
    """rope scaling (here linear x2) extends the context on purpose: no refusal."""
    model = tiny_model("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    assert model.config.rope_parameters["rope_type"] == "linear"
    engine = attach(model, device="cpu")
    ids = torch.randint(0, 128, (1, model.config.max_position_embeddings + 8))
    model(input_ids=ids, labels=ids).loss.backward()
    engine.detach()


def test_pinning_refused_by_the_driver_is_explained(monkeypatch):
    from megatrain_hf.core.store import HostStore

    class RefusingCudart:
        def cudaHostRegister(self, ptr, size, flags):
            return 2  # cudaErrorMemoryAllocation

        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: RefusingCudart())
    model = tiny_model("llama")
    with pytest.raises(PinnedMemoryError, match=r"cudaHostRegister refused to pin .* \(error 2\).*pin_memory=False"):
        HostStore(list(model.named_children())[:1], compute_dtype=torch.bfloat16, pin=True)
