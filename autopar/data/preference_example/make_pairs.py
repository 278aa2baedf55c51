"""Write ``pairs.jsonl``: preference pairs where the chosen answer follows a simple rule and the
rejected one breaks it, for the DPO walk-through on the debug model.

Four rules, in short English the debug tokenizer (``tokenizers/chatml``) covers: count up
from a number, count down, repeat a phrase, spell a word. The rejected answer uses the same
tokens in a wrong order (or one step off), so it is as long as the chosen one and only the
rule tells them apart. Plain records (no chat template), so the sequences stay short.
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


def shuffled(items: list[str], rng: random.Random) -> list[str]:
    """The items in another order (never the same one)."""
    out = list(items)
    while out == items:
        rng.shuffle(out)
    return out


def count_up(rng: random.Random) -> dict[str, str]:
    start, length = rng.randint(1, 60), rng.randint(4, 7)
    numbers = [str(start + i) for i in range(length)]
    return {
        "prompt": f"Count from {start}:",
        "chosen": " " + " ".join(numbers),
        "rejected": _broken(numbers, rng),
    }


def count_down(rng: random.Random) -> dict[str, str]:
    start, length = rng.randint(10, 60), rng.randint(4, 7)
    numbers = [str(start - i) for i in range(length)]
    return {
        "prompt": f"Count down from {start}:",
        "chosen": " " + " ".join(numbers),
        "rejected": _broken(numbers, rng),
    }


def _broken(numbers: list[str], rng: random.Random) -> str:
    """The count with its first number kept and the rest scrambled, or each one step off."""
    if rng.random() < 0.5:
        return " " + " ".join([numbers[0], *shuffled(numbers[1:], rng)])
    return " " + " ".join([numbers[0]] + [str(int(n) + 1) for n in numbers[1:]])


def repeat(rng: random.Random) -> dict[str, str]:
    start = rng.randrange(len(WORDS) - 6)
    phrase = WORDS[start : start + rng.randint(3, 6)]
    return {
        "prompt": f"Repeat: {' '.join(phrase)}",
        "chosen": " " + " ".join(phrase),
        "rejected": " " + " ".join(shuffled(phrase, rng)),
    }


def spell(rng: random.Random) -> dict[str, str]:
    word = rng.choice(SPELLED)
    letters = list(word)
    return {
        "prompt": f"Spell {word}:",
        "chosen": " " + " ".join(letters),
        "rejected": " " + " ".join(shuffled(letters, rng)),
    }


def pairs(seed: int = 0) -> list[dict[str, str]]:
    """Every rule's pairs, interleaved, in a fixed order."""
    rng = random.Random(seed)
    rules = (count_up, count_down, repeat, spell)
    return [rule(rng) for _ in range(PAIRS_PER_RULE) for rule in rules]


def main() -> None:
    OUT.write_text("".join(json.dumps(pair) + "\n" for pair in pairs()), encoding="utf-8")


if __name__ == "__main__":
    main()
