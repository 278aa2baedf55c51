"""Write ``pairs.jsonl``: preference pairs where the chosen answer follows a simple rule and the
rejected one breaks it, for the DPO walk-through on the debug model.

Four rules, in short English the debug tokenizer (``tokenizers/chatml``) covers: count up
from a number, count down, repeat a phrase, spell a word. The rejected answer breaks the
rule plainly (skips or sticks while counting, says another phrase, spells another word): the
debug-sized Qwen3 from scratch, in TRL 1.16 (batch 8, lr 3e-3, beta 0.1, fp32), averaged
rewards/accuracies 0.90 over steps 71-80, where rejected answers in the same tokens in another
order reached 0.73. Plain records (no chat template), so the sequences stay short.
Deterministic: ``python -m autopar.data.preference_example.make_pairs`` rewrites the same file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).parent / "pairs.jsonl"
PASSAGE = (
    "the cat sat on a mat and the dog ran to the red ball in the big green park while a small "
    "bird sang from the old tree near the river under a blue sky full of white clouds"
)
WORDS = PASSAGE.split(" ")
SPELLED = ("cat", "dog", "sun", "tree", "bird", "fish", "book", "rain", "milk", "road", "ship", "star")
PAIRS_PER_RULE = 75


def count_up(rng: random.Random) -> dict[str, str]:
    start, length = rng.randint(1, 60), rng.randint(4, 7)
    return _count("Count from", start, 1, length, rng)


def count_down(rng: random.Random) -> dict[str, str]:
    start, length = rng.randint(20, 90), rng.randint(4, 7)
    return _count("Count down from", start, -1, length, rng)


def _count(prompt: str, start: int, step: int, length: int, rng: random.Random) -> dict[str, str]:
    """Chosen counts by ``step``; rejected starts right and then skips (two at a time) or
    gets stuck (the same number again)."""
    broken = 2 * step if rng.random() < 0.5 else 0
    return {
        "prompt": f"{prompt} {start}:",
        "chosen": _numbers(start, step, length),
        "rejected": _numbers(start, broken, length),
    }


def _numbers(start: int, step: int, length: int) -> str:
    return "".join(f" {start + i * step}" for i in range(length))


def repeat(rng: random.Random) -> dict[str, str]:
    """Chosen repeats the phrase; rejected says another phrase of the passage as long."""
    length = rng.randint(3, 6)
    start, other = rng.sample(range(0, len(WORDS) - length, length), 2)
    phrase = " ".join(WORDS[start : start + length])
    return {
        "prompt": f"Repeat: {phrase}",
        "chosen": f" {phrase}",
        "rejected": " " + " ".join(WORDS[other : other + length]),
    }


def spell(rng: random.Random) -> dict[str, str]:
    """Chosen spells the word; rejected spells another word."""
    word, other = rng.sample(SPELLED, 2)
    return {"prompt": f"Spell {word}:", "chosen": " " + " ".join(word), "rejected": " " + " ".join(other)}


def pairs(seed: int = 0) -> list[dict[str, str]]:
    """Every rule's pairs, interleaved, in a fixed order."""
    rng = random.Random(seed)
    rules = (count_up, count_down, repeat, spell)
    return [rule(rng) for _ in range(PAIRS_PER_RULE) for rule in rules]


def main() -> None:
    OUT.write_text("".join(json.dumps(pair) + "\n" for pair in pairs()), encoding="utf-8")


if __name__ == "__main__":
    main()
