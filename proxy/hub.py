"""`-hf user/model[:quant]` (llama-server's `--hf-repo`): a GGUF from a Hugging Face repository,
through `huggingface_hub` and its cache (`HF_HOME`, `HF_HUB_CACHE`; `HF_TOKEN` for a gated
repository). Online, the repository's file list picks the file and only that file is
downloaded (once: the cache keeps it). With `HF_HUB_OFFLINE=1` the cached snapshot is used, and
nothing is fetched.

Which file (`pick`), as llama-server picks it: `--hf-file` names it; otherwise the GGUF whose
name holds the quant (case-insensitive), Q4_K_M when none is given, else the first GGUF. Vision
projectors (mmproj) are never the model; of a split model the first part is taken (llama.cpp
loads the others from beside it).

A hub that cannot be reached (no network, a firewall, a wrong HF_ENDPOINT) is found with one
probe of `PROBE_TIMEOUT_S`, not the client's minute of retries; the cache is used then, as
offline. Whatever goes wrong is a ValueError of one line, never a traceback.
"""

from __future__ import annotations

import os
import re

DEFAULT_QUANT = "Q4_K_M"  # llama-server's
PROBE_TIMEOUT_S = 5.0  # how long the hub has to answer one request before it counts as down
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def _model_file(path: str) -> bool:
    name = os.path.basename(path).lower()
    if not name.endswith(".gguf") or "mmproj" in name:
        return False
    split = _SPLIT.search(name)
    return split is None or split.group(1) == "00001"


def pick(files: list[str], quant: str) -> str:
    """The model file among a repository's `files` for `quant` ("" = the default)."""
    ggufs = sorted(f for f in files if _model_file(f))
    if not ggufs:
        raise ValueError("it holds no GGUF model file")
    if quant:
        hits = [f for f in ggufs if quant.lower() in os.path.basename(f).lower()]
        if not hits:
            raise ValueError(f"no GGUF file of quant {quant} in it (there are: "
                             f"{', '.join(os.path.basename(f) for f in ggufs)})")
        return hits[0]
    hits = [f for f in ggufs if DEFAULT_QUANT.lower() in os.path.basename(f).lower()]
    return (hits or ggufs)[0]


def unreachable() -> str:
    """Why the hub does not answer ("" when it does, or downloads are off): one request."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return ""
    try:
        get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S)
    except Exception as e:  # any transport error of the hub's HTTP client
        return f"{constants.ENDPOINT}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return ""


def resolve(spec: str, filename: str = "") -> str:
    """user/model[:quant] (and --hf-file) -> the local path of its GGUF in the Hugging Face
    cache, downloaded there first when it is missing and downloads are allowed. A ValueError
    says in one line what went wrong."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, _, quant = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ValueError(f"-hf wants user/model[:quant], got {spec!r}")
    down = unreachable()
    local = bool(down)  # the cache only, as offline
    try:
        if not filename:
            try:
                if local:
                    raise OSError(down)
                files = HfApi().list_repo_files(repo)
            except (OSError, HfHubHTTPError):  # offline, or no network: the cached snapshot
                folder = snapshot_download(repo, local_files_only=True)
                files = [os.path.relpath(os.path.join(d, f), folder)
                         for d, _, names in os.walk(folder) for f in names]
            filename = pick(files, quant)
        return str(hf_hub_download(repo, filename, local_files_only=local))
    except LocalEntryNotFoundError:
        why = f"the hub is unreachable ({down})" if down else \
            "downloads are off (HF_HUB_OFFLINE) or the hub is unreachable"
        raise ValueError(f"-hf {repo}: not in the Hugging Face cache "
                         f"({os.environ.get('HF_HUB_CACHE') or 'HF_HOME'}) and {why}") from None
    except HfHubHTTPError as e:  # not found, gated (HF_TOKEN), ...: the hub's reason
        raise ValueError(f"-hf {repo}: {str(e).splitlines()[0]}") from None
    except ValueError as e:
        raise ValueError(f"-hf {spec}: {e}") from None
    except Exception as e:  # the hub's client failing another way (a dropped connection)
        raise ValueError(f"-hf {repo}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'no detail'}") from None
