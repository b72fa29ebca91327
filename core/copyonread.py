"""What to hold a dataset's container of Python objects in, so that forked workers share
it rather than copy it as they read it (copy-on-read): one wording for the trainer's log
line and the doctor. Standard library only."""

from __future__ import annotations

import re


def remedy(attribute: str, container: str, item: str) -> str:
    """'a numpy array (`np.array([x.encode() for x in paths])`, decoded when read), a
    pyarrow array or a tensor', for the container at `attribute` (dataset.paths) of
    `container` (list, dict, DataFrame...) holding `item` (str; a dict's key:value)."""
    names = re.findall(r"[A-Za-z_]\w*", attribute)
    name = names[-1] if len(names) > 1 else "items"  # "dataset" alone names no attribute
    if container in ("dict", "defaultdict", "OrderedDict", "Counter"):
        return ("two arrays, its keys and values (numpy: sorted keys found with "
                "`np.searchsorted`), or a pyarrow table")
    if container in ("DataFrame", "Series"):
        return ("a frame whose columns hold no Python objects (numbers, or strings backed "
                "by pyarrow: `.astype(\"string[pyarrow]\")`)")
    if item == "str":
        return (f"a numpy array (`np.array([x.encode() for x in {name}])`, decoded when "
                "read), a pyarrow array or a tensor")
    if item in ("int", "float", "bool", "bytes"):
        return f"a numpy array (`np.array({name}, dtype=...)`), a pyarrow array or a tensor"
    if item in ("tuple", "list", "dict"):
        return ("a numpy array per field (or a structured array), a pyarrow table or "
                "tensors")
    return "numpy arrays of its items' fields, a pyarrow table or tensors"
