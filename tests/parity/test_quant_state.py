"""Compressed AdamW moments (``optimizer_state``): quantizer bounds, both kernels, Trainer parity,
checkpoints and refusals (CPU, fp32).

The reference is plain torch written here: each parameter's moments kept as unpacked codes and
per-block absmax scales (or bf16 tensors), expanded, stepped by torch's fused AdamW kernel,
quantized again to the nearest map value (ties up; a positive v at least the lowest non-zero value, the
m of an element without a gradient toward zero). Through Trainer, every loss and every final
parameter must agree within 1e-6 with plain Trainer driving that reference, for both host kernels.
"""

from __future__ import annotations


import pytest
import torch

from tests.helpers import assert_close_losses, assert_close_params, state_of, tiny_model, train, training_args
from megatrain_hf import HostAdamW, MegaTrainPlugin, attach
from megatrain_hf.optim.state_files import OPTIMIZER_DIR, to_torch_state_dict
from megatrain_hf.optim import native
from megatrain_hf.optim.moment_formats import compress, error_bound, expand, format_of
from megatrain_hf.errors import CheckpointError, IncompatibleOptionsError, MegatrainConfigError

ATOL = 1e-6
KERNELS = ["torch", pytest.param("native", marks=pytest.mark.skipif(native.host_adamw() is None,
                                                                       reason="no C++ compiler"))]


class ReferenceCompressedAdamW(torch.optim.Optimizer):
    """Plain-torch AdamW whose moments live compressed between steps (the definition in quant.py)."""

    def __init__(self, params, mode: str, lr: float, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.fmt = format_of(mode)

    def _expand(self, st, k, n):
        if not self.fmt.quantized:
            return st[k].float()
        codes, scales = st[k]
        return self.fmt.table(k)[codes] * scales.repeat_interleave(self.fmt.block)[:n]

    def _store(self, st, k, x, grad=None):
        if not self.fmt.quantized:
            st[k] = x.to(torch.bfloat16)
            return
        b = self.fmt.block
        blocks = torch.nn.functional.pad(x, (0, (-x.numel()) % b)).view(-1, b)
        scales = blocks.abs().amax(dim=1)
        per = scales.repeat_interleave(b)[: x.numel()]
        normed = torch.where(per > 0, x / per.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(x))
        q = self.fmt.table(k)
        mids = (q[:-1] + q[1:]) / 2
        codes = (normed.unsqueeze(1) >= mids).sum(dim=1)  # nearest map value, ties up
        if k == 1 and q[0] == 0:  # a positive v never takes the value 0: its lowest non-zero one instead
            codes = torch.where((x > 0) & (codes == 0), 1, codes)
        if grad is not None:  # an m element without a gradient: the nearest value not larger in magnitude
            back = (q[codes].abs() > normed.abs()) & (grad == 0)
            codes = torch.where(back, codes - torch.sign(q[codes]).long(), codes)
        st[k] = (codes, scales)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                n = p.numel()
                if not st:
                    st["step"] = torch.zeros(())
                    for k in (0, 1):
                        self._store(st, k, torch.zeros(n))
                m, v = (self._expand(st, k, n).view(p.shape) for k in (0, 1))
                st["step"] += 1
                torch._fused_adamw_([p], [p.grad], [m], [v], [], [st["step"]], amsgrad=False, lr=group["lr"],
                                    beta1=group["betas"][0], beta2=group["betas"][1],
                                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                                    grad_scale=None, found_inf=None)
                self._store(st, 0, m.reshape(-1), p.grad.reshape(-1))
                self._store(st, 1, v.reshape(-1))


@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_round_trip_within_stated_bound(mode):
    fmt = format_of(mode)
    torch.manual_seed(0)
    n = fmt.block * 7 + 5  # a partial last block
    x = torch.randn(n) * torch.logspace(-8, 1, n)[torch.randperm(n)]
    x[: fmt.block] = 0.0  # an all-zero block
    for k, values in ((0, x), (1, x.abs())):
        codes = torch.zeros(fmt.code_bytes(n), dtype=torch.uint8)
        scales = torch.zeros(fmt.blocks(n))
        compress(fmt, k, values, codes, scales)
        back = expand(fmt, k, codes, scales, n)
        per_block = torch.nn.functional.pad(values, (0, (-n) % fmt.block)).view(-1, fmt.block).abs().amax(1)
        allowed = per_block.repeat_interleave(fmt.block)[:n] * error_bound(mode, k)
        allowed += back.abs() * 2**-23  # the fp32 rounding of map value x scale
        assert torch.all((back - values).abs() <= allowed), (k, ((back - values).abs() - allowed).max())
        assert torch.equal(back[: fmt.block], torch.zeros(fmt.block))
        assert torch.equal(scales, per_block)  # the scale is the block's absmax
    assert error_bound(mode, 0) == pytest.approx({"8bit": 0.00703, "4bit": 0.1125}[mode], abs=1e-4)
    assert error_bound(mode, 1) == pytest.approx({"8bit": 0.00352, "4bit": 0.0625}[mode], abs=1e-4)
    assert len(fmt.maps[0]) == len(fmt.maps[1]) == 2**fmt.bits


@pytest.mark.parametrize("mode", ["bf16", "8bit", "4bit"])
def test_native_kernel_equals_torch_path(mode):
    """Clipping, two weight-decay groups, a parameter without a gradient, bf16 staging in the pass."""
    if native.host_adamw() is None:
        pytest.skip("no C++ compiler")
    models = [tiny_model("llama", hidden_size=96, intermediate_size=200) for _ in range(2)]
    opts, engines = [], []
    for model, kernel in zip(models, ("torch", "native")):
        engines.append(attach(model, device="cpu", config=None, bf16=True))
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        opts.append(HostAdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              store=engines[-1].store, lr=3e-3, betas=(0.9, 0.95), kernel=kernel, state=mode))
    assert opts[1].kernel == "native"
    for step in range(5):
        torch.manual_seed(step)
        grads = {n: torch.randn_like(p) * 10.0 ** (step % 3 - 2) for n, p in models[0].named_parameters()}
        for model, opt in zip(models, opts):
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            if step == 2:
                model.model.layers[0].mlp.up_proj.weight.grad = None
            opt.set_clip_coef(torch.tensor(0.37))
            opt.step()
            opt.zero_grad()
    for opt in opts:
        opt.synchronize()
    assert_close_params(state_of(models[0]), state_of(models[1]), ATOL)
    for u, tensors in opts[0].moments.in_ram.items():
        for name, t in tensors.items():
            other = opts[1].moments.in_ram[u][name]
            assert (t != other).sum() <= max(2, t.numel() // 10000), (u, name)  # torch's scalar tails only
    store = engines[1].store
    for p in models[1].parameters():
        e = store.home_of(p)[1]
        if store.staging.slice(e) is not None:  # the staging copy written in the same pass
            assert torch.equal(store.staging.slice(e), p.detach().reshape(-1).to(torch.bfloat16))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["bf16", "8bit", "4bit"])
def test_trainer_equals_reference(mode, kernel, tmp_path):
    args = dict(adam_beta2=0.95)
    ref_model = tiny_model("llama")
    ref_kwargs = dict(mode=mode, lr=2e-3, betas=(0.9, 0.95), eps=1e-8)
    ref_trainer, ref_losses = train(ref_model, training_args(tmp_path / "ref", **args),
                                    optimizer_cls_and_kwargs=(ReferenceCompressedAdamW, ref_kwargs))
    model = tiny_model("llama")
    trainer, losses = train(model, training_args(tmp_path / "mt", **args),
                            callbacks=[MegaTrainPlugin(optimizer_state=mode, host_adamw_kernel=kernel)])
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, HostAdamW) and optimizer.moments.format.mode != "fp32" and optimizer.kernel == kernel
    assert_close_losses(ref_losses, losses, ATOL)
    assert_close_params(state_of(ref_model), state_of(model), ATOL)
    # the moments agree too (expanded): state_dict() gives torch AdamW's layout
    ref_opt = ref_trainer.optimizer.optimizer
    ref_params = [p for g in ref_opt.param_groups for p in g["params"]]
    got = optimizer.state_dict()["state"]
    for i, p in enumerate(ref_params):
        for k, key in enumerate(("exp_avg", "exp_avg_sq")):
            want = ref_opt._expand(ref_opt.state[p], k, p.numel()).view(p.shape)
            torch.testing.assert_close(got[i][key], want, atol=1e-9, rtol=1e-5)


def test_resume_equals_uninterrupted_and_converter(tmp_path):
    args = dict(max_steps=6, save_strategy="steps", save_steps=3)
    plugin = dict(optimizer_state="8bit")
    full = tiny_model("llama")
    trainer, full_losses = train(full, training_args(tmp_path / "run", **args), callbacks=[MegaTrainPlugin(**plugin)])
    folder = tmp_path / "run" / "checkpoint-3" / OPTIMIZER_DIR
    from safetensors import safe_open

    with safe_open(str(folder / "unit-00001.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {"exp_avg.codes", "exp_avg.scales", "exp_avg_sq.codes", "exp_avg_sq.scales"}
        assert f.get_tensor("exp_avg.codes").dtype == torch.uint8
        assert f.metadata()["optimizer_state"] == "8bit"
    resumed = tiny_model("llama", seed=123)  # everything must come from the checkpoint
    _, resumed_losses = train(resumed, training_args(tmp_path / "run", **args), callbacks=[MegaTrainPlugin(**plugin)],
                              resume=str(tmp_path / "run" / "checkpoint-3"))
    assert resumed_losses == full_losses[6:]  # bitwise
    for n, p in full.named_parameters():
        assert torch.equal(p, dict(resumed.named_parameters())[n]), n
    # the converter expands the final shards to torch AdamW's fp32 state (loadable without megatrain)
    expected = trainer.optimizer.optimizer.state_dict()
    converted = to_torch_state_dict(str(tmp_path / "run" / "checkpoint-6" / OPTIMIZER_DIR))
    assert converted["state"].keys() == expected["state"].keys()
    for i, s in expected["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert converted["state"][i][key].dtype == torch.float32
            assert torch.equal(s[key], converted["state"][i][key]), (i, key)
    # another mode cannot load these shards: refused with the fix
    with pytest.raises(CheckpointError, match=r"optimizer_state='8bit' moments, this HostAdamW keeps '4bit'"):
        train(tiny_model("llama"), training_args(tmp_path / "run", **args),
              callbacks=[MegaTrainPlugin(optimizer_state="4bit")], resume=str(tmp_path / "run" / "checkpoint-3"))


def test_refusals(tmp_path):
    from megatrain_hf import MegaTrainConfig

    with pytest.raises(MegatrainConfigError,
                       match=r"optimizer_state='3bit' .* allowed: \['fp32', 'bf16', '8bit', '4bit"):
        MegaTrainConfig(optimizer_state="3bit")
    with pytest.raises(IncompatibleOptionsError, match=r"but the optimizer is SGD\. Fix: train with AdamW"):
        train(tiny_model("llama"), training_args(tmp_path / "sgd", optim="sgd"),
              callbacks=[MegaTrainPlugin(optimizer_state="8bit")])
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(IncompatibleOptionsError, match=r"optimizers=\(opt, sched\)\) is kept"):
        train(model, training_args(tmp_path / "kept"), callbacks=[MegaTrainPlugin(optimizer_state="4bit")],
              optimizers=(opt, sched))
    with pytest.raises(IncompatibleOptionsError, match="device_update=True"):
        train(tiny_model("llama"), training_args(tmp_path / "dev"),
              callbacks=[MegaTrainPlugin(optimizer_state="8bit", device_update=True)])


def test_planner_is_exact_for_compressed_moments(capsys):
    """plan_memory / host_breakdown_for_units count what HostAdamW allocates, per mode; estimate shows it."""
    import transformers

    from megatrain_hf.cli.estimate import estimate_main
    from megatrain_hf.memory.host import host_breakdown_for_units
    from megatrain_hf.memory.plan import plan_memory
    from megatrain_hf.memory.shapes import ModelShape

    config = transformers.LlamaConfig(hidden_size=72, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=101)  # not multiples of the blocks
    model = transformers.LlamaForCausalLM(config)
    units = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
    engine = attach(model, device="cpu", config=None)
    for mode in ("bf16", "8bit", "4bit"):
        opt = HostAdamW(model.parameters(), store=engine.store, state=mode)
        plan = plan_memory(ModelShape.from_hf_config(config), seq_len=8, micro_batch=1, compute_dtype="fp32",
                           optimizer_state=mode)
        assert plan.host_exp_avg + plan.host_exp_avg_sq == opt.moments.nbytes(), mode
        tiers = host_breakdown_for_units([(str(i), m) for i, m in enumerate(units)], compute_dtype=torch.float32,
                                         optimizer_state=mode)
        assert tiers["exp_avg"] + tiers["exp_avg_sq"] == opt.moments.nbytes(), mode
        assert not any(t.dtype == torch.float32 for ts in opt.moments.in_ram.values() for n, t in ts.items() if "scales" not in n)  # no fp32 moment flats
        opt.close()
    assert estimate_main(["--model", "llama-7b", "--host-gib", "125", "--optimizer-state", "8bit"]) == 0
    out = capsys.readouterr().out
    assert "AdamW exp_avg (8bit)" in out and "1.02" in out and "11.99" in out  # B/param: 18 -> 12


def test_load_state_dict_compresses_a_torch_adamw_state():
    """A plain torch AdamW state (e.g. a converted optimizer.pt) loads into compressed moments."""
    ref_model, model = tiny_model("llama"), tiny_model("llama")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    for p in ref_model.parameters():
        p.grad = torch.randn_like(p)
    ref.step()
    engine = attach(model, device="cpu", config=None)
    opt = HostAdamW(model.parameters(), store=engine.store, state="4bit")
    opt.load_state_dict(ref.state_dict())
    fmt = format_of("4bit")
    got = opt.state_dict()["state"]
    for i, p in enumerate(ref_model.parameters()):
        for k, key in enumerate(("exp_avg", "exp_avg_sq")):
            x = ref.state[p][key].reshape(-1)
            codes, scales = torch.zeros(fmt.code_bytes(x.numel()), dtype=torch.uint8), torch.zeros(fmt.blocks(x.numel()))
            compress(fmt, k, x, codes, scales)
            assert torch.equal(got[i][key].reshape(-1), expand(fmt, k, codes, scales, x.numel())), (i, key)
        assert float(got[i]["step"]) == 1.0
    opt.close()
