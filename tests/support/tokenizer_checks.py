"""One tokenizer against a reference: the same ids (with and without special tokens), the same
text back, the same chat prompt; and texts that exercise what byte-level BPE gets wrong."""

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
EXTRA_TEXTS = [
    "",
    f"{BOS}hello{EOS} world {BOS}",
    f"a{EOS}{EOS}b <｜begin▁of▁sentence",  # a special token, and a near miss that is plain text
    "héllo wörld — 你好，世界！ こんにちは 한국어 Привет 😀🚀 e\u0301 ﬁ Ω",
    "a  b\t\tc\n\n\n   d    \r\n\r\n\x0b\x0c end   ",
    "1 22 333 4444 55555 666666 3.14159 1e10 0x1F 1,000,000 ١٢٣",
    "don't I'll WE'VE 'quoted' \"double\" ```code``` ...!!!???",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "def f(x):\n    return x  # 你好"},
    {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
]


def assert_same_tokenizer(ours, ref, texts):
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    for text in texts:
        for add_special in (True, False):
            ids = ref.encode(text, add_special_tokens=add_special)
            assert ours.encode(text, add_special_tokens=add_special) == ids, text[:80]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for add_generation_prompt in (True, False):
        rendered = ref.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt) == rendered
