"""Keep the built site free of network fetches for diagrams (mkdocs hook).

The notebook pages come from nbconvert, whose page template adds a loader that imports
mermaid from a CDN for Jupyter's own mermaid cells. No notebook here has one, and the
site's vendored mermaid (``extra_javascript``) draws every diagram, so the loader is
dropped from the built pages: nothing on the site asks the network for mermaid.
"""

from __future__ import annotations

import re

NBCONVERT_MERMAID_LOADER = re.compile(
    r"<script type=\"module\">(?:(?!</script>).)*\.jp-Mermaid > pre\.mermaid.*?</script>", re.S
)


def on_post_page(output: str, page, config) -> str:
    return NBCONVERT_MERMAID_LOADER.sub("", output)
