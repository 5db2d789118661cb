"""A tiny byte-level BPE tokenizer trained in the test (the ``tokenizers`` library) with a ChatML chat template,
and a tiny Llama saved beside it: a pretrained directory without the hub."""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_TAGGED = ("{% for message in messages %}{% if message['role'] == 'assistant' %}<|im_start|>assistant\n"
                 "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>"
                 "{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# In the manner of Qwen3's template (written here, not copied): the last assistant turn opens with an empty
# reasoning block, past ones do not, so a prefix of the conversation renders its last reply unlike the full text.
REASONING_LAST = ("{% for message in messages %}{% if message['role'] == 'assistant' %}<|im_start|>assistant\n"
                  "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}{{ message['content'] }}<|im_end|>\n"
                  "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# In the manner of Llama-3.1's (written here): role headers, a system block with a date always first.
HEADERS = ("<|im_start|>system\nToday: 4 Dec 2026\n{% for message in messages %}{% if message['role'] == 'system' %}"
           "{{ message['content'] }}\n{% endif %}{% endfor %}<|im_end|>{% for message in messages %}"
           "{% if message['role'] != 'system' %}<|im_start|>{{ message['role'] }}\n\n{{ message['content'] }}"
           "<|im_end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}")
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards box and fly past jovial quartz vex "
         "answer question hello world blue green red number one two three four five").split()


def make_tokenizer(directory: str | Path, *, template: str | None = CHATML, vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] + ["user\nassistant\nsystem\n"] * 5
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    if template:
        fast.chat_template = template
    fast.save_pretrained(str(directory))
    return fast


def make_pretrained(directory: str | Path, *, template: str | None = CHATML, seed: int = 0, **config) -> Path:
    """A tokenizer and a tiny random Llama over its vocabulary, saved as a pretrained directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = Path(directory)
    tok = make_tokenizer(directory, template=template)
    torch.manual_seed(seed)
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    cfg.update(config)
    AutoModelForCausalLM.from_config(LlamaConfig(**cfg)).save_pretrained(str(directory))
    return directory


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_rows(n: int, seed: int = 0, reply: str = "blue green red") -> list[dict]:
    """Conversations whose user text is random words and whose assistant reply is always ``reply``: a model can
    learn the reply exactly, never the user's text."""
    import random

    rng = random.Random(seed)
    return [{"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))},
                          {"role": "assistant", "content": reply}]} for _ in range(n)]


def text_rows(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30)))} for _ in range(n)]
