"""Shared pieces of the examples: local data, a locally trained tokenizer, a small Llama, the device.

Nothing here is megatrain-specific and nothing is downloaded: the corpus is the source of the
Python standard library this interpreter ships, read through `datasets`; the tokenizer is a
byte-level BPE trained on it in a second or two; the model is built from a config (random
init). In your own script these are `load_dataset(...)`, `AutoTokenizer.from_pretrained(...)`
and `AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)`.

The example scripts import this module as `common` (Python puts a script's own directory first
on `sys.path`, so `python examples/sft_trainer.py` finds it from any working directory).
"""

from __future__ import annotations

import argparse
import ast
import glob
import logging
import os
import sysconfig
import warnings

import torch
from datasets import Dataset, load_dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<eos>"


def example_parser(doc: str, output_dir: str, *, max_steps: int, learning_rate: float) -> argparse.ArgumentParser:
    """The options every training example shares (where, how long, batch, lr, model size, --smoke)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--output_dir", default=output_dir)
    parser.add_argument("--max_steps", type=int, default=max_steps, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=learning_rate)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny data and model, a few steps (CI)")
    return parser


def quiet() -> None:
    """Keep the examples' output readable: INFO from megatrain, warnings from the rest only."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("megatrain_hf").setLevel(logging.INFO)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import datasets
    import transformers

    transformers.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def use_cuda() -> bool:
    """GPU (bf16 compute) when there is one, else the CPU (fp32)."""
    return torch.cuda.is_available()


def stdlib_files(max_files: int | None = None) -> list[str]:
    """The standard library's top-level `*.py` files, sorted by name (the same list on every run).

    `_sysconfigdata_*.py` is left out: it is generated when Python is built (this machine's paths
    and compiler flags), not source.
    """
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    files = [f for f in files if not os.path.basename(f).startswith("_sysconfigdata")]
    if not files:
        raise RuntimeError("no *.py files under the stdlib directory; this example needs the Python sources")
    return files[:max_files] if max_files else files


def load_stdlib_text(max_files: int | None = None) -> Dataset:
    """One row per stdlib source file (`{"text": ...}`), through `datasets`' packaged `text` builder."""
    return load_dataset("text", data_files={"train": stdlib_files(max_files)}, sample_by="document", split="train")


def docstring_pairs(texts: list[str], max_pairs: int, max_chars: int = 1200) -> Dataset:
    """Prompt/completion pairs for SFT: a function's signature + docstring -> its body.

    Parsed with `ast` from the given source texts; functions whose source is longer than
    `max_chars` are skipped, so that each pair fits a short context.
    """
    prompts, completions = [], []
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
                continue
            doc = node.body[0]
            if ast.get_docstring(node) is None or node.end_lineno is None or doc.end_lineno is None:
                continue
            # the newline after the docstring starts the completion: the prompt then ends on a
            # token boundary (the tokenizer never merges the closing quotes with what follows)
            head = "\n".join(lines[node.lineno - 1 : doc.end_lineno])
            body = "\n" + "\n".join(lines[doc.end_lineno : node.end_lineno]) + "\n"
            if len(head) + len(body) > max_chars or not body.strip():
                continue
            prompts.append(head)
            completions.append(body)
            if len(prompts) >= max_pairs:
                return Dataset.from_dict({"prompt": prompts, "completion": completions})
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts` (pad = eos, as for most causal LMs)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    chunks = (text[i : i + 10_000] for text in texts for i in range(0, len(text), 10_000))
    tok.train_from_iterator(chunks, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def group_texts(dataset: Dataset, tokenizer, seq_len: int) -> Dataset:
    """Tokenize, concatenate and cut into blocks of `seq_len` tokens (labels = input ids), as run_clm.py does."""

    def tokenize(batch):
        return tokenizer([t + EOS for t in batch["text"]])

    def blocks(batch):
        ids = [i for seq in batch["input_ids"] for i in seq]
        n = len(ids) // seq_len * seq_len
        chunks = [ids[i : i + seq_len] for i in range(0, n, seq_len)]
        return {
            "input_ids": chunks,
            "attention_mask": [[1] * seq_len for _ in chunks],
            "labels": [c[:] for c in chunks],
        }

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)
    return tokenized.map(blocks, batched=True, batch_size=1000, remove_columns=tokenized.column_names)


def tiny_llama(tokenizer, hidden: int, layers: int, max_positions: int, seed: int = 0) -> LlamaForCausalLM:
    """A small Llama in fp32 on the CPU: the fp32 weights become megatrain's host masters."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def n_params(model: torch.nn.Module, trainable_only: bool = False) -> float:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only) / 1e6
