"""Shared test fixtures: tiny models of every supported family, data, and Trainer runs.

Real sizes are far larger (e.g. Llama-2-7B: hidden 4096, 32 layers); these keep the structure
(GQA, biases, q/k norms, sliding-window layer types, tied embeddings, soft-capping) at a size a
2-core CPU trains in seconds. Reference and megatrain runs build their model separately from the
same seed, so one run cannot mask the other.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout's root (what tests run commands and read files from)."""

VOCAB = 128
SEQ = 16

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    attention_dropout=0.1,
)

_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # inside the tiny vocabulary
_MOE = dict(output_router_logits=True, router_aux_loss_coef=0.1, **_TOKENS)

FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "sliding_window": 8, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    ),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    # learned absolute positions (a second embedding unit), Conv1D projections, tied head, dropout 0.1
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"bos_token_id": 0, "eos_token_id": 0, "n_inner": 128}),
    # fused qkv_proj and gate_up_proj, residual dropout after attention and MLP, embedding dropout
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"resid_pdrop": 0.1, "embd_pdrop": 0.1, **_TOKENS}),
    # full-width q/k norms, norms after attention and MLP (none before)
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _TOKENS),
    # embedding, residual and attention multipliers; logits divided by logits_scaling (no chunked loss)
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                                         "attention_multiplier": 0.2, "logits_scaling": 4.0,
                                                         **_TOKENS}),
    # layer 0 without rotary positions (NoPE), tied head
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [0, 1], **_TOKENS}),
    # parallel attention and MLP, bias-free LayerNorm, q/k LayerNorms, tied head, logits x logit_scale
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5, "use_qk_norm": True, **_TOKENS}),
    # LayerNorms and linears with biases, plain (ungated) MLP, residual and embedding dropout, tied head
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"residual_dropout": 0.1, "embedding_dropout": 0.1,
                                                                 "sliding_window": 8, **_TOKENS}),
    # mixture-of-experts, the router's load-balancing loss in the loss (output_router_logits)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "intermediate_size": 32, "sliding_window": 8, **_MOE}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 32, **_MOE}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                  "intermediate_size": 32, **_MOE}),
    # a shared expert with its sigmoid gate beside the routed ones; layer 0 a dense MLP (two layer templates)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 32,
                                                            "shared_expert_intermediate_size": 64,
                                                            "mlp_only_layers": [0], **_MOE}),
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")


def without_dropout(family: str) -> dict:
    """Config overrides that turn off every random draw of ``family`` in training (dropout of any
    name, ``*_pdrop``, router jitter): what layer-major needs to match plain Trainer bitwise."""
    config_name, _, extra = FAMILY_CONFIGS[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **extra})
    return {k: 0.0 for k, v in config.to_dict().items()
            if isinstance(v, float) and (k.endswith("dropout") or k.endswith("pdrop") or k.endswith("jitter_noise"))}


def tiny_model(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    config_name, model_name, extra = FAMILY_CONFIGS[family]
    kwargs = {**_COMMON, **extra, **overrides}
    if family == "gpt2":  # GPT-2 names its dropout probabilities its own way
        p = kwargs.pop("attention_dropout")
        kwargs.update(attn_pdrop=p, resid_pdrop=p, embd_pdrop=p)
    if family in ("gemma2", "gemma3_text"):
        kwargs.setdefault("num_hidden_layers", 2)
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = overrides.get("attn_implementation") or ("eager" if family == "gemma2" else "sdpa")
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    return model.float()


class RandomTokens(Dataset):
    """Deterministic random token sequences (labels = inputs, as in causal LM fine-tuning)."""

    def __init__(self, n: int = 48, seq: int = SEQ, vocab: int = VOCAB, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone(), "attention_mask": torch.ones_like(self.ids[i])}


def training_args(output_dir, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(output_dir),
        max_steps=6,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=2e-3,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    values.update(overrides)
    return TrainingArguments(**values)


class LossRecorder:
    """Records the loss of every forward call of a model (each micro-batch), exactly."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.losses: list[float] = []
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        loss = getattr(output, "loss", None)
        if loss is not None and module.training:
            self.losses.append(loss.detach().float().item())


class LogRecorder(TrainerCallback):
    """Every log dict the reporters receive (after megatrain added its metrics)."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def train(model, args, callbacks=None, plugins=None, dataset=None, eval_dataset=None, resume=None, **trainer_kwargs):
    """Run a Trainer; returns (trainer, per-micro-batch losses)."""
    recorder = LossRecorder(model)
    kwargs = dict(
        model=model,
        args=args,
        train_dataset=dataset if dataset is not None else RandomTokens(),
        eval_dataset=eval_dataset,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    if plugins is not None:
        kwargs["plugins"] = plugins
    trainer = Trainer(**kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, recorder.losses


GPU_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256)
"""The small Llama the GPU tests train (``tiny_model("llama", **GPU_SHAPE)``)."""


def state_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().float() for n, p in model.named_parameters()}


def assert_same_state(a: dict, b: dict) -> None:
    """Two ``state_of`` results bitwise equal, tensor by tensor."""
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


def assert_close_params(a: dict, b: dict, atol: float, rtol: float = 0.0) -> None:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    worst = max(((a[n] - b[n]).abs().max().item(), n) for n in a)
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=atol, rtol=rtol, msg=lambda m, n=n: f"{n}: {m} (worst {worst})")


def assert_close_losses(ref: list[float], got: list[float], atol: float) -> None:
    assert len(ref) == len(got) and ref, (len(ref), len(got))
    diffs = [abs(x - y) for x, y in zip(ref, got)]
    assert max(diffs) <= atol, f"loss differs by {max(diffs)} at micro-step {diffs.index(max(diffs))}: {ref} vs {got}"


def optimizer_files(checkpoint) -> dict[str, tuple]:
    """Each shard's metadata and tensors' bytes (safetensors orders the metadata keys arbitrarily)."""
    from safetensors import safe_open

    folder, out = checkpoint / "megatrain_optimizer", {}
    for name in sorted(os.listdir(folder)):
        with safe_open(str(folder / name), framework="pt") as f:
            out[name] = (f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()})
    return out
