"""A chat model behind an OpenAI-compatible URL (`POST {url}/chat/completions`): vLLM's, SGLang's or
llama.cpp's server, or a hosted API. Every caller names the params key that set the URL, so an error says
which setting to fix."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from qevolve.errors import UserError


class LLMError(UserError, RuntimeError):
    hint = (
        "the URL must be the base of an OpenAI-compatible server (…/v1) that answers /chat/completions; "
        "OPENAI_API_KEY is sent as its bearer token when set"
    )


def chat(
    url: str,
    model: str,
    messages: list[dict],
    *,
    key: str,
    timeout: float = 60.0,
    temperature: float = 0.0,
    max_tokens: int | None = None,
    error: type[Exception] = LLMError,
) -> str:
    """The reply's text. Any failure to get one is `error`, naming `key` (the params key) and the URL."""
    body = {"model": model, "temperature": temperature, "messages": messages}
    if max_tokens:
        body["max_tokens"] = max_tokens
    headers = {"Content-Type": "application/json"}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    request = urllib.request.Request(url.rstrip("/") + "/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            content = json.loads(reply.read())["choices"][0]["message"]["content"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as err:
        raise error(
            f"{key} = {url!r}: no usable answer from {url.rstrip('/')}/chat/completions ({type(err).__name__}: {err})"
        ) from None
    if not isinstance(content, str):
        raise error(f"{key} = {url!r}: the answer's content is {type(content).__name__}, not text")
    return content


def json_content(content: str):
    """A reply's JSON, with a Markdown code fence around it allowed (ValueError when it is not JSON)."""
    text = content.strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.rsplit("```", 1)[0]
    return json.loads(text)
