"""The serve page's table of bad requests is the server's own answers: each probe is sent, and the table must match.

``docs/assets/serve-answers.md`` (included by docs/serve.md) lists, for each probe, the status,
the parameter named as at fault (OpenAI's ``param``) and the message the server gives. This
test sends every probe to a real server (m2 on the tiny
model, with small limits so that each one is cheap to reach) and compares the table it builds
with the committed one, so the page cannot drift from the server. After a deliberate change:

    REFRESH_SERVE_ANSWERS=1 .venv/bin/python -m pytest tests/test_serve_answers.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from milestones.server.app import create_app
from milestones.server.limits import Limits
from milestones.server.listen import running
from tests.test_serve import LIMITS

TABLE = Path(__file__).resolve().parents[1] / "docs" / "assets" / "serve-answers.md"
SERVER_LIMITS = Limits(max_requests=4, max_n=8, max_body_bytes=10_000)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# situation -> (method, route, body: a JSON value, or bytes sent as they are)
PROBES: dict[str, tuple[str, str, object]] = {
    "malformed JSON": ("POST", COMPLETIONS, b'{"prompt": "hi",'),
    "JSON nested 4,000 deep": ("POST", COMPLETIONS, b"[" * 4_000 + b"]" * 4_000),
    "a lone surrogate in a chat message": ("POST", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    "an unknown parameter": ("POST", COMPLETIONS, {"prompt": "hi", "best_of_all": 2}),
    "an image part": ("POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
    "`n` above `--max-n` (8 here)": ("POST", COMPLETIONS, {"prompt": "hi", "n": 100_000}),
    "3 prompts x `n` = 2 above `--max-requests` (4 here)": ("POST", COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2}),
    "a body over `--max-body-bytes` (10,000 here)": ("POST", COMPLETIONS, {"prompt": "x" * 20_000}),
    "more than 16 stop strings": ("POST", COMPLETIONS, {"prompt": "hi", "stop": [str(i) for i in range(20)]}),
    "`temperature: -1`": ("POST", COMPLETIONS, {"prompt": "hi", "temperature": -1}),
    "`top_p: 2`": ("POST", COMPLETIONS, {"prompt": "hi", "top_p": 2}),
    "`max_tokens: 0`": ("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 0}),
    "`top_logprobs: 21` in a chat": ("POST", CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                                   "top_logprobs": 21}),
    "a prompt longer than `max_model_len` (256 here)": ("POST", COMPLETIONS, {"prompt": list(range(5, 305))}),
    "another model's name": ("POST", COMPLETIONS, {"prompt": "hi", "model": "gpt-4"}),
    "an unknown route": ("GET", "/v1/engines", None),
    "a wrong method": ("GET", COMPLETIONS, None),
}


def answer(client: httpx.Client, method: str, route: str, body: object) -> tuple[int, str, str]:
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    response = client.request(method, route, content=content, headers={"content-type": "application/json"})
    if response.status_code < 400:
        return response.status_code, "", "(served)"
    error = response.json()["error"]
    return response.status_code, "" if error["param"] is None else f"`{error['param']}`", error["message"]


def render(rows: list[tuple[str, int, str]]) -> str:
    lines = ["<!-- written by tests/test_serve_answers.py from the server's answers: do not edit by hand -->",
             "| request | status | param | message |", "|---|---|---|---|"]
    for situation, status, param, message in rows:
        shown = message if len(message) <= 240 else message[:237] + "..."
        lines.append(f"| {situation} | {status} | {param} | {shown.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


def test_the_pages_table_is_what_the_server_answers(tiny_model_path):
    from milestones import m2

    app = create_app(m2.LLM(tiny_model_path, **LIMITS), "tiny", limits=SERVER_LIMITS)
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        rows = [(situation, *answer(client, *probe)) for situation, probe in PROBES.items()]
    table = render(rows)
    if os.environ.get("REFRESH_SERVE_ANSWERS"):
        TABLE.write_text(table)
    assert all(400 <= status < 500 for _, status, *_ in rows), f"a probe was not refused as a client's mistake: {rows}"
    if TABLE.read_text() != table:
        pytest.fail(f"{TABLE.name} is not what the server answers now; rerun with REFRESH_SERVE_ANSWERS=1 after a "
                    f"deliberate change. The server's table:\n{table}")
