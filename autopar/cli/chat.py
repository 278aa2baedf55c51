"""``python -m autopar.generate --generate.chat true``: talk to the job's model in the terminal.

Each line read is a user turn; the conversation so far is rendered with the model's chat
template and its generation prompt (as SFT renders and encodes it: special tokens typed in a
turn stay text), and the reply streams to the terminal
as its tokens are decoded, then joins the conversation as the assistant's turn. ``/reset``
starts a new conversation; ``/exit`` or the end of input ends the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from autopar.config.sections import Generate
from autopar.data.prompts import conversation_ids
from autopar.data.tokenizer import Tokenizer
from autopar.models.generation import generate
from autopar.models.qwen import Qwen
from autopar.parallel.torch_internals import key_compile_cache_on_vector_isa

INCOMPLETE = "\ufffd"
"""What a byte-level tokenizer decodes a character cut between tokens to: held back until the
next token completes it."""


class Stream:
    """Writes a reply's text as its tokens arrive: the decoded text of all tokens so far, less
    what was written (stop tokens are not text)."""

    def __init__(self, tokenizer: Tokenizer, stops: Collection[int], write: Callable[[str], object]) -> None:
        self.tokenizer, self.stops, self.write = tokenizer, stops, write
        self.ids: list[int] = []
        self.shown = ""

    def __call__(self, row: int, token: int) -> None:
        if token in self.stops:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith(INCOMPLETE):
            return
        self.write(text[len(self.shown) :])
        self.shown = text


def chat(
    model: Qwen,
    tokenizer: Tokenizer,
    template: str,
    settings: Generate,
    stops: Collection[int],
    read: Callable[[], str],
    write: Callable[[str], object],
) -> int:
    """Run the conversation over the lines ``read`` gives (EOFError ends it), writing replies
    with ``write``; returns the replies given. Turn t samples with seed ``settings.seed + t``."""
    messages: list[dict[str, str]] = []
    replies = 0
    if settings.compile:
        key_compile_cache_on_vector_isa()
    while True:
        try:
            line = read().strip()
        except EOFError:
            break
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = []
            write("(a new conversation)\n")
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        ids = conversation_ids(messages, template, tokenizer)  # typed special tokens stay text
        room = model.args.max_position_embeddings - len(ids)
        if room < 1:
            messages.pop()
            write(
                f"(the conversation fills the model's {model.args.max_position_embeddings} positions; /reset)\n"
            )
            continue
        stream = Stream(tokenizer, stops, write)
        sampling = (settings.temperature, settings.top_p, settings.top_k, settings.seed + replies, stops)
        limit = min(settings.max_new_tokens, room)
        new = generate(model, [ids], limit, *sampling, compiled=settings.compile, on_token=stream)[0]
        write("\n")
        messages.append(
            {"role": "assistant", "content": tokenizer.decode([t for t in new if t not in stops])}
        )
        replies += 1
    return replies
