"""`-hf user/model[:quant]` (llama-server's `--hf-repo`), and `-hfd` for the draft model: a GGUF
from a Hugging Face repository, through `huggingface_hub` and its cache (`HF_HOME`,
`HF_HUB_CACHE`; `-hft` or `HF_TOKEN` for a gated repository). Online, the repository's file list
picks the file and only its files are downloaded (once: the cache keeps them). With `--offline`
(or `HF_HUB_OFFLINE=1`) the cached snapshot is used, and nothing is fetched.

Which file, as llama.cpp's `common/download.cpp` picks it (`pick`):
- `user/model:TAG` splits at the last colon; `--hf-file` names the file exactly instead;
- a model file is a `.gguf` whose name holds none of mmproj, imatrix, `mtp-`, `eagle3-`,
  `dflash-`, `dspark-` (projectors, importance matrices, draft heads);
- the first model file, in the repository's order, whose path holds the tag followed by `.` or
  `-` (case-insensitive: `:q4_k_m` finds `x-Q4_K_M.gguf` and `Q4_K_M/x-Q4_K_M-00001-of-00003.gguf`,
  but `:Q4_K` does not find `x-Q4_K_M.gguf`); of a split model only its first part is a
  candidate. No tag: Q4_K_M, else Q8_0, else the first model file. A tag that finds nothing is
  an error that lists the files there are (no fallback);
- a split model (`NAME-00001-of-0000N.gguf`) brings every part with the same name and count
  (`parts`), downloaded beside each other, and the first part's path is the model's (llama.cpp
  loads the others from beside it; backend/keys.py hashes them all).
A repository with a `preset.ini` at its root is a llama-server preset (router mode): refused.

A hub that cannot be reached (no network, a firewall, a wrong HF_ENDPOINT) is found with one
probe of `PROBE_TIMEOUT_S`, not the client's minute of retries; the cache is used then, as
offline. Whatever goes wrong is a ValueError of one line, never a traceback.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from backend.redact import scrub

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")  # llama.cpp's find_best_model, when no tag is given
NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
PROBE_TIMEOUT_S = 5.0  # how long the hub has to answer one request before it counts as down


@dataclass(frozen=True, slots=True)
class Split:
    """A GGUF path as llama.cpp reads its name: the prefix (the tag included), part, parts."""

    prefix: str
    index: int = 1
    count: int = 1


def split_of(path: str) -> Split | None:
    """None for a path that is not a .gguf."""
    if not path.endswith(".gguf"):
        return None
    prefix = path[: -len(".gguf")]
    m = _SPLIT.match(prefix)
    return Split(m.group(1), int(m.group(2)), int(m.group(3))) if m else Split(prefix)


def split_tag(spec: str, flag: str = "-hf") -> tuple[str, str]:
    """user/model[:tag] -> (user/model, tag), as llama.cpp splits it."""
    words = spec.split(":")
    repo, tag = words[0], words[-1] if len(words) > 1 else ""
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ValueError(f"{flag} wants user/model[:quant], got {spec!r}")
    return repo, tag


def is_model(path: str) -> bool:
    name = os.path.basename(path)
    return path.endswith(".gguf") and not any(word in name for word in NOT_MODELS)


def pick(files: list[str], tag: str) -> str:
    """The model file among a repository's `files` (in its order) for `tag` ("" = none)."""
    for t in (tag,) if tag else DEFAULT_TAGS:
        pattern = re.compile(re.escape(t) + "[.-]", re.IGNORECASE)
        for f in files:
            split = split_of(f)
            if is_model(f) and pattern.search(f) and split is not None and split.index == 1:
                return f
    if not tag:
        for f in files:
            split = split_of(f)
            if is_model(f) and split is not None and split.index == 1:
                return f
    ggufs = [os.path.basename(f) for f in files if f.endswith(".gguf")]
    if not any(is_model(f) for f in files):
        raise ValueError("it holds no GGUF model file")
    raise ValueError(f"no GGUF file of quant {tag} in it (there are: {', '.join(ggufs)})")


def parts(files: list[str], primary: str) -> list[str]:
    """Every file of the model `primary` is (its split parts in order; itself alone if it is
    not split)."""
    split = split_of(primary)
    if split is None or split.count <= 1:
        return [primary]
    same = [(s.index, f) for f in files if (s := split_of(f)) is not None
            and s.prefix == split.prefix and s.count == split.count]
    found = [f for _, f in sorted(same)]
    if len(found) != split.count:
        raise ValueError(f"{os.path.basename(primary)} is part of {split.count} files, and "
                         f"{len(found)} of them are in the repository")
    return found


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


@dataclass(frozen=True, slots=True)
class Hub:
    """How the hub is asked: with a token (llama-server's `-hft`; "" = huggingface_hub's own:
    HF_TOKEN, a stored login) and online, or from its cache only (`--offline`, as
    HF_HUB_OFFLINE=1). The token is sent to the hub only, never shown."""

    token: str = field(default="", repr=False)
    offline: bool = False

    def resolve(self, spec: str, filename: str = "", flag: str = "-hf") -> str:
        """user/model[:quant] (and its file, `--hf-file`) -> the local path of its GGUF (the
        first part of a split model) in the Hugging Face cache, every file of it downloaded
        there first when missing and downloads are allowed. A ValueError says in one line
        what went wrong, naming `flag`."""
        from huggingface_hub import constants

        was = constants.HF_HUB_OFFLINE
        # offline, huggingface_hub's own calls too (it fetches a registry of its own)
        constants.HF_HUB_OFFLINE = was or self.offline
        try:
            return self._resolve(spec, filename, flag)
        except ValueError as e:  # the hub's own words never carry the token; made sure
            raise ValueError(scrub(str(e), [self.token] if self.token else [])) from None
        finally:
            constants.HF_HUB_OFFLINE = was

    def _resolve(self, spec: str, filename: str, flag: str) -> str:
        from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        repo, tag = split_tag(spec, flag)
        token = self.token or None
        down = unreachable()  # "" offline: nothing is asked
        local = constants.HF_HUB_OFFLINE or bool(down)  # the cache only
        refused = ""  # the hub's answer when it would not list the repository
        try:
            try:
                if local:
                    raise OSError(down)
                files = HfApi(token=token).list_repo_files(repo)
            except (OSError, HfHubHTTPError) as e:  # offline, no network, or refused: the
                if isinstance(e, HfHubHTTPError):  # cached snapshot, and its files
                    refused, local = str(e).splitlines()[0] if str(e) else type(e).__name__, True
                folder = snapshot_download(repo, local_files_only=True)
                files = sorted(os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
                               for d, _, names in os.walk(folder) for f in names)
            if "preset.ini" in files:
                raise ValueError("it is a llama-server preset (preset.ini): serving several "
                                 "models is not supported")
            if filename and filename not in files:
                raise ValueError(f"no file {filename} in it")
            primary = filename or pick(files, tag)
            paths = [str(hf_hub_download(repo, f, local_files_only=local, token=token))
                     for f in parts(files, primary)]
            return paths[0]
        except LocalEntryNotFoundError:
            why = f"the hub is unreachable ({down})" if down else \
                f"the hub refused it: {refused}" if refused else \
                "downloads are off (--offline, HF_HUB_OFFLINE) or the hub is unreachable"
            raise ValueError(f"{flag} {repo}: not in the Hugging Face cache "
                             f"({os.environ.get('HF_HUB_CACHE') or 'HF_HOME'}) and {why}"
                             ) from None
        except HfHubHTTPError as e:  # not found, gated (a token), ...: the hub's reason
            raise ValueError(f"{flag} {repo}: {str(e).splitlines()[0]}") from None
        except ValueError as e:
            raise ValueError(f"{flag} {spec}: {e}") from None
        except Exception as e:  # the hub's client failing another way (a dropped connection)
            raise ValueError(f"{flag} {repo}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else 'no detail'}") from None
