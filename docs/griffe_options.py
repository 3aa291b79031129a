"""A griffe extension for the API page. The doors (`gradaccum.accumulate`,
`gradaccum.wrap`, `AccumulatingModel`) take the options as `**options` typed by
`gradaccum.core.options.AccumulationOptions`, and `takes_options` gives them the whole
signature and their docstring's `Args:` at import. The site reads the package
statically (no backend is imported, so the JAX and PyTorch pages build without
them), and this extension does the same: the signature shows each option with its
type and default, and the docstring's `{options}` line is filled with the same
words."""

from __future__ import annotations

import griffe

from gradaccum.core.options import DEFAULTS, NAMES, TYPES, filled


def _expanded(function: griffe.Function) -> None:
    """`function`'s `**options` (or the options before its `**kwargs`) as one
    keyword-only parameter per option."""
    parameters = list(function.parameters)
    tail = parameters.pop() if parameters and parameters[-1].kind is (
        griffe.ParameterKind.var_keyword) else None
    present = {p.name for p in parameters}
    parameters += [
        griffe.Parameter(name, annotation=TYPES[name], kind=griffe.ParameterKind.keyword_only,
                         default=repr(DEFAULTS[name]))
        for name in NAMES if name not in present
    ]
    if tail is not None and tail.name != "options":
        parameters.append(griffe.Parameter(tail.name, annotation="Any", kind=tail.kind))
    function.parameters = griffe.Parameters(*parameters)


class OptionsDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if isinstance(obj, griffe.Function) and any(
                decorator.callable_path.endswith("takes_options")
                for decorator in obj.decorators):
            _expanded(obj)
        docstring = obj.docstring
        if docstring is not None and any(line.strip() == "{options}"
                                         for line in docstring.value.splitlines()):
            docstring.value = filled(docstring.value)
