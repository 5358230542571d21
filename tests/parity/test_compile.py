"""TrainingArguments(torch_compile=True): the layer templates compiled once, reused by every layer (CPU, fp32).

Bounds: with ``aot_eager`` (dynamo + AOTAutograd, no kernel fusion) the compiled layers compute what eager
does, op for op: megatrain with compile is bitwise megatrain without, and within 1e-6 of plain Trainer (the
bound of every fp32 parity test). With ``inductor`` (fused C++ kernels, other summation orders) the bound is
1e-5 on losses and parameters over 6 steps; measured 2026-12-07: 5e-7 on the loss, 6e-8 on the parameters.
"""

from __future__ import annotations

import pytest

from tests.helpers import (
    LogRecorder,
    assert_close_losses,
    assert_close_params,
    assert_same_state,
    state_of,
    tiny_model,
    train,
    training_args,
    without_dropout,
)
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, attach, engine_of
from megatrain_hf.errors import IncompatibleOptionsError

ATOL_FP32 = 1e-6
ATOL_INDUCTOR = 1e-5


def _model(family: str = "llama"):
    return tiny_model(family, num_hidden_layers=3, **without_dropout(family))


def _compiled_run(tmp_path, name: str, backend: str, family: str = "llama"):
    model = _model(family)
    logs = LogRecorder()
    args = training_args(tmp_path / name, torch_compile=True, torch_compile_backend=backend)
    trainer, losses = train(model, args, callbacks=[MegaTrainPlugin(), logs])
    return model, trainer, losses, logs


@pytest.mark.slow  # ~10 s: compiles: in `make test`, not in `make test-fast`
def test_torch_compile_trains_like_eager_and_plain_trainer(tmp_path):
    ref_model = _model()
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref"))
    eager_model = _model()
    _, eager_losses = train(eager_model, training_args(tmp_path / "eager"), callbacks=[MegaTrainPlugin()])

    model, trainer, losses, logs = _compiled_run(tmp_path, "compiled", "aot_eager")

    compiler = engine_of(model).runner.compiler
    assert compiler is not None and compiler.backend == "aot_eager"
    # 6 steps x 2 micro-batches x 3 layers, forward and recompute: every layer call ran compiled
    assert compiler.compiled_calls == 6 * 2 * 3 * 2 and compiler.eager_calls == 0
    assert compiler.graphs == 2  # one graph for the forward, one for the recompute, shared by the 3 layers
    assert compiler.recompiles == 0 and compiler.graph_breaks == 0
    assert not hasattr(trainer.model_wrapped, "_orig_mod")  # the whole model was not compiled
    logged = [entry for entry in logs.logs if "loss" in entry]
    assert logged[-1]["megatrain/compile_graphs"] == 2.0
    assert logged[-1]["megatrain/compile_recompiles"] == 0.0
    assert logged[-1]["megatrain/compile_graph_breaks"] == 0.0

    assert losses == eager_losses
    assert_same_state(state_of(eager_model), state_of(model))
    assert_close_losses(ref_losses, losses, ATOL_FP32)
    assert_close_params(state_of(ref_model), state_of(model), ATOL_FP32)


@pytest.mark.slow
def test_torch_compile_inductor_within_bound(tmp_path):
    ref_model = _model()
    _, ref_losses = train(ref_model, training_args(tmp_path / "ref"))
    model, _, losses, _ = _compiled_run(tmp_path, "inductor", "inductor")
    compiler = engine_of(model).runner.compiler
    assert compiler.compiled_calls == 6 * 2 * 3 * 2 and compiler.recompiles == 0
    assert_close_losses(ref_losses, losses, ATOL_INDUCTOR)
    assert_close_params(state_of(ref_model), state_of(model), ATOL_INDUCTOR)


def test_compile_refused_with_dropout():
    model = tiny_model("llama")  # attention_dropout=0.1
    with pytest.raises(IncompatibleOptionsError, match=r"compile=True.*dropout.*self_attn.*Fix: set the model's dropout"):
        attach(model, MegaTrainConfig(compile=True, compile_backend="aot_eager"), device="cpu")


def test_tiled_mlp_runs_eagerly_under_compile():
    """A call whose MLP runs over sequence tiles is not compiled (counted as an eager call); its result is exact."""
    import torch

    from tests.helpers import RandomTokens

    results = []
    for compile in (False, True):
        model = _model()
        engine = attach(model, MegaTrainConfig(compile=compile, compile_backend="aot_eager", sequence_tile_tokens=4),
                        device="cpu")
        ids = RandomTokens(n=2).ids
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        if compile:
            assert engine.runner.compiler.compiled_calls == 0 and engine.runner.compiler.eager_calls == 3
    assert results[0][0] == results[1][0]
    for name, grad in results[0][1].items():
        assert torch.equal(grad, results[1][1][name]), name


def _step(family: str, compile: bool, **call):
    import torch

    from tests.helpers import RandomTokens

    model = _model(family)
    engine = attach(model, MegaTrainConfig(compile=compile, compile_backend="aot_eager"), device="cpu")
    ids = RandomTokens(n=2).ids
    out = model(input_ids=ids, labels=ids, **call)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    hidden = [h.detach().clone() for h in out.hidden_states] if call.get("output_hidden_states") else []
    return engine, out.loss.item(), grads, hidden, torch


def test_hidden_states_and_router_logits_under_compile():
    """output_hidden_states: collected by the layer's own hook (outside the compiled forward), the attention's
    capture hook inactive: compiled, exact. A MoE model whose router logits are collected for the loss: its
    layers' capture hooks are active, so they run eagerly, exact."""
    eager = _step("llama", False, output_hidden_states=True)
    compiled = _step("llama", True, output_hidden_states=True)
    assert compiled[0].runner.compiler.compiled_calls == 3 * 2 and compiled[0].runner.compiler.eager_calls == 0
    assert eager[1] == compiled[1] and len(compiled[3]) == 4
    torch = compiled[4]
    assert all(torch.equal(a, b) for a, b in zip(eager[3], compiled[3]))
    assert all(torch.equal(eager[2][n], compiled[2][n]) for n in eager[2])

    eager = _step("qwen3_moe", False)
    compiled = _step("qwen3_moe", True)
    assert compiled[0].runner.compiler.compiled_calls == 0 and compiled[0].runner.compiler.eager_calls == 3
    assert eager[1] == compiled[1] and all(torch.equal(eager[2][n], compiled[2][n]) for n in eager[2])


def test_accelerator_dynamo_backend_compiles_the_layers():
    """MegaTrainAccelerator(dynamo_backend=...): the engine compiles its layers, Accelerate not the whole model;
    a step is bitwise the eager one."""
    import torch

    from megatrain_hf.integrations.accelerate import MegaTrainAccelerator
    from tests.helpers import RandomTokens

    results = []
    from accelerate.state import AcceleratorState

    for backend in ("no", "aot_eager"):
        AcceleratorState._reset_state(True)  # (a process-wide singleton: each accelerator its own dynamo plugin)
        accelerator = MegaTrainAccelerator(cpu=True, dynamo_backend=backend)
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        prepared, optimizer = accelerator.prepare(model, optimizer)
        assert prepared is model  # not an OptimizedModule
        ids = RandomTokens(n=2).ids
        loss = prepared(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        compiler = engine_of(model).runner.compiler
        assert (compiler is None) == (backend == "no")
        results.append((loss.item(), state_of(model)))
    AcceleratorState._reset_state(True)
    assert engine_of(model).runner.compiler.compiled_calls == 3 * 2
    assert results[0][0] == results[1][0]
    assert_same_state(results[0][1], results[1][1])
