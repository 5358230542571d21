"""bf16 gradient accumulators (``grad_dtype="bf16"``, ``core/grad_accumulators.py``).

Through Trainer + the plugin, bf16 compute on the CPU, gradient accumulation 1: every logged loss and
every final parameter equal the fp32 accumulators' run bitwise (clipping, weight decay, a schedule;
both kernels; 8-bit moments; masters and moments on disk); ``param.grad`` of a streamed matrix is a
bf16 view of its accumulator, the host store and the plan hold 2 B per such parameter; what would
not be exact is refused or raises with the fix.
"""

from __future__ import annotations

import re

import pytest
import torch
from tests.helpers import assert_same_state, state_of, tiny_model, train, training_args

from megatrain_hf import MegaTrainConfig, MegaTrainPlugin
from megatrain_hf.memory.host import host_breakdown_for_units
from megatrain_hf.optim import native
from megatrain_hf.plan import Machine, Run, check
from megatrain_hf.errors import IncompatibleOptionsError, MegatrainConfigError, UsageError

NO_NATIVE = pytest.mark.skipif(native.host_adamw() is None, reason="no C++ compiler")
NO_GRAD_DTYPE = pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="torch without Tensor.grad_dtype")


def _run(tmp_path, name, options=None, model=None, **args):
    config = MegaTrainConfig(**(options or {}))
    model = model if model is not None else tiny_model("llama")
    args = dict(dict(bf16=True, gradient_accumulation_steps=1, per_device_train_batch_size=4), **args)
    trainer, losses = train(model, training_args(tmp_path / name, **args), callbacks=[MegaTrainPlugin(config)])
    return trainer, model, losses


@NO_GRAD_DTYPE
@pytest.mark.parametrize("options", [
    dict(host_adamw_kernel="torch"),
    pytest.param(dict(host_adamw_kernel="native"), marks=NO_NATIVE),
    pytest.param(dict(host_adamw_kernel="native", optimizer_state="8bit"), marks=NO_NATIVE),
    dict(host_adamw_kernel="torch", optimizer_state="4bit"),
], ids=["torch", "native", "native-8bit", "torch-4bit"])
def test_bf16_accumulators_equal_fp32_ones(tmp_path, options):
    _, ref, ref_losses = _run(tmp_path, "fp32", options)
    trainer, got, losses = _run(tmp_path, "bf16", dict(options, grad_dtype="bf16"))
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))
    store = trainer.optimizer.optimizer.store
    low = store.accumulators.low_entries()
    assert low and all(e.wire == torch.bfloat16 for e in low)  # every streamed matrix but the head's
    assert len(store.accumulators.low_units) == len(store.entries) - 1
    assert {e.tensor.grad_dtype for e in low} == {torch.bfloat16}


@NO_GRAD_DTYPE
@pytest.mark.parametrize("kernel", ["torch", pytest.param("native", marks=NO_NATIVE)])
def test_with_masters_and_moments_on_disk(tmp_path, kernel):
    disk = tmp_path / "disk"
    disk.mkdir()
    options = dict(host_adamw_kernel=kernel, optimizer_state="8bit", offload_dir=str(disk), offload_state="all")
    _, ref, ref_losses = _run(tmp_path, "fp32", options)
    trainer, got, losses = _run(tmp_path, "bf16", dict(options, grad_dtype="bf16"))
    assert trainer.optimizer.optimizer.master_units
    assert losses == ref_losses
    assert_same_state(state_of(ref), state_of(got))


@NO_GRAD_DTYPE
def test_grad_is_a_bf16_view_and_the_plan_counts_two_bytes(tmp_path):
    model = tiny_model("llama")
    seen = {}

    from transformers import TrainerCallback

    class Grads(TrainerCallback):  # before zero_grad: the step's gradients
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            for n, p in model.named_parameters():
                seen[n] = (p.grad.dtype, p.grad.clone().float())

    config = MegaTrainConfig(grad_dtype="bf16")
    trainer, _ = train(model, training_args(tmp_path / "peek", bf16=True, gradient_accumulation_steps=1, max_steps=1),
                       callbacks=[MegaTrainPlugin(config), Grads()])
    store = trainer.optimizer.optimizer.store
    names = {id(p): n for n, p in model.named_parameters()}
    low = {names[id(e.tensor)] for e in store.accumulators.low_entries()}
    assert low and all(seen[n][0] == torch.bfloat16 for n in low)
    assert all(seen[n][0] == torch.float32 for n in seen if n not in low)
    assert "lm_head.weight" not in low and "model.embed_tokens.weight" not in low
    # host bytes: the plan's are the store's, 2 B per parameter of the bf16 part
    grads = sum(b.grad_host.numel() * 4 + (b.grad_low.numel() * 2 if b.grad_low is not None else 0)
                for b in store.buffers if b.grad_host is not None)
    engine = trainer.model._megatrain_engine
    units = [(u.name, u.module) for u in engine.runner.units]
    planned = host_breakdown_for_units(units, compute_dtype=torch.bfloat16, grad_dtype=torch.bfloat16)["grad"]
    fp32 = host_breakdown_for_units(units, compute_dtype=torch.bfloat16)["grad"]
    assert planned == grads
    assert fp32 - planned == 2 * sum(b.grad_low.numel() for b in store.buffers if b.grad_low is not None)
    trainer.model._megatrain_engine.detach()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad_dtype == torch.float32 for p in model.parameters())


def test_refused_where_it_would_not_be_exact(tmp_path):
    with pytest.raises(IncompatibleOptionsError, match=r"steps=2.*Fix: gradient_accumulation_steps=1"):
        _run(tmp_path, "ga", dict(grad_dtype="bf16"), gradient_accumulation_steps=2)
    with pytest.raises(IncompatibleOptionsError, match=r"grad_dtype='bf16'.*compute is fp32.*grad_dtype='fp32'"):
        _run(tmp_path, "fp32", dict(grad_dtype="bf16"), bf16=False)
    for why, world, device_update in [("data parallelism", 2, False), ("device_update", 1, True)]:
        with pytest.raises(IncompatibleOptionsError, match=why):
            check(MegaTrainConfig(grad_dtype="bf16", device_update=device_update),
                  Machine(torch.device("cpu"), world_size=world), Run(bf16=True))
    with pytest.raises(IncompatibleOptionsError,
                       match=r"grad_dtype='bf16' applies to megatrain's HostAdamW, but the optim"):
        _run(tmp_path, "sgd", dict(grad_dtype="bf16"), optim="sgd")
    with pytest.raises(MegatrainConfigError, match=r"MegaTrainConfig.grad_dtype='fp16'"):
        MegaTrainConfig(grad_dtype="fp16")


@NO_GRAD_DTYPE
def test_a_second_gradient_in_a_step_raises(tmp_path):
    """A custom loop that runs two backward passes before the step: the bf16 accumulator refuses to round."""
    from megatrain_hf import attach

    model = tiny_model("llama")
    engine = attach(model, MegaTrainConfig(grad_dtype="bf16"), device="cpu", bf16=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(UsageError, match=r"received a second gradient in one optimizer step.*grad_dtype='fp32'"):
        model(input_ids=ids, labels=ids).loss.backward()
    engine.detach()


@NO_NATIVE
@pytest.mark.parametrize("mode", ["fp32", "bf16", "8bit", "4bit"])
def test_native_kernel_bf16_gradients_equal_their_fp32_values(mode):
    """Work items across tensor and chunk boundaries (2^18 elements), odd sizes, partial blocks, clipping."""
    from megatrain_hf.optim.compressed import EntryState
    from megatrain_hf.optim.kernels import GroupWork, native_update
    from megatrain_hf.optim.moment_formats import format_of
    from megatrain_hf.optim.moment_store import Fp32State, layout_of

    fmt = format_of(mode)
    sizes = [7, (1 << 18) + 333, 1000, 3 * (1 << 17) + 129]
    g = torch.Generator().manual_seed(0)
    params0 = [torch.randn(n, generator=g) for n in sizes]
    grads16 = [(torch.randn(n, generator=g) * 1e-2).bfloat16() for n in sizes]

    def run(bf16: bool):
        params = [p.clone() for p in params0]
        stages = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        compressed, m, v = None, [], []
        if mode == "fp32":
            m, v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
        else:
            def codes(n):
                return torch.zeros(fmt.code_bytes(n) // (2 if mode == "bf16" else 1),
                                   dtype=torch.bfloat16 if mode == "bf16" else torch.uint8)

            compressed = [EntryState(fmt, n, (codes(n), codes(n)), (torch.zeros(fmt.blocks(n)), torch.zeros(fmt.blocks(n)))
                                     if fmt.quantized else (None, None)) for n in sizes]
        for step in range(3):
            w = GroupWork(entries=[], steps=[torch.full((), float(step)) for _ in sizes], params=params,
                          grads=[x if bf16 else x.float() for x in grads16], lr=1e-3,
                          beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, maximize=step == 1,
                          clip=torch.tensor(0.37), layout=layout_of(fmt, {}, {}),
                          states=compressed if compressed is not None else [Fp32State(a, b) for a, b in zip(m, v)])
            native_update(native.host_adamw(), w, stages)
        state = m + v if compressed is None else [t for s in compressed for t in (*s.codes, *s.scales) if t is not None]
        return params + stages + state

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_the_shape_plan_counts_two_bytes_per_layer_matrix_parameter():
    from megatrain_hf.memory.plan import plan_memory
    from megatrain_hf.memory.shapes import PRESETS

    shape = PRESETS["llama-7b"]
    fp32 = plan_memory(shape, seq_len=4096, micro_batch=1)
    bf16 = plan_memory(shape, seq_len=4096, micro_batch=1, grad_dtype="bf16")
    layer_matrices = shape.layers * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # the head (32000 x 4096) stays fp32
    assert fp32.host_grad - bf16.host_grad == 2 * layer_matrices
    assert {k: v for k, v in fp32.host_breakdown().items() if k != "grad"} == \
        {k: v for k, v in bf16.host_breakdown().items() if k != "grad"}



def test_the_estimate_refuses_what_the_engine_refuses(capsys):
    """`megatrain estimate --grad-dtype bf16` with accumulation or fp32 compute: the training plan's refusal."""
    from megatrain_hf.cli.estimate import estimate_main

    for bad, why in ((["--grad-accum", "2"], "gradient_accumulation_steps=2 .* adds several"),
                     (["--dtype", "fp32"], "compute is fp32")):
        assert estimate_main(["--model", "llama-7b", "--grad-dtype", "bf16", *bad]) == 2
        assert re.search(rf"grad_dtype='bf16'.*{why}.*grad_dtype='fp32'", capsys.readouterr().err)
