"""Tiny deterministic DeepSeek-like tokenizer for tests.

``make_tokenizer(path)`` trains a byte-level BPE tokenizer (``tokenizers`` library) on a small fixed
corpus of English, Python code, Chinese and emoji text, and saves it with
``transformers.PreTrainedTokenizerFast.save_pretrained`` so ``AutoTokenizer`` can load it. The
vocabulary is exactly ``vocab_size`` (tiny test models use 256), ids 0/1 are the DeepSeek-style
``<｜begin▁of▁sentence｜>`` / ``<｜end▁of▁sentence｜>`` special tokens, and encoding adds the BOS
token like DeepSeek's tokenizer does.

With ``vocab_size <= 258`` the byte alphabet is only the bytes seen in the corpus (all printable ASCII
plus the UTF-8 bytes of the Chinese/emoji/template text), so a 256-entry vocabulary still has merges;
multi-byte characters are mostly split across several tokens. With a larger ``vocab_size`` the full
256-byte alphabet is included so any text can be encoded.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"

# DeepSeek-V3-like (simplified) chat template.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

CORPUS: tuple[str, ...] = (
    string.printable,
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Speculative decoding drafts several tokens and the target model verifies them in one step.",
    "Multi-head latent attention compresses the key value cache into a small latent vector.",
    "Hello, world! How are you today? I am fine, thank you. What time is it?",
    "There are 1234 apples, 56 oranges and 7.89 kilograms of rice in the store.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Engine:\n    def __init__(self, config):\n        self.config = config\n        self.requests = []\n",
    "for i in range(10):\n    print(f\"step {i}: loss={loss:.4f}\")\n",
    "import torch\nx = torch.zeros((2, 3), dtype=torch.float32)\nassert x.shape == (2, 3)\n",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "深度求索发布了新的大语言模型，支持推测解码和混合专家。",
    "机器学习和人工智能正在改变世界。",
    "Emoji test: 😀 😃 😄 🚀 🎉 👍 ❤️ 🌍 🤖 🔥",
    "I love coding 💻 and coffee ☕ every morning 🌅.",
    "<｜User｜>What is 2 + 2?<｜Assistant｜>2 + 2 = 4.",
    "<｜User｜>你好<｜Assistant｜>你好！有什么可以帮你的吗？😊",
)


def make_tokenizer(path: str | Path, vocab_size: int = 256, chat_template: bool = True) -> Path:
    """Train and save the tiny tokenizer into ``path`` (created if needed); return ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [BOS_TOKEN, EOS_TOKEN]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if vocab_size > 258 else [],
        show_progress=False,
    )
    # Repeat the corpus a little so frequency ties are broken by content, not by chance.
    tok.train_from_iterator(list(CORPUS) * 3, trainer=trainer)
    actual = tok.get_vocab_size()
    if actual != vocab_size:
        raise ValueError(
            f"tiny tokenizer corpus yields a vocabulary of {actual}, not the requested {vocab_size}"
        )
    bos_id, eos_id = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=16384,
    )
    fast.save_pretrained(str(path))

    # Keep the template inside tokenizer_config.json, as DeepSeek checkpoints ship it.
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    config["bos_token"] = BOS_TOKEN
    config["eos_token"] = EOS_TOKEN
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return path
