"""URLs as logs, errors and HTTP bodies may show them: without their secrets.

    redact_url(url) -> str        user and password dropped, secret-bearing query values hidden
    url_secrets(url) -> [str]     the secrets a URL holds, to scrub from any other text
    scrub(text, secrets) -> str   `text` with each of them replaced

A URL may carry a secret in its user info (`redis://user:pass@host`, `http://admin:pw@host`)
and, the way redis-py documents it, in its query (`redis://host:6379/0?password=...`); any query
parameter whose name says password, secret, token, key, auth or credential is one. A URL that
cannot be parsed shows as "(not a URL)", never as itself.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

HIDDEN = "***"
_SECRET_NAME = re.compile(r"pass|secret|token|key|auth|cred|sig", re.IGNORECASE)


def _split(url: str) -> tuple[str, str, str, str, str, str] | None:
    """(scheme, user info, host part, path, query, fragment), or None for no URL."""
    if "://" not in url:
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    user, _, host = parts.netloc.rpartition("@")
    return parts.scheme, user, host, parts.path, parts.query, parts.fragment


def redact_url(url: str) -> str:
    """The URL without its user info, secret query values shown as ***, no fragment
    (redis://:pw@host:6379/0?password=pw -> redis://host:6379/0?password=***)."""
    split = _split(url)
    if split is None:
        return "(not a URL)"
    scheme, _, host, path, query, _ = split
    pairs = []
    for pair in query.split("&") if query else ():
        name, sep, _value = pair.partition("=")
        pairs.append(f"{name}={HIDDEN}" if sep and _SECRET_NAME.search(unquote(name))
                     else pair)
    return f"{scheme}://{host}{path}" + (f"?{'&'.join(pairs)}" if pairs else "")


def url_secrets(url: str) -> list[str]:
    """Every secret the URL holds (its password, secret query values), as written and
    decoded, longest first; [] when it holds none or is no URL."""
    split = _split(url)
    if split is None:
        return []
    _, user, _, _, query, fragment = split
    # the password; a user info without one may be a token (https://TOKEN@host)
    found = [user.partition(":")[2] if ":" in user else user] if user else []
    for pair in query.split("&") if query else ():
        name, sep, value = pair.partition("=")
        if sep and value and _SECRET_NAME.search(unquote(name)):
            found.append(value)
    if fragment:
        found.append(fragment)
    found += [unquote(s) for s in found]
    return sorted({s for s in found if s}, key=len, reverse=True)


def scrub(text: str, secrets: list[str]) -> str:
    for s in secrets:
        text = text.replace(s, HIDDEN)
    return text
