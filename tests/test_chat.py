"""Chat data: conversations rendered as transformers renders them with Qwen's templates, the
learned-token mask covering exactly the assistant turns, and bad lines named by file:line."""

from __future__ import annotations

import json

import pytest

from autopar.data.chat import (
    CHATML_TOKENIZER,
    TEMPLATES,
    ChatFormat,
    encode,
    learned_spans,
    load_chat,
    read_conversations,
    read_records,
    render,
    template_text,
)
from autopar.data.errors import DataError

from jobs import TOOLS

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


@pytest.mark.parametrize("template", ["qwen2.5", "qwen3", "qwen3.5"])
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


def tokenizer_folder(tmp_path, config: dict | None = None, **files: str):
    """The ChatML tokenizer in ``tmp_path`` with ``config`` as tokenizer_config.json and
    ``files`` ({relative path with / as __: text}) beside it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "tokenizer.json").write_bytes((CHATML_TOKENIZER / "tokenizer.json").read_bytes())
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        path = tmp_path / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_chat_template_jinja_beside_the_tokenizer_wins_over_the_config_field(tmp_path):
    folder = tokenizer_folder(
        tmp_path, {"chat_template": "from the config"}, **{"chat_template.jinja": "from the file"}
    )
    assert template_text(folder) == "from the file"


def test_chat_template_jinja_is_used_without_a_config_field(tmp_path):
    folder = tokenizer_folder(tmp_path, {"eos_token": "<|im_end|>"}, **{"chat_template.jinja": "the file"})
    assert template_text(folder) == "the file"
    assert template_text(tokenizer_folder(tmp_path / "bare", None, **{"chat_template.jinja": "x"})) == "x"


LAYOUTS = {
    "config_string": ({"chat_template": "C"}, {}),
    "config_named_list": (
        {"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]},
        {},
    ),
    "jinja_over_config": ({"chat_template": "C"}, {"chat_template.jinja": "J"}),
    "jinja_and_additional": (
        {"chat_template": "C"},
        {"chat_template.jinja": "J", "additional_chat_templates__tool_use.jinja": "T"},
    ),
    "additional_only_replace_the_config": (
        {"chat_template": [{"name": "default", "template": "D"}]},
        {"additional_chat_templates__default.jinja": "A", "additional_chat_templates__rag.jinja": "R"},
    ),
}
"""Where a folder keeps its templates: the config field, chat_template.jinja, additional ones."""


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_template_is_found_as_transformers_finds_it(tmp_path, layout, tools):
    transformers = pytest.importorskip("transformers")
    config, files = LAYOUTS[layout]
    folder = tokenizer_folder(tmp_path, config, **files)
    expected = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder)).get_chat_template(
        None, tools
    )
    assert template_text(folder, tools=tools) == expected


def test_named_templates_without_a_default_are_refused_naming_them(tmp_path):
    folder = tokenizer_folder(tmp_path, None, **{"additional_chat_templates__rag.jinja": "R"})
    with pytest.raises(DataError, match=r"chat templates \['rag'\] and none is the default"):
        template_text(folder)


@pytest.mark.parametrize("template", ["qwen3", "qwen3.5"])
def test_a_records_tools_reach_the_template_as_apply_chat_template_passes_them(
    tmp_path, hf_tokenizer, template
):
    messages = CONVERSATIONS[8]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": messages, "tools": TOOLS}) + "\n")
    tokens, _, _ = load_chat(path, ChatFormat(str(CHATML_TOKENIZER), template))
    expected = hf_tokenizer.apply_chat_template(
        messages, tools=TOOLS, chat_template=template_text(None, template), tokenize=True
    )
    assert tokens.tolist() == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert '"name": "weather"' in render(messages, template_text(None, template), TOOLS)


def test_qwen25_adds_its_default_system_message():
    text = render([{"role": "user", "content": "hi"}], template_text(None))
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


@pytest.mark.parametrize("template", ["qwen2.5", "qwen3", "qwen3.5"])
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


def test_sharegpt_tools_written_as_a_json_string_read_as_a_list(tmp_path):
    path = tmp_path / "chat.jsonl"
    record = {"conversations": [{"from": "human", "value": "hi"}], "tools": json.dumps(TOOLS)}
    path.write_text(json.dumps(record))
    assert [c.tools for c in read_records(path)] == [TOOLS]


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
        (
            json.dumps({"messages": CONVERSATIONS[0], "tools": json.dumps("weather")}),
            '"tools" must be a list.*it is str',
        ),
        (
            json.dumps({"messages": CONVERSATIONS[0], "tools": {"name": "f"}}),
            '"tools" must be a list.*it is dict',
        ),
        (json.dumps({"messages": CONVERSATIONS[0], "tools": [{"name": "f"}, 3]}), "item 2 is int"),
        (json.dumps({"conversations": [{"from": "human", "value": "x"}], "tools": "[{"}), "not JSON"),
    ],
)
def test_bad_chat_lines_are_named_by_file_and_line(tmp_path, line, message):
    path = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": CONVERSATIONS[0]})
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(DataError, match=f"{path}:3: .*{message}".replace("[", r"\[").replace("(", r"\(")):
        list(read_conversations(path))
