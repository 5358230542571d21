"""Long context: sequence-tiled MLP, checkpoints every k-th layer, packed sequences (CPU, fp32).

Tiling and ``checkpoint_interval`` change where activations live, never the math: every logged
loss and final parameter stays within 1e-6 of plain Trainer's (fp32).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import assert_close_losses, assert_close_params, state_of, tiny_model, train, training_args
from megatrain_hf import MegaTrainConfig, MegaTrainPlugin
from megatrain_hf.runtime import tiling
from megatrain_hf.errors import MegatrainConfigError, TrainingDataError

ATOL_FP32 = 1e-6


@pytest.fixture
def tile_calls(monkeypatch):
    """Counts the tile loops run (the forwards of TiledTokens: streamed forwards and recomputes) by
    (tokens of the sequence dimension, positions per tile)."""
    calls = []
    loop = tiling._tile_loop

    def counted(fn, inputs, rows):
        calls.append((inputs[0].shape[1], rows))
        return loop(fn, inputs, rows)

    monkeypatch.setattr(tiling, "_tile_loop", counted)
    return calls


@pytest.fixture
def layer_calls(monkeypatch):
    """Counts the decoder-layer calls tiled whole (a family's layer recipe)."""
    from megatrain_hf.runtime import streamed_call

    calls = []
    whole = streamed_call.tiled_layer
    monkeypatch.setattr(streamed_call, "tiled_layer", lambda *a: calls.append(type(a[1]).__name__) or whole(*a))
    return calls


@pytest.mark.parametrize("family,extra", [
    ("llama", {}),  # GQA: 4 query heads, 2 key/value heads
    ("qwen2", {}),  # q/k/v biases
    ("mistral", {}),  # sliding window of 8 over 16 tokens
    ("gemma2", {}),  # sliding-window layers, attention soft-capping, norms around attention and MLP
    ("qwen3", {}),  # q/k norms
    ("llama", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8)),  # multi-query
])
def test_tiled_layers_match_plain_trainer(family, extra, tmp_path, tile_calls, layer_calls):
    """Every per-token operation of each decoder layer over tiles of 5 tokens (attention dropout
    replayed): the same losses and parameters as plain Trainer (fp32, 1e-6)."""
    ref = tiny_model(family, **extra)
    _, ref_losses = train(ref, training_args(tmp_path / "ref"))
    model = tiny_model(family, **extra)
    _, losses = train(model, training_args(tmp_path / "mt"), callbacks=[MegaTrainPlugin(sequence_tile_tokens=5)])
    # 6 steps x 2 micro-batches x 2 layers, forward + recompute, each layer one pre and one post tile loop;
    # 2 rows of 16 tokens: 5 tokens a tile -> 2 positions of both rows
    assert len(layer_calls) == 48 and set(layer_calls) == {type(ref.model.layers[0]).__name__}
    assert len(tile_calls) == 96 and set(tile_calls) == {(16, 2)}
    assert_close_losses(ref_losses, losses, ATOL_FP32)
    assert_close_params(*_split_key_bias(state_of(ref), state_of(model)), ATOL_FP32)


@pytest.mark.parametrize("family", ["phi3", "mixtral"])
def test_families_without_a_recipe_tile_the_mlp(family, tmp_path, tile_calls, layer_calls, caplog):
    """A layer without a recipe runs whole but for its MLP (if tileable), the reason logged once."""
    import logging

    ref = tiny_model(family)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", max_steps=2))
    model = tiny_model(family)
    with caplog.at_level(logging.INFO, logger="megatrain_hf.runtime.streamed_call"):
        _, losses = train(model, training_args(tmp_path / "mt", max_steps=2),
                          callbacks=[MegaTrainPlugin(sequence_tile_tokens=5)])
    assert not layer_calls
    assert len(tile_calls) == (0 if family == "mixtral" else 16)  # experts run whole
    assert_close_losses(ref_losses, losses, ATOL_FP32)
    assert_close_params(state_of(ref), state_of(model), ATOL_FP32)


def test_a_hooked_layer_falls_back_with_its_reason(tmp_path, layer_calls, caplog):
    import logging

    model = tiny_model("llama")
    model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda *a: None)
    with caplog.at_level(logging.INFO, logger="megatrain_hf.runtime.streamed_call"):
        train(model, training_args(tmp_path / "mt", max_steps=1), callbacks=[MegaTrainPlugin(sequence_tile_tokens=5)])
    assert layer_calls == ["LlamaDecoderLayer"] * 4  # layer 0 only: forward and recompute of 2 micro-batches
    reasons = [r.getMessage() for r in caplog.records if "only its MLP sequence-tiled" in r.getMessage()]
    assert len(reasons) == 1 and "self_attn.o_proj has hooks" in reasons[0]


def _split_key_bias(ref: dict, got: dict) -> tuple[dict, dict]:
    """The parameters to compare within 1e-6, after checking the key-projection biases (Qwen2) apart.

    A key bias shifts every logit of a query by the same amount, which softmax ignores: its exact
    gradient is zero, the computed one rounding noise, and AdamW divides that noise by its own
    magnitude, so any change in summation order (here: the tiles, upstream of it) moves the bias by
    up to the learning rate's order. It is held to 1e-5 instead.
    """
    for name in [n for n in ref if n.endswith("k_proj.bias")]:
        torch.testing.assert_close(got.pop(name), ref.pop(name), atol=1e-5, rtol=0)
    return ref, got


class _GatedMLP(nn.Module):
    def __init__(self, hidden: int = 16, inter: int = 40) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _GatedMLP()


def _grads(layer, x, tile, dtype=None):
    x = x.detach().requires_grad_(True)
    with tiling.tiled(layer, tile), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = layer.mlp(x)
    out.float().pow(2).sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    return out.detach().float(), grads


@pytest.mark.parametrize("dtype,atol", [(None, 1e-6), (torch.bfloat16, 3e-2)])
def test_tiled_mlp_function(dtype, atol):
    """TiledMLP alone: output, input and weight gradients of uneven tiles match the whole MLP (fp32
    within 1e-6; bf16 autocast within its rounding)."""
    torch.manual_seed(0)
    layer, x = _Layer(), torch.randn(3, 11, 16)
    ref_out, ref_grads = _grads(layer, x, None, dtype)
    out, grads = _grads(layer, x, 4, dtype)
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=0)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=atol * max(1.0, b.abs().max().item()), rtol=0)


def test_untileable_mlps_run_whole():
    layer = _Layer()
    assert tiling.tileable_mlp(layer) is layer.mlp
    layer.mlp.register_forward_hook(lambda *a: None)
    assert tiling.tileable_mlp(layer) is None  # a hook would see tiles instead of the whole call
    moe = tiny_model("mixtral").model.layers[0]
    assert tiling.tileable_mlp(moe) is None  # experts are not nn.Linear: routed per token but run whole


def test_sequence_tile_tokens_option():
    assert MegaTrainConfig().sequence_tile_tokens == "auto"
    assert MegaTrainConfig(sequence_tile_tokens=None).sequence_tile_tokens is None
    for bad in (0, -4, "big", True, 2.5):
        with pytest.raises(MegatrainConfigError, match="sequence_tile_tokens"):
            MegaTrainConfig(sequence_tile_tokens=bad)


@pytest.mark.parametrize("family,interval,offload,again", [
    ("llama", 2, False, 3),  # chain: embedding, 4 layers, norm, head (its own kernel: kept); L0, L2, norm recomputed
    ("llama", 3, True, 4),  # offloaded checkpoints: the kept ones come back from the host
    ("gemma3_text", 3, False, 4),
    ("llama", 2, "layer_major", 3),
    ("mixtral", 2, False, 3),  # the router logits HF's hooks capture: recorded once, differentiated  # no dropout: both micro-batches of a step go through each layer together
])
def test_checkpoint_interval_matches_plain_trainer(family, interval, offload, again, tmp_path, monkeypatch):
    """Checkpoints of every k-th unit only (the rest recomputed in the backward), attention dropout
    replayed: the same losses and parameters as plain Trainer."""
    from megatrain_hf.runtime.streamed_call import UnitRunner

    calls = []
    forward_again = UnitRunner.forward_again
    monkeypatch.setattr(UnitRunner, "forward_again", lambda self, call, x: calls.append(call.unit)
                        or forward_again(self, call, x))
    extra = dict(attention_dropout=0.0) if offload == "layer_major" else {}
    ref = tiny_model(family, num_hidden_layers=4, **extra)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", max_steps=3))
    model = tiny_model(family, num_hidden_layers=4, **extra)
    options = dict(layer_major=True) if offload == "layer_major" else dict(offload_checkpoints=offload)
    plugin = MegaTrainPlugin(checkpoint_interval=interval, **options)
    trainer, losses = train(model, training_args(tmp_path / "mt", max_steps=3), callbacks=[plugin])
    assert len(calls) == again * 6, calls  # per micro-batch: the inputs recomputed, 3 steps x 2 micro-batches
    assert_close_losses(ref_losses, losses, ATOL_FP32)
    assert_close_params(state_of(ref), state_of(model), ATOL_FP32)


class _Documents(torch.utils.data.Dataset):
    """Token sequences of 5 to 16 tokens (labels = inputs)."""

    def __init__(self, n: int = 24) -> None:
        g = torch.Generator().manual_seed(3)
        lengths = torch.randint(5, 17, (n,), generator=g).tolist()
        self.docs = [torch.randint(3, 128, (length,), generator=g).tolist() for length in lengths]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.docs[i], "labels": list(self.docs[i])}


def _pad(features: list[dict]) -> dict:
    longest = max(len(f["input_ids"]) for f in features)
    out = {"input_ids": [], "labels": [], "attention_mask": []}
    for f in features:
        pad = longest - len(f["input_ids"])
        out["input_ids"].append(f["input_ids"] + [0] * pad)
        out["labels"].append(f["labels"] + [-100] * pad)
        out["attention_mask"].append([1] * len(f["input_ids"]) + [0] * pad)
    return {k: torch.tensor(v) for k, v in out.items()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_padded_batches_tiled(family, tmp_path, layer_calls):
    """Padded rows (attention mask, labels -100) through tiled layers: as plain Trainer."""
    args = dict(max_steps=4, learning_rate=1e-3)
    ref = tiny_model(family)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", **args), dataset=_Documents(), data_collator=_pad)
    model = tiny_model(family)
    _, losses = train(model, training_args(tmp_path / "mt", **args), dataset=_Documents(), data_collator=_pad,
                      callbacks=[MegaTrainPlugin(sequence_tile_tokens=3)])
    assert layer_calls
    assert_close_losses(ref_losses, losses, ATOL_FP32)
    assert_close_params(*_split_key_bias(state_of(ref), state_of(model)), ATOL_FP32)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_packed_batches_match_padded_ones(family, tmp_path, layer_calls):
    """HF's flattening collator (one row, position_ids restarting per document, SDPA's packed mask)
    under megatrain, tiled: the same losses and parameters as plain Trainer on padded batches."""
    from transformers import DataCollatorWithFlattening

    args = dict(max_steps=4, learning_rate=1e-3)
    ref = tiny_model(family, attention_dropout=0.0)
    _, ref_losses = train(ref, training_args(tmp_path / "ref", **args), dataset=_Documents(), data_collator=_pad)
    model = tiny_model(family, attention_dropout=0.0)
    packed = []
    collator = DataCollatorWithFlattening(return_position_ids=True)

    def flatten(features):
        batch = collator(features)
        packed.append(batch["input_ids"].shape)
        return batch

    _, losses = train(model, training_args(tmp_path / "mt", **args), dataset=_Documents(), data_collator=flatten,
                      callbacks=[MegaTrainPlugin(sequence_tile_tokens=7)])
    assert packed and all(shape[0] == 1 for shape in packed)  # really one packed row per micro-batch
    assert layer_calls  # the layers tiled whole
    assert_close_losses(ref_losses, losses, ATOL_FP32)
    assert_close_params(state_of(ref), state_of(model), ATOL_FP32)


@pytest.mark.parametrize("rope,allowed", [
    ({"rope_type": "linear", "factor": 2.0}, 128),  # 2 x max_position_embeddings=64
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128),
    ({"rope_type": "dynamic", "factor": 2.0}, None),  # dynamic NTK rescales to any length
])
def test_rope_scaling_sets_the_sequence_limit(rope, allowed):
    """Past max_position_embeddings: allowed up to what the rope scaling allows, refused beyond, and the
    refusal names the scaling."""
    from megatrain_hf import attach

    model = tiny_model("llama", rope_parameters={**rope, "rope_theta": 10000.0})
    engine = attach(model, device="cpu")
    ids = torch.randint(0, 128, (1, 72))  # past max_position_embeddings=64
    model(input_ids=ids, labels=ids).loss.backward()
    if allowed is not None:
        ok = torch.randint(0, 128, (1, allowed))
        model(input_ids=ok, labels=ok).loss.backward()
        long = torch.randint(0, 128, (1, allowed + 1))
        with pytest.raises(TrainingDataError, match=rf"{allowed + 1} tokens, more than what the config's rope scaling "
                                             rf"allows \({rope['rope_type']} x{rope['factor']} .* = {allowed}"):
            model(input_ids=long, labels=long)
    engine.detach()


def test_plan_arithmetic_at_512k_tokens():
    """The plan at 512K tokens of Qwen2.5-7B's shape: the chunked loss holds one chunk of logits (not
    512K x 152K), tiling bounds the MLP's share, every k-th checkpoint cuts the checkpoints."""
    from megatrain_hf.memory import activations
    from megatrain_hf.memory.plan import plan_memory
    from megatrain_hf.memory.shapes import PRESETS

    shape, seq = PRESETS["qwen2.5-7b"], 524288
    plan = plan_memory(shape, seq_len=seq, micro_batch=1)
    assert plan.gpu_logits == (2**26 // 152064) * 152064 * 14 < 2**30  # one chunk: 441 tokens
    assert plan.sequence_tile_tokens == 4096
    untiled = plan_memory(shape, seq_len=seq, micro_batch=1, sequence_tile_tokens=None)
    h, q, kv, c = shape.hidden, shape.q_dim, shape.kv_dim, 2
    assert untiled.gpu_layer_working_set == seq * (c * (2 * h + 2 * q + 2 * kv) + 24 * h + 6 * c * shape.intermediate)
    # tiled whole: q, k, v, attention output (+ copy), their grads, fp32 dq, fp32 grad out (which takes grad in;
    # the recomputed output is freed); one tile
    full = seq * (c * (5 * q + 4 * kv) + 4 * q + 4 * h)
    tile = 4096 * (6 * c * shape.intermediate + c * (2 * h + 3 * q + 3 * kv) + 24 * h)
    assert plan.gpu_layer_working_set == full + tile
    assert plan.gpu_layer_working_set < untiled.gpu_layer_working_set / 2
    every4 = plan_memory(shape, seq_len=seq, micro_batch=1, checkpoint_interval=4)
    assert every4.gpu_checkpoints == (8 + 1) * seq * shape.hidden * 4  # ceil(29 / 4) of layers + norm, the head
    assert every4.gpu_recomputed_inputs == 3 * seq * shape.hidden * 4
    assert activations.resolve_tile("auto", 4096, 4096, 14336, 2) is None  # one tile: untiled
    assert activations.resolve_tile("auto", 8192, 4096, 14336, 2, budget_bytes=8 * 2**30) == 998  # 2% of 8 GiB
    # a small whole MLP is not tiled (tiling costs an MLP forward per layer): 1.36 B at 16K tokens, 1.1 GB
    assert activations.resolve_tile("auto", 16384, 2048, 5632, 2) is None
    assert activations.resolve_tile("auto", 65536, 4096, 11008, 2) == 4096  # 7 B at 64K tokens: 8.7 GB whole
    assert activations.resolve_tile("auto", 16384, 2048, 5632, 2, budget_bytes=8 * 2**30) is not None  # > 10%


def test_estimate_shows_long_context(capsys):
    from megatrain_hf.cli import main

    assert main(["estimate", "--model", "llama3-8b", "--seq-len", "524288", "--gpu-gib", "139", "--host-gib", "125",
                 "--no-host-staging"]) == 0
    out = capsys.readouterr().out
    assert "one layer's recompute, MLP in 128 tiles of 4096 tokens" in out
    assert "logits chunk (523 tokens x vocab 128256)" in out
    assert "longest sequence that fits a 139.00 GiB GPU and 125.00 GiB host RAM:" in out


def test_eager_attention_is_refused_at_long_context():
    """A 16K-token training sequence with HF's eager attention (scores materialised) is refused with
    the fix, before any layer computes; shorter ones and SDPA pass the rule."""
    from megatrain_hf import attach
    from megatrain_hf.errors import AttentionKernelError

    model = tiny_model("llama", attn_implementation="eager", max_position_embeddings=32768)
    engine = attach(model, device="cpu")
    short = torch.randint(0, 128, (1, 32))
    model(input_ids=short, labels=short).loss.backward()
    long = torch.randint(0, 128, (1, 16384))
    with pytest.raises(AttentionKernelError, match="attn_implementation='eager'.*Fix: .*'sdpa'"):
        model(input_ids=long, labels=long)
    engine.plan.check(seq_len=16384, attention="sdpa")  # the flash-capable kernel passes
    engine.detach()
