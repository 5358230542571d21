"""base_quantization: the NF4 / int8 schemes (vs a plain reference and bitsandbytes), LoRA training on a
quantized base through Trainer (vs a plain Trainer on the same dequantized weights, with resume), the
loading path from a checkpoint, and the refusals."""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch

from tests.helpers import state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin, attach, engine_of
from megatrain_hf.core import frozen_formats as Q
from megatrain_hf.core.layout import Kind
from megatrain_hf.errors import IncompatibleOptionsError, MegatrainConfigError

peft = pytest.importorskip("peft")

ATOL = 1e-6
TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]

# ----------------------------------------------------------------------------- plain reference of the schemes
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def reference_dynamic_map() -> list[float]:
    """The signed dynamic map as bitsandbytes defines it: for exponents e = 0..6, 2^e fractions
    (midpoints of linspace(0.1, 1, 2^e + 1)) times 10^(e - 6) in fp32, both signs, then 0 and 1, sorted."""
    values = []
    for e in range(7):
        edges = torch.linspace(0.1, 1, 2**e + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        values += (mids * 10 ** (e - 6)).tolist() + (mids * -(10 ** (e - 6))).tolist()
    values += [0.0, 1.0]
    return sorted(torch.tensor(values, dtype=torch.float32).tolist())


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def reference_nf4(fmt, raw: torch.Tensor, dtype) -> torch.Tensor:
    """Element by element: absmax_b = dyn[q_b] * absmax2_{b // 256} + offset; w_i = NF4[code_i] * absmax_{i // 64}."""
    packed, qabs, absmax2, offset = Q._pieces(fmt, raw)
    dyn = reference_dynamic_map()
    absmax = [(f32(dyn[int(q)]) * absmax2[b // 256]) + offset[0] for b, q in enumerate(qabs.tolist())]
    out = torch.empty(fmt.numel, dtype=torch.float32)
    for i in range(fmt.numel):
        byte = int(packed[i // 2])
        code = byte >> 4 if i % 2 == 0 else byte & 0xF
        out[i] = f32(NF4[code]) * absmax[i // 64]
    return out.to(dtype).view(fmt.shape)


def reference_int8(fmt, raw: torch.Tensor, dtype) -> torch.Tensor:
    """Row by row: w = CB * SCB * (1/127 as bitsandbytes writes it), in fp32."""
    cb, scb = Q._pieces(fmt, raw)
    rows, cols = fmt.shape
    out = torch.stack([cb[r * cols : (r + 1) * cols].float() * scb[r] * f32(7.874015718698502e-3) for r in range(rows)])
    return out.to(dtype)


def quantized(scheme: str, w: torch.Tensor, dtype=torch.float32):
    fmt = Q.quant_format(scheme, tuple(w.shape), dtype)
    raw = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    Q.quantize_tensor(fmt, w, raw)
    return fmt, raw


SHAPES = [(16, 16), (8, 96), (48, 64), (40, 448)]  # 4 absmaxes (one partial 256-block), 12, 48, 280 (two blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantization_matches_the_plain_reference(shape, dtype):
    assert Q.dynamic_map().tolist() == reference_dynamic_map()
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 0.02
    w[0, :4] = 0.0  # zeros and a repeated value
    for scheme, reference in (("nf4", reference_nf4), ("int8", reference_int8)):
        fmt, raw = quantized(scheme, w, dtype)
        got = Q.dequantize(fmt, raw)
        assert got.dtype == dtype and got.shape == shape
        assert torch.equal(got, reference(fmt, raw, dtype)), scheme
        error = (got.float() - w).abs().max().item()
        assert error < (0.2 if scheme == "nf4" else 0.01) * w.abs().max().item(), (scheme, error)


def test_quantization_is_the_same_in_chunks(monkeypatch):
    w = torch.randn(40, 448, generator=torch.Generator().manual_seed(4))
    whole = {s: quantized(s, w) for s in Q.SCHEMES}
    values = {s: Q.dequantize(*whole[s]) for s in Q.SCHEMES}
    monkeypatch.setattr(Q, "CHUNK_ELEMENTS", 448 * 3)  # several chunks per tensor, the last partial
    monkeypatch.setattr(Q, "DEQUANT_CHUNK_ELEMENTS", 448 * 5)
    for scheme in Q.SCHEMES:
        fmt, raw = quantized(scheme, w)
        assert torch.equal(raw, whole[scheme][1]), scheme
        assert torch.equal(Q.dequantize(fmt, raw), values[scheme])


def _bitsandbytes():
    """bitsandbytes, from the folder MEGATRAIN_TEST_BNB_SITE names (never a dependency), or None."""
    site = os.environ.get("MEGATRAIN_TEST_BNB_SITE")
    if site and site not in sys.path:
        sys.path.append(site)
    try:
        return importlib.import_module("bitsandbytes.functional")
    except Exception:  # absent, or no backend for this machine
        return None


@pytest.mark.parametrize("shape", [(64, 128), (256, 320), (3, 64)])
def test_dequantization_matches_bitsandbytes_bitwise(shape):
    F = _bitsandbytes()
    if F is None:
        pytest.skip("bitsandbytes is not importable (set MEGATRAIN_TEST_BNB_SITE to a folder it is installed in)")
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 0.05
    # NF4: our dequantization of the state bitsandbytes stored
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    fmt = Q.quant_format("nf4", shape, torch.float32)
    raw = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    ours = Q._pieces(fmt, raw)
    ours[0].copy_(packed.view(-1))
    ours[1].copy_(state.absmax)
    ours[2].copy_(state.state2.absmax)
    ours[3].copy_(state.offset.view(1))
    for dtype in (torch.float32, torch.bfloat16):
        state.dtype = dtype
        expected = F.dequantize_4bit(packed, state)
        assert torch.equal(Q.dequantize(Q.QuantFormat(**{**fmt.__dict__, "dtype": dtype}), raw), expected), dtype
    # ... and what we store from the same weights: the same codes, the same second-level state
    _, mine = quantized("nf4", w)
    codes, qabs, absmax2, offset = Q._pieces(fmt, mine)
    assert torch.equal(codes, packed.view(-1)) and torch.equal(absmax2, state.state2.absmax)
    assert torch.equal(offset[0], state.offset)
    assert (qabs != state.absmax).float().mean().item() < 0.01  # its CPU kernel rounds a few ties the other way
    # int8: Int8Params quantizes the fp16 weight row-wise; the same CB, SCB and dequantization
    cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16))
    fmt8, raw8 = quantized("int8", w)
    got_cb, got_scb = Q._pieces(fmt8, raw8)
    assert torch.equal(got_cb.view(shape), cb) and torch.equal(got_scb, scb)
    assert torch.equal(Q.dequantize(fmt8, raw8), F.int8_vectorwise_dequant(cb, scb))


# ----------------------------------------------------------------------------- LoRA on a quantized base, via Trainer
def lora(model, targets=TARGETS):
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.1))


def reference_model(scheme: str):
    """The PEFT model whose base weights are replaced by their dequantized values (plain torch)."""
    model = lora(tiny_model("llama"))
    reference = reference_nf4 if scheme == "nf4" else reference_int8
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
                w = module.base_layer.weight
                fmt, raw = quantized(scheme, w)
                w.copy_(reference(fmt, raw, torch.float32) if w.numel() <= 4096 else Q.dequantize(fmt, raw))
    return model


def adapters(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in state_of(model).items() if "lora_" in n}


def assert_close(ref_losses, losses, ref_params, params):
    assert len(ref_losses) == len(losses) > 0
    assert max(abs(a - b) for a, b in zip(ref_losses, losses)) <= ATOL, (ref_losses, losses)
    assert ref_params.keys() == params.keys() and ref_params
    worst = max((ref_params[n] - params[n]).abs().max().item() for n in params)
    assert worst <= ATOL, worst


@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_lora_on_a_quantized_base_matches_plain_trainer(tmp_path, scheme):
    ref = reference_model(scheme)
    _, ref_losses = train(ref, training_args(tmp_path / "ref"))
    model = lora(tiny_model("llama"))
    _, losses = train(model, training_args(tmp_path / "mt"), callbacks=[MegaTrainPlugin(base_quantization=scheme)])
    assert_close(ref_losses, losses, adapters(ref), adapters(model))
    engine = engine_of(model)
    quant = [e for u in range(len(engine.store.entries)) for e in engine.store.entries_of(u, Kind.FROZEN) if e.quant]
    assert len(quant) == 2 * len(TARGETS) and all(e.quant.scheme == scheme for e in quant)
    assert all(e.tensor.isnan().all() for e in quant)  # the weight exists only quantized


def test_lora_on_a_quantized_base_resumes_exactly(tmp_path):
    args = dict(save_strategy="steps", save_steps=3)
    plugin = lambda: [MegaTrainPlugin(base_quantization="nf4")]  # noqa: E731
    full = lora(tiny_model("llama"))
    _, full_losses = train(full, training_args(tmp_path / "full", **args), callbacks=plugin())
    base = tiny_model("llama")  # the same base (a LoRA checkpoint holds the adapters only) ...
    torch.manual_seed(9)
    resumed = lora(base)  # ... other adapters (lora_A is random): they come from the checkpoint
    _, resumed_losses = train(resumed, training_args(tmp_path / "full", **args), callbacks=plugin(),
                              resume=str(tmp_path / "full" / "checkpoint-3"))
    assert_close(full_losses[-len(resumed_losses):], resumed_losses, adapters(full), adapters(resumed))


def test_saved_adapters_load_with_plain_peft(tmp_path):
    model = lora(tiny_model("llama"))
    train(model, training_args(tmp_path / "mt", max_steps=2), callbacks=[MegaTrainPlugin(base_quantization="int8")])
    model.save_pretrained(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path / "adapter"))
    mine = adapters(model)
    theirs = adapters(loaded)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)


def test_from_pretrained_quantizes_from_the_checkpoint(tmp_path):
    """A save_pretrained folder (bf16 on disk) read chunk by chunk into the quantized flats: the same
    bytes as quantizing the loaded model."""
    import megatrain_hf

    tiny_model("llama").to(torch.bfloat16).save_pretrained(tmp_path / "base")
    config = MegaTrainConfig(base_quantization="nf4", device="cpu")
    deferred = lora(megatrain_hf.from_pretrained(tmp_path / "base"))
    engine = attach(deferred, config)
    loaded = lora(tiny_model("llama").to(torch.bfloat16).float())
    reference = attach(loaded, config)
    for u in range(len(engine.store.buffers)):
        a, b = engine.store.buffers[u].frozen_host, reference.store.buffers[u].frozen_host
        assert a.keys() == b.keys()
        assert all(torch.equal(a[d], b[d]) for d in a)
    assert torch.uint8 in engine.store.buffers[1].frozen_host


# ----------------------------------------------------------------------------- refusals
def test_unsupported_scheme_is_refused():
    with pytest.raises(MegatrainConfigError, match=r"base_quantization='fp4'; allowed: 'none', 'int8'.*'nf4'"):
        MegaTrainConfig(base_quantization="fp4")


def test_full_fine_tune_is_refused():
    with pytest.raises(IncompatibleOptionsError, match=r"no module of this LlamaForCausalLM is wrapped by PEFT.*full"):
        attach(tiny_model("llama"), MegaTrainConfig(base_quantization="nf4", device="cpu"))


def test_trainable_base_is_refused():
    model = lora(tiny_model("llama"))
    model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad_(True)
    with pytest.raises(IncompatibleOptionsError, match=r"self_attn\.q_proj\.base_layer\.weight is trainable"):
        attach(model, MegaTrainConfig(base_quantization="int8", device="cpu"))


def test_model_peft_did_not_wrap_is_refused():
    model = tiny_model("llama")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("lm_head"))  # frozen by hand, no PEFT layer
    with pytest.raises(IncompatibleOptionsError,
                       match=r"no module of this LlamaForCausalLM is wrapped by PEFT.*get_peft"):
        attach(model, MegaTrainConfig(base_quantization="nf4", device="cpu"))


def test_nf4_rate():
    fmt = Q.quant_format("nf4", (4096, 4096), torch.bfloat16)
    assert math.isclose(fmt.nbytes / fmt.numel, Q.bytes_per_param("nf4"), rel_tol=1e-4)
    assert Q.quant_format("nf4", (3, 10), torch.bfloat16) is None  # not whole blocks: kept unquantized


# ----------------------------------------------------------------------------- the memory plan
def test_plan_counts_the_quantized_base_as_the_store_lays_it_out():
    from megatrain_hf.memory.fit import largest_preset
    from megatrain_hf.memory.host import GiB
    from megatrain_hf.memory.plan import plan_memory
    from megatrain_hf.memory.shapes import PRESETS

    for scheme in Q.SCHEMES:
        model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=list(
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))))
        engine = attach(model, MegaTrainConfig(base_quantization=scheme, device="cpu"))
        plan = plan_memory(PRESETS["tiny"], seq_len=16, micro_batch=1, compute_dtype="fp32", lora_rank=4,
                           base_quantization=scheme)
        moments = plan.host_exp_avg + plan.host_exp_avg_sq  # HostAdamW's, allocated with the optimizer
        assert plan.host_total - moments == engine.store.host_bytes(), scheme
        assert plan.host_frozen < plan.frozen_params * (2 if scheme == "nf4" else 3)  # fp32 base: 4 B/param
        assert plan.gpu_breakdown()["dequant"] > 0
        engine.detach()
    assert largest_preset(125 * GiB, lora_rank=16) == "qwen2.5-14b"  # a 70 B bf16 base is 129 GiB
    assert largest_preset(125 * GiB, lora_rank=16, base_quantization="nf4") == "mistral-large-123b"
    with pytest.raises(IncompatibleOptionsError, match="full fine-tune.*--lora-rank"):
        plan_memory(PRESETS["tiny"], seq_len=16, micro_batch=1, base_quantization="nf4")


# ----------------------------------------------------------------------------- seeded random init, drawn at attach
def test_from_config_draws_the_same_weights_whatever_reads_them(monkeypatch):
    """A model of a config whose weights are drawn into the store at attach: NF4 from the draw in
    chunks equals NF4 of the same draw in full; unquantized weights are the draw itself."""
    import megatrain_hf
    from megatrain_hf.models import random_init

    config = tiny_model("llama").config
    monkeypatch.setattr(random_init, "BLOCK_ELEMENTS", 1000)  # blocks not aligned with anything
    plain = megatrain_hf.from_config(config, seed=3)
    engine = attach(plain, MegaTrainConfig(device="cpu"))
    weights = {n: p.detach().clone() for n, p in plain.named_parameters()}
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    assert 0.015 < weights["model.layers.0.mlp.up_proj.weight"].std().item() < 0.025
    assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"], weights["model.layers.1.mlp.up_proj.weight"])
    engine.detach()
    monkeypatch.setattr(Q, "CHUNK_ELEMENTS", 448)  # quantizer chunks across the draw's blocks
    model = lora(megatrain_hf.from_config(config, seed=3))
    engine = attach(model, MegaTrainConfig(device="cpu", base_quantization="nf4"))
    checked = 0
    for u in range(len(engine.store.entries)):
        for e in engine.store.entries_of(u, Kind.FROZEN):
            if e.quant is None:
                continue
            region = engine.store.buffers[u].frozen_host[e.wire][e.offset : e.offset + e.numel]
            name = f"model.layers.{u - 1}." + e.name.replace("base_layer.", "")  # unit u is layer u - 1
            _, expected = quantized("nf4", weights[name])
            assert torch.equal(region, expected), name
            checked += 1
    assert checked == 2 * len(TARGETS)


# ----------------------------------------------------------------------------- checkpoints bitsandbytes quantized
def _bnb_folder(tmp_path, scheme: str, F=None) -> str:
    """A save_pretrained folder of the tiny Llama whose TARGETS linears are stored as bitsandbytes
    stores them (``QuantState.as_dict(packed=True)`` / ``Int8Params``' CB and SCB): made by bitsandbytes
    when ``F`` (its functional module) is given, else by our quantizer in bitsandbytes' format."""
    import json

    from safetensors.torch import save_file

    model = tiny_model("llama")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in list(state):
        module = name[: -len(".weight")]
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        w = state.pop(name)
        if scheme == "int8":
            if F is not None:
                cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16))
            else:
                fmt, raw = quantized("int8", w)
                cb, scb = (t.clone() for t in Q._pieces(fmt, raw))
                cb = cb.view(w.shape)
            state.update({name: cb, module + ".SCB": scb, module + ".weight_format": torch.tensor(0, dtype=torch.uint8)})
            continue
        if F is not None:
            packed, qs = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
            codes, absmax, absmax2, offset = packed, qs.absmax, qs.state2.absmax, qs.offset.item()
        else:
            fmt, raw = quantized("nf4", w)
            codes, absmax, absmax2, off = (t.clone() for t in Q._pieces(fmt, raw))
            codes, offset = codes.view(-1, 1), off.item()
        meta = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": list(w.shape),
                "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": offset}
        state.update({name: codes, name + ".absmax": absmax, name + ".quant_map": Q.table("nf4").clone(),
                      name + ".nested_absmax": absmax2, name + ".nested_quant_map": Q.dynamic_map(),
                      name + ".quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(meta).encode()),
                                                                            dtype=torch.uint8)})
    folder = tmp_path / f"bnb-{scheme}"
    model.config.save_pretrained(folder)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("scheme", Q.SCHEMES)
def test_a_checkpoint_bitsandbytes_quantized_is_read_as_stored(tmp_path, scheme):
    """The stored codes become the store's bytes (no requantization): the same bytes as quantizing the
    unquantized weights (which our quantizer and bitsandbytes' agree on), and training runs on them."""
    import megatrain_hf

    F = _bitsandbytes()
    for maker in (None, F) if F is not None else (None,):
        folder = _bnb_folder(tmp_path / ("bnb" if maker else "ours"), scheme, maker)
        model = lora(megatrain_hf.from_pretrained(folder))
        engine = attach(model, MegaTrainConfig(base_quantization=scheme, device="cpu"))
        reference = attach(lora(tiny_model("llama")), MegaTrainConfig(base_quantization=scheme, device="cpu"))
        for u in range(1, 3):
            for e, r in zip(engine.store.entries_of(u, Kind.FROZEN), reference.store.entries_of(u, Kind.FROZEN)):
                if e.quant is None:
                    continue
                mine = engine.store.buffers[u].frozen_host[e.wire][e.offset : e.offset + e.numel]
                theirs = reference.store.buffers[u].frozen_host[r.wire][r.offset : r.offset + r.numel]
                values = Q.dequantize(e.quant, mine), Q.dequantize(r.quant, theirs)
                if maker is None or scheme == "int8":
                    assert torch.equal(mine, theirs), e.name
                assert torch.equal(*values) if maker is None else (values[0] - values[1]).abs().max() < 1e-2
    with pytest.raises(IncompatibleOptionsError, match=rf"bitsandbytes as \['{scheme}'\] but base_quantization='none'"):
        attach(lora(megatrain_hf.from_pretrained(folder)), MegaTrainConfig(device="cpu"))
