"""The commit this copy of the package was archived from.

`git archive` fills the string in (.gitattributes: export-subst), so a wheel built from
`git archive HEAD` (the GPU machine's `.whlp`) knows the code it holds without a .git. In a
checkout the string stays unfilled.
"""
ARCHIVED_FROM = "$Format:%H$"


def archived_commit() -> str | None:
    """The full commit, or None in a checkout (or an archive made without export-subst)."""
    return None if ARCHIVED_FROM.startswith("$") else ARCHIVED_FROM
