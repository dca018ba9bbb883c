"""Reasoning handed to an agent as an opaque string, read back when the agent sends its history again.

Responses clients (codex) drop a reasoning item's text but echo its `encrypted_content`; gemini-cli
drops thought parts but keeps a part's `thoughtSignature`. Carrying the reasoning itself in that
string lets the proxy rebuild the exact assistant message it answered with, without per-session
state and across proxy restarts. The string is base64 (Gemini's signatures are bytes: the Python
SDK decodes them and sends them back re-encoded, possibly in the other base64 alphabet) of a magic
prefix and the text; opaque strings from anywhere else (a real provider's, gemini-cli's synthetic
signature) are not ours and read as None.
"""

from __future__ import annotations

import base64
import binascii

MAGIC = b"harness-rl reasoning v1\x00"


def wrap(reasoning: str) -> str:
    return base64.urlsafe_b64encode(MAGIC + reasoning.encode()).decode()


def unwrap(token: str | None) -> str | None:
    """The reasoning `wrap` sealed into `token`; None for a token that is not ours."""
    if not token:
        return None
    try:
        data = base64.b64decode(token.replace("+", "-").replace("/", "_"), altchars=b"-_", validate=True)
        return data[len(MAGIC):].decode() if data.startswith(MAGIC) else None
    except (binascii.Error, ValueError):
        return None
