"""The notebooks' papermill parameters: a list given with `-p` arrives as its text.

papermill's `-p` turns numbers, bools and None into Python values and leaves anything else a
string, so `-p spec '["ngram"]'` hands the notebook a str, which a loop then reads letter by
letter. `-y 'spec: [ngram]'` (YAML) gives the list.
"""
from __future__ import annotations


def check_list_params(**params) -> None:
    """Each keyword a list or tuple; the error names the parameter and papermill's `-y`."""
    for name, value in params.items():
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}: a list, got {type(value).__name__} {value!r} "
                             f"(papermill: -y '{name}: [...]', not -p)")
