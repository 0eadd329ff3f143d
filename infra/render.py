"""TRL's rules for rendering a dataset's row to token ids: chat messages through the chat template, a string
completion ending with the EOS token, the completion's tokens where the prompt's rendering and the whole's part, the
assistant's tokens of a conversation, a row's tools, and a preference pair's implicit prompt; a row or a chat template
they cannot render refused in one line. The scripts that learn from a dataset read their rows with these
(infra/offline.py); the RL scripts render a reward model's input with render.
"""

import json

import jinja2

from utils import die


def shared(a, b):
    """how many items (tokens, messages, characters) a and b share at the start"""
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def with_eos(tokenizer, text):
    """text ending with the EOS token (TRL's rule for a string completion or text)"""
    eos = tokenizer.eos_token or ""
    return text if text.endswith(eos) else text + eos


def is_chat(value):
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def template_ids(tokenizer, messages, tools=None, add_generation_prompt=False, where="a conversation"):
    """messages' token ids by the chat template, with the generation prompt where asked, or, where they end with an
    assistant's message (a prefill), that message left open to be continued, as TRL renders a prompt; where: the row
    they are, for the line a template's error stops with"""
    if tokenizer.chat_template is None:
        die("the dataset holds chat messages but the tokenizer has no chat template: give one with --chat_template")
    prefill = add_generation_prompt and bool(messages) and messages[-1].get("role") == "assistant"
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt and not prefill,
            continue_final_message=prefill, tokenize=True, return_dict=False,
        )  # fmt: skip
    except (jinja2.TemplateError, TypeError, ValueError) as e:  # (a message it cannot render, no message at all)
        die(f"{where}: the chat template cannot render it: {e}")
    return list(ids)


def check_template(tokenizer, path):
    """--chat_template's file (path), now the tokenizer's template, compiled as transformers compiles it, so that a
    syntax error stops the run as the file loads, in one line, not at the first row rendered"""
    from transformers.utils.chat_template_utils import _compile_jinja_template  # (transformers' own compiler)

    try:
        _compile_jinja_template(tokenizer.chat_template)
    except jinja2.TemplateSyntaxError as e:
        die(f"--chat_template file {path!r}, line {e.lineno}: {e.message}")


def check_row(row, names, where):
    """One line naming the row (where) where a field it renders (of names, those it has) is missing (None: a column
    other rows have), is neither a string nor chat messages, or where they mix the two (TRL renders a row's prompt and
    completions alike, as one text or one conversation)"""
    fields = {name: row[name] for name in names if name in row}
    for name, value in fields.items():
        if value is None:
            die(f"{where}: no {name if name in ('prompt', 'completion') else name + ' completion'}")
        if not isinstance(value, str) and not is_chat(value):
            die(f"{where}: `{name}` must be a string or chat messages, got {type(value).__name__}")
    chat = [name for name, value in fields.items() if is_chat(value)]
    if chat and len(chat) < len(fields):
        text = next(name for name in fields if name not in chat)
        die(f"{where}: `{chat[0]}` holds chat messages but `{text}` a string: a row's are all strings or all chat messages")


def render(tokenizer, prompt, completion, tools=None, where="a conversation"):
    """A (prompt, completion) as TRL renders it, -> (prompt ids, completion ids): chat messages through the chat template,
    the prompt with the generation prompt and the two together as one conversation; strings tokenized as they are, the
    completion ending with the EOS token. The completion starts where the two renderings part (a template may render a
    prompt alone otherwise), so prompt ids + completion ids is always the whole conversation's rendering. reward.py
    trains on this and the RL scripts score with it, so a reward model reads in RL what it read in training. where: the
    row, for errors."""
    if is_chat(prompt) or is_chat(completion):
        head = template_ids(tokenizer, prompt, tools, add_generation_prompt=True, where=where)
        whole = template_ids(tokenizer, prompt + completion, tools, where=where)
    else:
        head = tokenizer(prompt)["input_ids"]
        whole = tokenizer(with_eos(tokenizer, prompt + completion))["input_ids"]
    n = shared(head, whole)
    return whole[:n], whole[n:]


def assistant_mask(tokenizer, messages, tools, ids, where="a conversation"):
    """Which of a conversation's token ids (its rendering) the assistant wrote: each assistant message's tokens, from
    after the template's cue to its end token (the EOS token; the template's separator after it is not the model's),
    found by rendering the conversation up to each message. where: the row, for errors."""
    mask = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(template_ids(tokenizer, messages[:i], tools, add_generation_prompt=True, where=where))
        upto = template_ids(tokenizer, messages[: i + 1], tools, where=where)
        end = len(upto)
        if ids[:end] != upto:
            die("--assistant_only_loss: the chat template renders a conversation's start differently from the whole")
        segment = ids[start:end]
        if tokenizer.eos_token_id in segment:  # up to and including the message's end token
            end = start + len(segment) - segment[::-1].index(tokenizer.eos_token_id)
        mask[start:end] = [True] * (end - start)
    return mask


def tools_of(row):
    """a row's `tools` column: the tools' JSON schemas, a list or a JSON string (None: none)"""
    tools = row.get("tools")
    try:
        return json.loads(tools) if isinstance(tools, str) else tools
    except json.JSONDecodeError as e:
        die(f"a `tools` value is not JSON ({e.msg} at column {e.colno}): {tools[:60]!r}")


def implicit_prompt(chosen, rejected):
    """A pair without a prompt column, split by TRL's extract_prompt: the prompt is chosen up to the first item (message
    or character) that differs from rejected's, less a space just before it; if one is a prefix of the other, all but
    the shorter's last item (where TRL's loop ends). One guard TRL lacks: where the first items differ the prompt is
    empty (TRL's chosen[idx - 1] would read chosen's last character)."""
    n = shared(chosen, rejected)
    if n == min(len(chosen), len(rejected)):
        n = max(n - 1, 0)
    elif n > 0 and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def empty(completion):
    if isinstance(completion, str):
        return not completion.strip()
    return not completion or all(not (m.get("content") or m.get("tool_calls")) for m in completion)
