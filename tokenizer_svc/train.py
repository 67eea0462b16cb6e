"""Train the project's own byte-level BPE tokenizer, offline and deterministically.

The corpus is text every machine with Python has (a fixed list of standard-library sources) plus a
small multilingual sample that the repository ships, so the tokenizer covers Chinese, emoji and
accented Latin. The same Python version gives byte-for-byte the same tokenizer.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen2 uses it: the generation prompt opens an assistant turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

STDLIB_FILES = [
    "argparse.py",
    "textwrap.py",
    "string.py",
    "difflib.py",
    "random.py",
    "statistics.py",
    "calendar.py",
    "fractions.py",
    "heapq.py",
    "bisect.py",
    "pathlib.py",
    "shutil.py",
    "typing.py",
    "dataclasses.py",
    "functools.py",
    "contextlib.py",
    "enum.py",
    "csv.py",
    "pprint.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "collections/__init__.py",
    "logging/__init__.py",
    "email/message.py",
    "http/client.py",
    "urllib/parse.py",
    "asyncio/tasks.py",
    "asyncio/queues.py",
    "unittest/case.py",
    "concurrent/futures/_base.py",
]
MULTILINGUAL = Path(__file__).with_name("corpus") / "multilingual.txt"


def corpus_lines() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for name in STDLIB_FILES:
        path = stdlib / name
        if path.exists():
            lines.extend(path.read_text(encoding="utf-8", errors="replace").splitlines())
    sample = MULTILINGUAL.read_text(encoding="utf-8").splitlines()
    # The sample is tiny next to the code: repeat it so its characters earn merges of their own.
    lines.extend(sample * 40)
    return lines


def train_tokenizer(vocab_size: int = 8192) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for t in SPECIAL_TOKENS
        },
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
