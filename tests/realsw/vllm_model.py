"""Make the tiny random Llama that the vLLM tests serve (run by the vLLM venv's python).

``python vllm_model.py OUT_DIR``: a ``LlamaForCausalLM`` (hidden 128, 2 layers, vocab 512,
random weights) saved with ``save_pretrained``, and a byte-level BPE tokenizer trained here
with ``tokenizers`` (no download) saved so that ``AutoTokenizer.from_pretrained`` loads it.
``python vllm_model.py OUT_DIR big``: the same, 24 layers of hidden 2048 (~4.8 GB of float32
weights; the SGLang tests load it from storage to see a server loading for a while).
Writes into ``OUT_DIR.tmp`` and renames it to ``OUT_DIR`` at the end, so a directory that
exists is complete. Prints ``MODEL dir=OUT_DIR``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

VOCAB = 512
SPECIAL = ["<s>", "</s>", "<unk>", "<pad>"]


def corpus() -> list[str]:
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "while",
        "a",
        "model",
        "serves",
        "tokens",
        "to",
        "clients",
        "hello",
        "world",
        "inference",
        "engine",
        "scheduler",
        "worker",
        "request",
        "response",
        "stream",
        "chunk",
        "cache",
    ]
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * k) % len(words)] for k in range(1, 12)))
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def make_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=512,
    )
    fast.save_pretrained(out)


SIZES = {  # hidden, intermediate, layers, heads
    "tiny": (128, 256, 2, 4),
    "big": (2048, 5632, 24, 16),
}


def make_model(out: Path, size: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden, intermediate, layers, heads = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)


def main() -> None:
    out = Path(sys.argv[1])
    size = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    if not (out / "config.json").is_file():
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        make_tokenizer(tmp)
        make_model(tmp, size)
        try:
            os.rename(tmp, out)
        except OSError:  # another maker won the race: its directory is complete too
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"MODEL dir={out}", flush=True)


if __name__ == "__main__":
    main()
