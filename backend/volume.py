"""The identity of a cache directory, so a proxy can tell that a remote worker shares it.

The proxy writes a random id into `cache_dir/.prefixgate-volume` once (never rewritten); a worker
reports the id it reads from its own `--cache-dir` in `/health`. Equal ids mean both see the same
directory (the same volume), so a state file the worker writes is one the proxy can index and
another worker can restore. Different or missing ids mean a wrong mount: the proxy refuses.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

VOLUME_ID_FILE = ".prefixgate-volume"


def read(cache_dir: Path) -> str:
    """The id in `cache_dir`, or "" when there is none (or it cannot be read)."""
    try:
        return (Path(cache_dir) / VOLUME_ID_FILE).read_text().strip()
    except OSError:
        return ""


def ensure(cache_dir: Path) -> str:
    """The id in `cache_dir`, created first if missing (atomically: a racing writer wins)."""
    path = Path(cache_dir) / VOLUME_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex + "\n")
    return read(cache_dir)
