"""Make a tokenizer without the Hub: a byte-level BPE trained on your own data, saved as a Hugging Face tokenizer
directory that ``data.tokenizer`` (or ``--tokenizer`` of the Lightning and Accelerate scripts) can name.

    python recipes/tokenizer/train_tokenizer.py sft.jsonl tokenizer/ --format chat --vocab-size 8000

It reads the dataset the way ``ultrascale train`` does (a .jsonl / .json / .parquet / .txt file, a directory of
them, or a ``save_to_disk`` directory; ``--text-field`` / ``--messages-field`` as in the recipe's ``data:``
section) and trains with the ``tokenizers`` library, which transformers installs. The directory gets a ChatML
chat template (``<|im_start|>role ... <|im_end|>``), so ``format: chat`` works with it, end-of-sequence
``<|im_end|>`` and padding ``<|endoftext|>``. Use a model whose ``vocab_size`` is at least the tokenizer's size
(the script prints it): a model trained from scratch, since a pretrained model only understands its own tokenizer.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def texts(dataset: str, fmt: str, text_field: str, messages_field: str):
    """Every sample's text: a document, or each message of a conversation."""
    from ultrascale_plugins.data.dataset_files import load_source

    with tempfile.TemporaryDirectory() as cache:
        rows = load_source(dataset, Path(cache)).dataset
        field = text_field if fmt == "text" else messages_field
        if field not in rows.column_names:
            raise SystemExit(f"{dataset}: no column '{field}' (columns: {', '.join(rows.column_names)}). Fix: "
                             f"pass --{'text' if fmt == 'text' else 'messages'}-field")
        for value in rows[field]:
            if fmt == "text":
                yield value
            else:
                for message in value:
                    yield f"{message['role']}\n{message['content']}"


def train_tokenizer(dataset: str, out: str, *, vocab_size: int = 8000, fmt: str = "text", text_field: str = "text",
                    messages_field: str = "messages"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # every byte is in the vocabulary from the start: no text is ever out of vocabulary
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts(dataset, fmt, text_field, messages_field), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(out)
    return tokenizer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset", help="the data to learn the vocabulary from (what data.dataset names)")
    ap.add_argument("out", help="the tokenizer directory to write")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--format", default="text", choices=["text", "chat"])
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--messages-field", default="messages")
    args = ap.parse_args(argv)
    tokenizer = train_tokenizer(args.dataset, args.out, vocab_size=args.vocab_size, fmt=args.format,
                                text_field=args.text_field, messages_field=args.messages_field)
    print(f"wrote {args.out}: {len(tokenizer)} tokens (use a model with vocab_size >= {len(tokenizer)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
