"""A failed pod's own words: the end of its log (``<run dir>/logs/<pod>.log``) and the line
that names its error, so a pod that fails before it ever heartbeats (a wrong ``python``, a
``ModuleNotFoundError`` in the script, a bad command) is reported by ``ceaseless up``
itself, not only left in a file (issue 33)."""

from __future__ import annotations

import os
import re
from pathlib import Path

# the last line of a Python traceback: "ModuleNotFoundError: No module named 'x'"
_EXC = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b(:.*)?$")
# asyncio's noise after an interpreter exits with tasks pending
_NOISE = ("Task was destroyed but it is pending", "task: <Task ")


def tail(path: str | Path | None, lines: int = 20, max_bytes: int = 64 * 1024) -> list[str]:
    """The last ``lines`` lines of the file at ``path`` (reads at most its last
    ``max_bytes``); [] when it cannot be read."""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    text = data.decode(errors="replace").splitlines()
    if size > max_bytes and text:
        text = text[1:]  # a partial first line
    return [ln.rstrip() for ln in text[-lines:]]


def error_line(lines: list[str]) -> str | None:
    """The line of a log tail that names the error: the last exception line of a
    traceback, else the last line that is not asyncio's exit noise; None if empty."""
    useful = [ln for ln in lines if ln.strip() and not ln.startswith(_NOISE)]
    for ln in reversed(useful):
        if _EXC.match(ln.strip()):
            return ln.strip()
    return useful[-1].strip() if useful else None
