"""MkDocs hook: the notebook pages stay notebooks with the Chinese edition's plugin on.

mkdocs-jupyter turns each ``.ipynb`` of the nav into a page by wrapping its file (``NotebookFile``) when MkDocs
collects the files; mkdocs-static-i18n then rebuilds the file list for each language, as plain files, after every
other plugin (its ``on_files`` runs at priority -100), and the notebooks would be copied into the site as raw JSON
(mkdocs-static-i18n issue 198). This hook runs after it and wraps them again, as mkdocs-jupyter does.
"""

from __future__ import annotations

from mkdocs.plugins import event_priority
from mkdocs.structure.files import Files


@event_priority(-150)  # after mkdocs-static-i18n's on_files
def on_files(files: Files, config) -> Files:
    from mkdocs_jupyter.plugin import NotebookFile

    jupyter = config.plugins["mkdocs-jupyter"]
    for file in list(files):  # in place: the list is mkdocs-static-i18n's own kind of Files, which the nav needs
        if jupyter.should_include(file) and not isinstance(file, NotebookFile):
            files.remove(file)
            files.append(NotebookFile(file, **config))
    return files
