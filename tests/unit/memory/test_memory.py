"""The memory planner: parameter counts, host tiers exact against the real store, GPU estimate
shape, the MemoryError path and the `megatrain estimate` CLI. CPU only, no network, fast."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

from tests.helpers import FAMILY_CONFIGS, tiny_model
from megatrain_hf import MegaTrainConfig, attach, memory
from megatrain_hf.cli.estimate import estimate_main
from megatrain_hf.errors import HostMemoryError, MegatrainConfigError, UnsupportedModelError
from megatrain_hf.memory import (
    GiB,
    PRESETS,
    ModelShape,
    check_host_memory,
    host_breakdown_for_units,
    largest_model,
    largest_preset,
    plan_memory,
)

TINY_KW = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    tie_word_embeddings=False,
)
# sizes that are not multiples of 16 elements, so the 64-byte alignment of the store shows
ODD_KW = dict(
    hidden_size=72,
    intermediate_size=100,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=101,
)


def _units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder()
    mods = [decoder.embed_tokens, *decoder.layers, decoder.norm, base.get_output_embeddings()]
    return [(f"unit{i}", m) for i, m in enumerate(mods)]


def _store_tiers(model: torch.nn.Module, dtype: torch.dtype, experts_dtype: str = "auto") -> dict[str, int]:
    """Bytes the real HostStore allocates (+ HostAdamW's two moments, same numel as the masters),
    as the engine builds it (the family's units, the routed experts' dtype the plan decides)."""
    config = MegaTrainConfig(compute_dtype="bf16" if dtype == torch.bfloat16 else "fp32", experts_dtype=experts_dtype,
                             check_host_memory=False)
    engine = attach(model, config, device="cpu")
    hs = engine.store
    staging = sum(b.staging_host.numel() * b.staging_host.element_size() for b in hs.buffers
                  if b.staging_host is not None)
    frozen = sum(t.numel() * t.element_size() for b in hs.buffers for t in b.frozen_host.values())
    masters = hs.trainable_numel() * 4
    assert hs.host_bytes() == 2 * masters + staging + frozen
    engine.detach()
    return {"master": masters, "grad": masters, "exp_avg": masters, "exp_avg_sq": masters,
            "staging": staging, "frozen": frozen, "checkpoints": 0}  # no offloaded checkpoints


# ------------------------------------------------------------------------------------ shapes
def test_preset_parameter_counts_match_published_figures():
    published = {
        "llama-1.36b": 1.36e9,
        "llama-3.14b": 3.14e9,
        "llama-7b": 6.74e9,
        "llama-13b": 13.0e9,
        "qwen2.5-14b": 14.7e9,
        "llama-70b": 69.0e9,
    }
    for name, expected in published.items():
        assert PRESETS[name].params() == pytest.approx(expected, rel=0.01), name
    # exact counts of the released checkpoints
    assert PRESETS["llama-7b"].params() == 6_738_415_616
    assert PRESETS["llama-13b"].params() == 13_015_864_320
    assert PRESETS["llama-70b"].params() == 68_976_648_192
    assert PRESETS["qwen2.5-14b"].params() == 14_770_033_664


def test_tiny_preset_is_the_tests_llama():
    config = transformers.LlamaConfig(**TINY_KW)
    model = transformers.LlamaForCausalLM(config)
    shape = ModelShape.from_hf_config(config, name="tiny")
    assert shape == PRESETS["tiny"]
    assert PRESETS["tiny"].params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_params_exact_for_every_supported_family(family):
    model = tiny_model(family)
    shape = ModelShape.from_hf_config(model.config)
    assert shape.params() == sum(p.numel() for p in model.parameters())  # tied counted once
    # the raw config.json dict gives the same shape
    assert ModelShape.from_hf_config(model.config.to_dict()).params() == shape.params()


def test_from_hf_config_nested_text_config_and_unknown_moe_refused():
    nested = {"model_type": "gemma3", "text_config": {**ODD_KW, "model_type": "gemma3_text", "head_dim": 16}}
    shape = ModelShape.from_hf_config(nested)
    assert (shape.hidden, shape.head_dim, shape.qk_norm, shape.norms_per_layer, shape.tied) == (72, 16, True, 4, True)
    with pytest.raises(UnsupportedModelError, match="the experts of mixtral, olmoe, qwen2_moe and qwen3_moe only"):
        ModelShape.from_hf_config({**ODD_KW, "model_type": "deepseek_v3", "n_routed_experts": 8})
    with pytest.raises(UnsupportedModelError, match="hidden_size"):
        ModelShape.from_hf_config({"model_type": "llama"})


def _odd(family: str, **extra):
    """``family``'s tiny model at sizes that are not multiples of 16 (the store's alignment shows)."""
    sizes = dict(hidden_size=72, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, vocab_size=101)
    moe = {"intermediate_size": 20} if family in ("mixtral", "olmoe") else {"moe_intermediate_size": 20}
    if family in ("mixtral", "olmoe", "qwen3_moe", "qwen2_moe"):
        sizes.update(moe, num_experts_per_tok=2)
    else:
        sizes["intermediate_size"] = 100
    if family == "qwen2_moe":
        sizes.update(shared_expert_intermediate_size=36, mlp_only_layers=[1], intermediate_size=100)
    if family == "smollm3":
        sizes["no_rope_layers"] = [0, 1, 1]
    if family == "gpt2":
        sizes = dict(hidden_size=72, num_attention_heads=4, num_hidden_layers=3, vocab_size=101, n_inner=100)
    if family == "qwen3_moe":
        sizes.update(head_dim=18, decoder_sparse_step=2, intermediate_size=100)  # layers 0, 2 dense
    return tiny_model(family, **{**sizes, **extra})


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_host_plan_is_exact_for_every_family(family, dtype):
    """The plan from the config alone equals what the real store allocates, for every family's
    layout (fused projections, full-width q/k norms, biased LayerNorms, routed and shared experts,
    dense layers between MoE layers), at sizes where the alignment shows."""
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = _odd(family)
    shape = ModelShape.from_hf_config(model.config)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    assert ModelShape.from_hf_config(model.config.to_dict()) == shape  # config.json's dict: the same shape
    plan = plan_memory(shape, seq_len=8, micro_batch=1, compute_dtype=dtype)
    assert plan.host_breakdown() == _store_tiers(model, torch_dtype)


def test_moe_shapes_count_every_expert():
    """Every expert of every MoE layer lives in host RAM: Mixtral-8x7B's published 46.7 B, and the
    dense layers of Qwen2/3-MoE sized as dense."""
    mixtral = ModelShape.from_hf_config(dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False))
    assert mixtral.params() == 46_702_792_704
    qwen3 = ModelShape.from_hf_config(dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False))
    assert qwen3.params() == 30_532_122_624  # Qwen3-30B-A3B
    sparse = ModelShape.from_hf_config({**qwen3.to_dict(), "model_type": "qwen3_moe", "hidden_size": 2048,
                                        "intermediate_size": 6144, "moe_intermediate_size": 768,
                                        "num_hidden_layers": 4, "num_attention_heads": 32, "vocab_size": 151936,
                                        "num_experts": 128, "mlp_only_layers": [0]})
    assert sparse.dense_layers == (0,)
    assert sparse.layer_params(0) < sparse.layer_params(1)


# ------------------------------------------------------------------------------------ host plan
@pytest.mark.parametrize("kw", [TINY_KW, ODD_KW], ids=["tiny", "odd-sizes"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_host_plan_is_exact_against_the_real_store(kw, dtype):
    config = transformers.LlamaConfig(**kw)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    plan = plan_memory(ModelShape.from_hf_config(config), seq_len=8, micro_batch=1, compute_dtype=dtype)
    from_units = host_breakdown_for_units(_units(transformers.LlamaForCausalLM(config)), compute_dtype=torch_dtype)
    real = _store_tiers(transformers.LlamaForCausalLM(config), torch_dtype)
    assert plan.host_breakdown() == real
    assert from_units == {k: v for k, v in real.items() if k != "checkpoints"}  # not known at attach
    assert plan.host_total == sum(real.values())
    if dtype == "fp32":
        assert plan.host_staging == 0 and plan.bytes_per_trainable_param == pytest.approx(16, rel=0.01)


@pytest.mark.parametrize("experts_dtype", ["auto", "compute"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_host_plan_is_exact_for_either_experts_dtype(family, experts_dtype):
    """fp32 routed experts ("auto" under transformers' grouped_mm) have no staging copy; the planner lays them
    out as the engine's store does, and "compute" gives them one (bf16 on the wire like every matrix)."""
    model = _odd(family)
    shape = ModelShape.from_hf_config(model.config)
    assert shape.experts_kernel == model.config._experts_implementation == "grouped_mm"
    plan = plan_memory(shape, seq_len=8, micro_batch=1, experts_dtype=experts_dtype)
    assert plan.host_breakdown() == _store_tiers(model, torch.bfloat16, experts_dtype)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    other = plan_memory(shape, seq_len=8, micro_batch=1, experts_dtype="compute" if experts_dtype == "auto" else "auto")
    staged = 1 if experts_dtype == "compute" else -1
    assert plan.host_staging - other.host_staging == staged * 2 * experts  # the experts' bf16 copy, alignment aside
    assert (plan.gpu_weight_slots < other.gpu_weight_slots) == (experts_dtype == "compute")


def test_lora_plan_is_exact_with_fp32_experts():
    """LoRA on an MoE model: the frozen experts are stored in their wire dtype, fp32 under "auto" (4 B each
    instead of 2), as the planner counts them."""
    peft = pytest.importorskip("peft")
    shape = ModelShape.from_hf_config(_odd("mixtral").config)
    frozen = {}
    for experts_dtype in ("auto", "compute"):
        model = peft.get_peft_model(_odd("mixtral"), peft.LoraConfig(
            r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0))
        plan = plan_memory(shape, seq_len=8, micro_batch=1, lora_rank=4, experts_dtype=experts_dtype)
        assert plan.host_breakdown() == _store_tiers(model, torch.bfloat16, experts_dtype)
        frozen[experts_dtype] = plan.host_frozen
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert frozen["auto"] - frozen["compute"] == 2 * experts


def test_host_plan_is_exact_for_tied_embeddings():
    model = tiny_model("gemma")  # tied lm_head: counted once, no staging (fp32 embedding)
    plan = plan_memory(ModelShape.from_hf_config(model.config), seq_len=8, micro_batch=1)
    assert plan.host_breakdown() == _store_tiers(model, torch.bfloat16)


def test_lora_plan_is_exact_against_the_real_store():
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(**ODD_KW)
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(config),
        peft.LoraConfig(r=4, target_modules=list(memory.LORA_TARGETS), lora_dropout=0.0),
    )
    plan = plan_memory(ModelShape.from_hf_config(config), seq_len=8, micro_batch=1, lora_rank=4)
    assert plan.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.total_params == sum(p.numel() for p in model.parameters())
    assert plan.host_breakdown() == _store_tiers(model, torch.bfloat16)


def test_llama7b_bf16_bytes_per_parameter():
    shape = PRESETS["llama-7b"]
    p = shape.params()
    plan = plan_memory(shape, seq_len=4096, micro_batch=1, compute_dtype="bf16")
    # 16 B/param: fp32 master, grad, exp_avg, exp_avg_sq (every size here is a multiple of 16: exact)
    for tier in (plan.host_master, plan.host_grad, plan.host_exp_avg, plan.host_exp_avg_sq):
        assert tier == 4 * p
    # + 2 B staging for the matrices of the layers and lm_head (not the embedding, not the vectors)
    matrices = shape.layers * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 32000 * 4096
    assert plan.host_staging == 2 * matrices
    assert plan.host_frozen == 0
    assert plan.bytes_per_trainable_param == pytest.approx(17.96, abs=0.01)
    assert plan.host_total / GiB == pytest.approx(112.72, abs=0.01)  # no pinned slabs: sums go through the GPU
    fp32 = plan_memory(shape, seq_len=4096, micro_batch=1, compute_dtype="fp32")
    assert fp32.host_total == 16 * p and fp32.bytes_per_trainable_param == 16


def test_lora_70b_host_is_mostly_bf16_base_weights():
    plan = plan_memory(PRESETS["llama-70b"], seq_len=4096, micro_batch=1, lora_rank=16)
    assert plan.trainable_params < 0.005 * plan.total_params
    # ~2 B/param: bf16 base matrices; the fp32 embedding and the adapters' 18 B/param add ~3 %
    assert 2.0 < plan.host_total / plan.total_params < 2.1


# ------------------------------------------------------------------------------------ GPU plan
def test_gpu_memory_grows_with_depth_only_through_checkpoints():
    """Doubling the depth adds exactly one fp32 tokens x hidden checkpoint per extra layer;
    weight slots, working set, grads and logits depend on the width and vocab only."""
    base = PRESETS["llama-7b"]
    tokens = 4096
    shallow = plan_memory(base, seq_len=tokens, micro_batch=1)
    deep = plan_memory(base.with_layers(2 * base.layers), seq_len=4096, micro_batch=1)
    assert deep.gpu_total - shallow.gpu_total == base.layers * tokens * base.hidden * 4
    for key in ("weight_slots", "layer_working_set", "weight_grads", "logits", "runtime"):
        assert deep.gpu_breakdown()[key] == shallow.gpu_breakdown()[key], key
    assert deep.host_total > 1.9 * shallow.host_total  # while the host grows with the parameters


def test_gpu_items_follow_batch_and_schedule():
    shape = PRESETS["llama-7b"]
    one = plan_memory(shape, seq_len=4096, micro_batch=1, grad_accum=4, layer_major=False, chunked_loss=False)
    layer_major = plan_memory(shape, seq_len=4096, micro_batch=1, grad_accum=4, chunked_loss=False)
    assert layer_major.gpu_checkpoints == 4 * one.gpu_checkpoints
    assert layer_major.gpu_logits == 4 * one.gpu_logits  # every micro-batch's logits until backward
    chunked = plan_memory(shape, seq_len=4096, micro_batch=1, grad_accum=4)  # the defaults
    assert chunked.gpu_logits == (2**26 // 32000) * 32000 * 14  # one chunk, whatever the schedule
    assert plan_memory(shape, seq_len=4096, micro_batch=1, loss_chunk_tokens=512).gpu_logits == 512 * 32000 * 14
    assert layer_major.host_total == one.host_total  # grad accumulators are fp32 whatever the GA
    # the embedding (fp32 on the wire, 0.49 GiB) is the largest unit of llama-7b: 2 slots of it
    assert one.gpu_weight_slots == 2 * 32000 * 4096 * 4
    assert one.gpu_logits == 4096 * 32000 * 14  # full logits
    two = plan_memory(shape, seq_len=4096, micro_batch=2, sequence_tile_tokens=None)  # untiled: linear in tokens
    assert two.gpu_layer_working_set == 2 * one.gpu_layer_working_set


def test_plan_rejects_bad_values_with_the_allowed_ones():
    with pytest.raises(MegatrainConfigError, match=r"compute_dtype='fp16'.*bf16"):
        plan_memory(PRESETS["tiny"], seq_len=8, micro_batch=1, compute_dtype="fp16")
    with pytest.raises(MegatrainConfigError, match="seq_len=0"):
        plan_memory(PRESETS["tiny"], seq_len=0, micro_batch=1)
    with pytest.raises(MegatrainConfigError, match="lora_targets"):
        plan_memory(PRESETS["tiny"], seq_len=8, micro_batch=1, lora_rank=4, lora_targets=["qkv"])
    with pytest.raises(MegatrainConfigError, match="kv_heads"):
        ModelShape(hidden=64, intermediate=128, layers=1, heads=4, kv_heads=3, vocab=10)


def test_table_and_dict():
    plan = plan_memory(PRESETS["llama-7b"], seq_len=4096, micro_batch=1)
    text = plan.table()
    assert "112.72" in text and "25.10" in text and "slab" not in text and "GPU" in text
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["host_total"] == plan.host_total and d["shape"]["params"] == 6_738_415_616


# ------------------------------------------------------------------------------------ checks
def test_check_host_memory_error_shows_the_arithmetic_and_the_fix():
    plan = plan_memory(PRESETS["llama-7b"], seq_len=4096, micro_batch=1)
    with pytest.raises(HostMemoryError) as info:
        check_host_memory(plan.host_total, plan.host_breakdown(), available=64 * GiB)
    msg = str(info.value)
    for number in ("25.10", "12.31", "112.72", "114.72", "64.00", "50.72"):
        assert number in msg, number
    assert "Fix" in msg and "LoRA" in msg and "smaller model" in msg and "check_host_memory=False" in msg
    spare = check_host_memory(plan.host_total, plan.host_breakdown(), available=125 * GiB)
    assert spare == 125 * GiB - plan.host_total - 2 * GiB
    assert plan.check_host(available=125 * GiB) == spare
    assert memory.available_host_bytes() > 0


def test_largest_model_and_preset():
    base = PRESETS["llama-7b"]
    exact = plan_memory(base, seq_len=1, micro_batch=1).host_total + 2 * GiB
    fit = largest_model(exact, base=base)
    assert fit.deepest.layers == 32 and fit.widest.hidden == 4096
    assert largest_model(exact - 1, base=base).deepest.layers == 31
    assert "32 layers" in fit.describe()
    assert largest_model(GiB, base=base).deepest is None
    assert largest_preset(125 * GiB) == "llama-7b"
    assert largest_preset(1024 * GiB) == "qwen2.5-14b"  # 70B needs ~1.2 TB in full precision
    assert largest_preset(GiB) is None
    assert largest_preset(1024 * GiB, lora_rank=16) == "mistral-large-123b"


@pytest.mark.parametrize("options", [dict(host_staging=False), dict(host_staging=False, offload_checkpoints=True)],
                         ids=["no-staging", "no-staging+offload"])
def test_largest_model_plans_with_the_same_options(options):
    """The depth and width searches plan what plan_memory plans with the same options (the bf16
    host copy dropped, offloaded checkpoints counted per layer): the deepest model's host bytes
    are its plan's, and one layer more does not fit."""
    base = PRESETS["llama-7b"]
    kw = dict(seq_len=4096, micro_batch=4, grad_accum=1)
    fit_options = dict(host_staging=False, offload_tokens=4 * 4096 if options.get("offload_checkpoints") else 0)
    fit = largest_model(251 * GiB, base=base, **fit_options)
    deepest = plan_memory(fit.deepest, **kw, **options)
    assert fit.deepest_host_bytes == deepest.host_total <= 249 * GiB
    assert plan_memory(fit.deepest.with_layers(fit.deepest.layers + 1), **kw, **options).host_total > 249 * GiB
    assert fit.widest_host_bytes == plan_memory(fit.widest, **kw, **options).host_total <= 249 * GiB
    # 16 instead of 18 B/param: deeper than with the host copy
    assert fit.deepest.layers > largest_model(251 * GiB, base=base).deepest.layers
    # 16 B/param: 8.03 B fits 125 GiB without the bf16 copy; the offloaded checkpoints leave room for 7.6 B
    assert largest_preset(125 * GiB, **fit_options) == ("qwen2.5-7b" if fit_options["offload_tokens"] else "llama3-8b")


# ------------------------------------------------------------------------------------ CLI
def test_estimate_main_on_a_preset(capsys):
    assert estimate_main(["--model", "llama-7b", "--host-gib", "125"]) == 0
    out = capsys.readouterr().out
    assert "HOST RAM" in out and "112.72" in out and "-> fits" in out
    assert "largest preset that fits (bf16): llama-7b" in out and "deepest: 35 layers" in out
    assert estimate_main(["--model", "llama-7b", "--host-gib", "125", "--no-host-staging"]) == 0
    assert "deepest: 39 layers" in capsys.readouterr().out  # the search drops the bf16 copy too
    assert estimate_main(["--model", "llama-13b", "--host-gib", "125"]) == 0
    assert "does NOT fit" in capsys.readouterr().out


def test_estimate_main_on_a_saved_config(tmp_path, capsys):
    transformers.Qwen2Config(**ODD_KW).save_pretrained(tmp_path)
    expected = ModelShape.from_hf_config(transformers.Qwen2Config(**ODD_KW)).params()
    assert estimate_main(["--model", str(tmp_path), "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "HOST RAM" in out and str(tmp_path) in out
    assert estimate_main(["--model", str(tmp_path / "config.json"), "--json", "--dtype", "fp32"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plan"]["total_params"] == expected and d["plan"]["shape"]["attention_bias"] is True
    assert d["plan"]["host_staging"] == 0 and isinstance(d["fits_host"], bool)


def test_estimate_main_bad_input_exits_2(tmp_path, capsys):
    assert estimate_main(["--model", "llama-8000b"]) == 2
    err = capsys.readouterr().err
    assert "llama-8000b" in err and "llama-7b" in err and "qwen2.5-14b" in err
    assert estimate_main(["--model", str(tmp_path)]) == 2  # a directory without config.json
    assert "config.json" in capsys.readouterr().err
    assert estimate_main(["--model", "tiny", "--dtype", "fp16"]) == 2  # argparse choices
    assert estimate_main(["--model", "tiny", "--seq-len", "0"]) == 2


def test_estimate_writes_a_chart(tmp_path, capsys):
    from megatrain_hf.cli.estimate import estimate_main

    path = tmp_path / "plan.png"
    assert estimate_main(["--model", "llama-7b", "--chart", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "chart written" in capsys.readouterr().out


def test_offloaded_checkpoints_move_from_the_gpu_plan_to_the_host_plan():
    shape = PRESETS["llama-7b"]
    kept = plan_memory(shape, seq_len=4096, micro_batch=2, grad_accum=4)
    off = plan_memory(shape, seq_len=4096, micro_batch=2, grad_accum=4, offload_checkpoints=True)
    checkpoints = 34 * 4 * 8192 * 4096 * 4  # (32 layers + norm + head) x 4 in flight x tokens x hidden x fp32
    assert kept.gpu_checkpoints == checkpoints and kept.host_checkpoints == 0
    assert off.host_checkpoints == checkpoints and off.gpu_checkpoints == 2 * 4 * 8192 * 4096 * 4
    assert off.host_total == kept.host_total + checkpoints
    assert off.bytes_per_trainable_param == kept.bytes_per_trainable_param
    # depth: the offloaded GPU plan does not grow with the layers
    deep = plan_memory(shape.with_layers(64), seq_len=4096, micro_batch=2, grad_accum=4, offload_checkpoints=True)
    assert deep.gpu_total == off.gpu_total


def test_the_host_memory_refusal_shows_small_sizes_in_their_unit():
    """A small model's plan: every tier in KiB / MiB (not "0.00 GiB"), the shortfall too, and the option
    that skips the check named in the fix."""
    from megatrain_hf.memory.host import check_host_memory

    with pytest.raises(HostMemoryError) as err:
        check_host_memory(5 * 2**20 + 3 * 2**10, {"master": 5 * 2**20, "grad": 3 * 2**10}, available=2**20,
                          headroom_bytes=512)
    message = str(err.value)
    assert "0.00 GiB" not in message
    assert "megatrain needs 5.00 MiB of host RAM (+ 512 B headroom) but only 1.00 MiB is available" in message
    assert re.search(r"short by +4\.00 MiB", message) and re.search(r"3\.00 KiB", message)
    assert "check_host_memory=False" in message
