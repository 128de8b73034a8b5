"""The web page's files (deepinfer_core/serve/web/): nothing comes from the internet (no absolute
URL, no CDN), every URL is relative (so --root-path works), every file ships as package data,
and every control in the HTML has a label."""

from __future__ import annotations

import re
from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path

import pytest

import deepinfer_core

WEB = Path(deepinfer_core.__file__).parent / "serve" / "web"
ROOT = Path(deepinfer_core.__file__).parents[1]


def test_no_absolute_url_anywhere():
    for path in WEB.iterdir():
        text = path.read_text(encoding="utf-8")
        absolute = re.findall(r"""(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s"'`)]*""", text)
        absolute = [u for u in absolute if u != "http://www.w3.org/2000/svg"]  # the SVG namespace: a name, not a fetch
        assert not absolute, (path.name, absolute)
        # fetches and links are relative to the page's <base href>: a leading "/" would miss a root path
        assert not re.findall(r"""(?:fetch|getJSON|getText|postJSON|postStream)\(\s*["'`]/""", text), path.name
        assert not re.findall(r"""(?:src|href)=["']/""", text), path.name


def test_every_file_is_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["deepinfer_core.serve"]
    for path in WEB.iterdir():
        assert any(fnmatch(f"web/{path.name}", p) for p in patterns), path.name


class _Controls(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.labelled: set[str] = set()
        self.controls: list[dict] = []
        self.buttons: list[tuple[dict, str]] = []
        self._button: dict | None = None
        self._text = ""
        self._in_label = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "label":
            self._in_label += 1
            if "for" in attrs:
                self.labelled.add(attrs["for"])
        if tag in ("input", "textarea", "select"):
            self.controls.append({**attrs, "inside_label": self._in_label > 0})
        if tag == "button":
            self._button, self._text = attrs, ""

    def handle_data(self, data):
        if self._button is not None:
            self._text += data

    def handle_endtag(self, tag):
        if tag == "label":
            self._in_label -= 1
        if tag == "button" and self._button is not None:
            self.buttons.append((self._button, self._text.strip()))
            self._button = None


def test_every_control_in_the_page_has_a_label():
    page = _Controls()
    page.feed((WEB / "index.html").read_text(encoding="utf-8"))
    assert len(page.controls) > 8 and len(page.buttons) > 8
    for control in page.controls:
        assert control["inside_label"] or control.get("id") in page.labelled or control.get("aria-label"), control
    for attrs, text in page.buttons:
        assert text or attrs.get("aria-label"), attrs
