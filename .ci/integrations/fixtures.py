"""The local model, tokenizer and data the integration job trains on (no hub): written once into WORK.

A tiny Llama (hidden 64, 2 layers, fp32) saved with ``save_pretrained`` next to a byte-level BPE tokenizer
trained on the data (512 tokens, as ``examples/common.py`` trains the demo's), and the same 64 short
texts in the layouts the tools read: ``data/jsonl/text.jsonl`` (``{"text": ...}``: trl's dataset folder,
axolotl's ``completion`` type) and ``data/lf/`` with LLaMA-Factory's ``dataset_info.json`` (its
pre-training stage's ``prompt`` column).

    python .ci/integrations/fixtures.py WORK
"""

from __future__ import annotations

import json
import os
import sys

import torch


def texts(n: int = 64) -> list[str]:
    g = torch.Generator().manual_seed(0)
    words = [f"{a}{b}" for a in "bcdfgklmnprst" for b in "aeiou"]
    return [" ".join(words[int(i)] for i in torch.randint(0, len(words), (24,), generator=g)) + "." for _ in range(n)]


def main(work: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model_dir, data_dir = os.path.join(work, "model"), os.path.join(work, "data")
    if os.path.isfile(os.path.join(data_dir, "lf", "dataset_info.json")):
        return
    for sub in ("jsonl", "lf"):
        os.makedirs(os.path.join(data_dir, sub), exist_ok=True)
    corpus = texts()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>"]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=512, special_tokens=special,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", model_max_length=64)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    for sub in ("jsonl", "lf"):  # trl reads every file of its folder: LLaMA-Factory's index lives apart
        with open(os.path.join(data_dir, sub, "text.jsonl"), "w", encoding="utf-8") as f:
            for text in corpus:
                f.write(json.dumps({"text": text}) + "\n")
    with open(os.path.join(data_dir, "lf", "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump({"tiny": {"file_name": "text.jsonl", "columns": {"prompt": "text"}}}, f)


if __name__ == "__main__":
    main(sys.argv[1])
