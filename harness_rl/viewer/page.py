"""One self-contained HTML page: the template with its CSS, script and the `View` inlined.

Nothing is fetched when the page opens: no fonts, no scripts, no data from anywhere else, so the
file can be mailed, archived with the run, or opened on a machine without network.
"""

from __future__ import annotations

import html
import re
from importlib.resources import files

import msgspec

from harness_rl.viewer.model import View

_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def _asset(name: str) -> str:
    return files("harness_rl.viewer").joinpath("assets", name).read_text(encoding="utf-8")


def render_page(view: View) -> str:
    # Inside <script type="application/json"> only "</script" could end the element early; escaping
    # every "<" as \u003c keeps the JSON identical once parsed and makes that impossible.
    data = msgspec.json.encode(view).decode().replace("<", "\\u003c")
    parts = {"title": html.escape(view.title), "css": _asset("viewer.css"), "js": _asset("viewer.js"), "data": data}
    # One pass, so text inside the inserted parts is never taken for a placeholder.
    return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], _asset("page.html"))
