"""A griffe extension for the API page: the docstrings of `gradaccum.accumulate` and
`gradaccum.wrap` hold an `{options}` line that
`gradaccum.core.options.documented` fills at import. The site reads the package
statically (no backend is imported, so the JAX and PyTorch pages build without
them), and this extension fills the same line with the same words."""

from __future__ import annotations

import griffe

from gradaccum.core.options import filled


class OptionsDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        docstring = obj.docstring
        if docstring is not None and any(line.strip() == "{options}"
                                         for line in docstring.value.splitlines()):
            docstring.value = filled(docstring.value)
