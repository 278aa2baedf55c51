"""Chat data: conversations rendered as transformers renders them with Qwen's templates, the
learned-token mask covering exactly the assistant turns, and bad lines named by file:line."""

from __future__ import annotations

import json

import pytest

from autopar.data.chat import (
    CHATML_TOKENIZER,
    TEMPLATES,
    encode,
    learned_spans,
    read_conversations,
    render,
    template_text,
)
from autopar.data.errors import DataError

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi. How can I help?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."},
    ],
    [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two, three."},
        {"role": "user", "content": "Now backwards."},
        {"role": "assistant", "content": "Three, two, one."},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    [
        {"role": "user", "content": "Grüße auf Deutsch, 日本語で挨拶, and an emoji 🙂?"},
        {"role": "assistant", "content": "Hallo! こんにちは! 🙂"},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "Line one\nline two\n\n  indented"},
        {"role": "assistant", "content": "  leading spaces and\ttabs\n"},
    ],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\nFour."},
    ],
    [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "<think>old reasoning</think>First answer"},
        {"role": "user", "content": "Second question"},
        {"role": "assistant", "content": "Second answer"},
    ],
    [
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"sky": "clear"}'},
        {"role": "assistant", "content": "21 degrees and clear."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
        {"role": "assistant", "content": "f"},
    ],
    [
        {"role": "user", "content": 'Quote: "{{ not a template }}" and {% raw %}'},
        {"role": "assistant", "content": "Braces stay {{ as they are }}."},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(CHATML_TOKENIZER / "tokenizer.json"))


def hf_ids(tokenizer, messages, template: str) -> list[int]:
    out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("template", ["qwen2.5", "qwen3"])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_rendering_equals_transformers_token_for_token(hf_tokenizer, template, index):
    messages = CONVERSATIONS[index]
    ids, _ = encode(messages, CHATML_TOKENIZER, template)
    assert ids == hf_ids(hf_tokenizer, messages, template_text(None, template))


def test_the_template_beside_the_tokenizer_is_used_and_qwen25_is_the_fallback(tmp_path):
    assert template_text(CHATML_TOKENIZER) == (TEMPLATES / "qwen2.5.jinja").read_text()
    (tmp_path / "tokenizer.json").write_text((CHATML_TOKENIZER / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages[0].content }}"})
    )
    assert template_text(tmp_path) == "{{ messages[0].content }}"
    assert template_text(None) == (TEMPLATES / "qwen2.5.jinja").read_text()


def test_qwen25_adds_its_default_system_message():
    text = render([{"role": "user", "content": "hi"}], template_text(None))
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


@pytest.mark.parametrize("template", ["qwen2.5", "qwen3"])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_learned_tokens_are_exactly_the_assistant_turns_with_their_im_end(hf_tokenizer, template, index):
    messages = CONVERSATIONS[index]
    ids, learned = encode(messages, CHATML_TOKENIZER, template)
    text = render(messages, template_text(None, template))
    expected = "".join(text[s:e] for s, e in learned_spans(text))
    assert hf_tokenizer.decode([i for i, keep in zip(ids, learned) if keep]) == expected
    assert expected.count("<|im_end|>") == sum(m["role"] == "assistant" for m in messages)
    assert "<|im_start|>" not in expected and "user\n" not in expected.split("<|im_end|>")[0][:5]


def test_loss_on_last_assistant_and_all():
    messages = CONVERSATIONS[2]
    _, every = encode(messages, CHATML_TOKENIZER, "qwen2.5", loss_on="assistant")
    _, last = encode(messages, CHATML_TOKENIZER, "qwen2.5", loss_on="last_assistant")
    _, everything = encode(messages, CHATML_TOKENIZER, "qwen2.5", loss_on="all")
    assert all(everything) and sum(last) < sum(every)
    assert all(e for e, lst in zip(every, last) if lst)  # the last turn is part of every turn
    assert not any(last[: len(last) - sum(last) - 1])  # nothing before the last turn


def test_a_tokenizer_without_chatml_specials_is_refused_naming_them(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(["plain text only"], trainers.BpeTrainer(vocab_size=300))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match=r"\['<\|im_start\|>', '<\|im_end\|>'\] are not single tokens"):
        encode(CONVERSATIONS[0], tmp_path)


def test_sharegpt_lines_read_as_messages(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
    )
    assert list(read_conversations(path)) == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not JSON"),
        (json.dumps({"messages": "hello"}), "messages must be a non-empty list"),
        (json.dumps({"messages": [{"content": "no role"}]}), "a message has no 'role'"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "unknown role 'robot'"),
        (json.dumps({"text": "not a chat"}), 'an object with "messages"'),
        (
            json.dumps({"messages": [{"role": "user", "content": 3}]}),
            "'content' of a user message must be a string",
        ),
    ],
)
def test_bad_chat_lines_are_named_by_file_and_line(tmp_path, line, message):
    path = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": CONVERSATIONS[0]})
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(DataError, match=f"{path}:3: .*{message}".replace("[", r"\[").replace("(", r"\(")):
        list(read_conversations(path))
