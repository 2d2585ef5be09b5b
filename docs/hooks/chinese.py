"""MkDocs hook: a line break inside Chinese text shows as no space on a zh page.

The pages' sources wrap at 120 characters, and HTML turns a line break into a space. Between two words of English
that space belongs there; between two Chinese characters it does not, and a browser such as Chrome still draws it
(CSS leaves the choice to the browser). So on a page of the Chinese edition, a line break with Chinese text or
Chinese punctuation on either side is dropped from the rendered HTML, outside ``<pre>`` blocks. The sources keep
their wrapped lines, so a change shows as a small diff.
"""

from __future__ import annotations

import re

WIDE = "\u3000-\u303f\u3400-\u9fff\uf900-\ufaff\uff00-\uffef"  # CJK characters, CJK and full-width punctuation
PUNCTUATION = "\u3000-\u303f\uff00-\uffef"
BREAK = re.compile(rf"(?<=[{WIDE}])\n[ \t]*(?=[{WIDE}])|(?<=[{PUNCTUATION}])\n[ \t]*|\n[ \t]*(?=[{PUNCTUATION}])")
PRE = re.compile(r"(<pre\b.*?</pre>)", re.S)


def join_chinese_lines(html: str) -> str:
    return "".join(part if part.startswith("<pre") else BREAK.sub("", part) for part in PRE.split(html))


def on_page_content(html: str, page, config, files) -> str:
    return join_chinese_lines(html) if page.file.src_uri.endswith(".zh.md") else html
