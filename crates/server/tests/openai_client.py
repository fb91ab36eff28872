#!/usr/bin/env python3
"""The official `openai` client against a running kvpolicy-server (issue 31's first
"done when"): completes, chats and streams, and reads errors. Run by
crates/server/tests/clients.rs with the server's base URL and API key; exits non-zero on
the first expectation that fails.

    python3 openai_client.py http://127.0.0.1:PORT/v1 KEY
"""
import sys

import openai
from openai import OpenAI


def main():
    base, key = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
    models = client.models.list()
    name = models.data[0].id
    assert len(models.data) == 1, models

    # A completion, greedy: SmolLM2 continues with " Paris".
    c = client.completions.create(model=name, prompt="The capital of France is",
                                  max_tokens=8, temperature=0, logprobs=2)
    text = c.choices[0].text
    assert text.startswith(" Paris"), text
    assert c.choices[0].finish_reason == "length", c
    assert c.usage.prompt_tokens == 5 and c.usage.completion_tokens == 8, c.usage
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 8 and "".join(lp.tokens) == text, lp
    assert all(x <= 0 for x in lp.token_logprobs) and len(lp.top_logprobs[0]) == 2, lp

    # The same, streamed: the pieces add up to the whole.
    pieces, finish = [], None
    for chunk in client.completions.create(model=name, prompt="The capital of France is",
                                           max_tokens=8, temperature=0, stream=True):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == text, (pieces, text)
    assert finish == "length", finish

    # A stop sequence ends the text before it.
    s = client.completions.create(model=name, prompt="The capital of France is",
                                  max_tokens=16, temperature=0, stop=["."])
    assert s.choices[0].text == text.split(".")[0], s.choices[0].text
    assert s.choices[0].finish_reason == "stop", s

    # A chat, whole and streamed (with usage before [DONE]).
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=12,
                                           temperature=0)
    answer = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and answer, whole
    streamed, usage, roles = [], None, []
    for chunk in client.chat.completions.create(model=name, messages=messages,
                                                max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            if ch.delta.content:
                streamed.append(ch.delta.content)
    assert "".join(streamed) == answer, (streamed, answer)
    assert roles == ["assistant"], roles
    assert usage and usage.completion_tokens == whole.usage.completion_tokens, usage

    # Errors arrive as the client's exceptions, with the server's message.
    try:
        client.completions.create(model=name, prompt="x", max_tokens=100_000)
        raise AssertionError("max_tokens past the context was accepted")
    except openai.BadRequestError as e:
        assert "context" in str(e), e
    try:
        OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        raise AssertionError("a wrong API key was accepted")
    except openai.AuthenticationError:
        pass
    print("openai client: ok")


if __name__ == "__main__":
    main()
