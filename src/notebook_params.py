"""The notebooks' papermill parameters: a list given with `-p` arrives as its text.

papermill's `-p` turns numbers, bools and None into Python values and leaves anything else a
string, so `-p spec '["ngram"]'` hands the notebook a str, which a loop then reads letter by
letter. `-y 'spec: [ngram]'` (YAML) gives the list.
"""
from __future__ import annotations


def check_list_params(_lengths: dict[str, int] | None = None, _may_be_empty: tuple[str, ...] = (),
                      **params) -> None:
    """Each keyword a list or tuple, of `_lengths[name]` items where given (a pair), and not empty
    unless named in `_may_be_empty` (a list of sections to show, where none is a choice); the error
    names the parameter and papermill's `-y`. An empty one would fail later, far from its name."""
    for name, value in params.items():
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}: a list, got {type(value).__name__} {value!r} "
                             f"(papermill: -y '{name}: [...]', not -p)")
        if not value and name not in _may_be_empty:
            raise ValueError(f"{name}: an empty list; give at least one item")
        want = (_lengths or {}).get(name)
        if want is not None and len(value) != want:
            raise ValueError(f"{name}: {want} items, got {len(value)}: {list(value)!r}")


def parameter_names(notebook) -> list[str]:
    """The names the notebook's `parameters` cell assigns, in order (papermill's cell: plain
    literals, one name each)."""
    import ast
    import json
    from pathlib import Path

    cells = json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise ValueError(f"notebook: {notebook} has {len(tagged)} cells tagged 'parameters', not one")
    tree = ast.parse("".join(tagged[0]["source"]))
    return [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
            if isinstance(t, ast.Name)]


def notebook_command(name: str, namespace: dict) -> str:
    """The papermill command that runs notebook `name` (in notebooks/) with the parameter values
    `namespace` holds (a notebook passes globals()): its records' `command`, which a reader can
    run as written, not the notebook's name alone. The values go as papermill's `-y` YAML (JSON
    would give 1e-05 back as a string); one YAML cannot hold is written as its str."""
    import shlex

    import yaml

    from . import project_root

    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)

    path = project_root() / "notebooks" / name
    try:
        names = parameter_names(path)
    except (OSError, ValueError, SyntaxError) as e:   # the records matter more than their command line
        return f"notebooks/{name} (its parameters unread: {e})"
    values = {k: plain(namespace[k]) for k in names if k in namespace}
    text = yaml.safe_dump(values, default_flow_style=True, sort_keys=False, width=1 << 30).strip()
    return shlex.join(["papermill", "--cwd", "notebooks", f"notebooks/{name}", f"/tmp/{name}", "-y", text])
