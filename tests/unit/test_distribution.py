"""The five top-level import names belong to this distribution, ``gpualloc``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

TOP_LEVEL = ("gpualloc", "agent", "controller", "webhook", "certs")
DISTRIBUTION = "gpualloc"


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_top_level_name_is_provided_by_the_gpualloc_distribution(name: str) -> None:
    assert DISTRIBUTION in importlib.metadata.packages_distributions().get(name, [])


def _installed_roots(dist: importlib.metadata.Distribution) -> list[Path]:
    """Where the distribution's code lives: the project dir (editable) or site-packages."""
    direct_url = dist.read_text("direct_url.json")
    if direct_url:
        info = json.loads(direct_url)
        if info.get("dir_info", {}).get("editable"):
            return [Path(unquote(urlparse(info["url"]).path)).resolve()]
    return [Path(str(dist.locate_file(""))).resolve()]


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_top_level_package_imports_from_this_distribution(name: str) -> None:
    dist = importlib.metadata.distribution(DISTRIBUTION)
    spec = importlib.util.find_spec(name)

    assert spec is not None and spec.origin is not None, name
    origin = Path(spec.origin).resolve()
    assert origin.name == "__init__.py"
    assert any(origin.is_relative_to(root / name) for root in _installed_roots(dist)), origin
