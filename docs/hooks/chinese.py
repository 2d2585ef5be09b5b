"""MkDocs hook: a line break inside Chinese text shows as no space on a zh page.

The pages' sources wrap at 120 characters, and HTML turns a line break into a space. Between two words of English
that space belongs there; between two Chinese characters it does not, and a browser such as Chrome still draws it
(CSS leaves the choice to the browser). So on a page of the Chinese edition, a line break with Chinese text or
Chinese punctuation on either side, inline tags between (``是\n<strong>重点``), is dropped from the rendered HTML,
outside ``<pre>`` blocks. The sources keep
their wrapped lines, so a change shows as a small diff.
"""

from __future__ import annotations

import re

WIDE = "\u3000-\u303f\u3400-\u9fff\uf900-\ufaff\uff00-\uffef"  # CJK characters, CJK and full-width punctuation
PUNCTUATION = "\u3000-\u303f\uff00-\uffef"
CLOSE, OPEN = r"((?:</\w+>)*)", r"((?:<(?!pre\b)\w[^>]*>)*)"  # inline tags (bold, a link, code) around the break
BREAK = re.compile(rf"(?<=[{WIDE}]){CLOSE}\n[ \t]*{OPEN}(?=[{WIDE}])"
                   rf"|(?<=[{PUNCTUATION}]){CLOSE}\n[ \t]*{OPEN}|{CLOSE}\n[ \t]*{OPEN}(?=[{PUNCTUATION}])")
PRE = re.compile(r"(<pre\b.*?</pre>)", re.S)


def join_chinese_lines(html: str) -> str:
    def keep_tags(match: re.Match) -> str:
        return "".join(tag or "" for tag in match.groups())

    return "".join(part if part.startswith("<pre") else BREAK.sub(keep_tags, part) for part in PRE.split(html))


def on_page_content(html: str, page, config, files) -> str:
    return join_chinese_lines(html) if page.file.src_uri.endswith(".zh.md") else html
