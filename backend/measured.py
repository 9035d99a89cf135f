"""What a worker measured once at start and keeps for the next start: a JSON file per measure
and key beside the self-check's verdicts (`backend.verdicts.verdicts_dir`), named by a key
that changes with the model, the settings, the build and the machine (`verdicts.verdict_key`).

    recall(kind, key) -> dict | None     None where nothing (readable) was kept
    remember(kind, key, data)            atomically; a directory that cannot be written costs
                                         a measure per start, said once here

Unlike a verdict, a measure carries no MAC: an edited one changes a speed, never a bit (the
self-check still proves whatever batches and verifies it leads to).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("prefixgate.worker")


def _path(kind: str, key: str) -> Path:
    from backend.verdicts import verdicts_dir

    return verdicts_dir().parent / kind / f"{key}.json"


def recall(kind: str, key: str) -> dict[str, Any] | None:
    path = _path(kind, key)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not an object")
        return data
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the remembered %s measure %s (%s): measuring again", kind, path, e)
        return None


def remember(kind: str, key: str, data: Mapping[str, Any]) -> None:
    path = _path(kind, key)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({**data, "measured_at": time.time()}))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot remember the %s measure in %s (%s): every start measures", kind,
                    path.parent, e)
