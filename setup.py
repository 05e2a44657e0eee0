"""Optional compilation of the webhook's hot path with mypyc; everything else is in pyproject.toml.

``GPUALLOC_MYPYC=1`` compiles the modules listed under ``[tool.gpualloc]`` in
pyproject.toml to C extensions (the image is
built so; see the Dockerfile). They are the same source, typed under mypy
--strict, and run unchanged as plain Python when not compiled: a development
install (``make setup``) is not compiled, so an edit takes effect at once.
``make compiled`` builds them into ``.compiled/`` for the benchmark and for
``make test-compiled``. Why: in the server, interpreting the admission path
costs 5 to 7 µs of each admission's 84 to 93 (BENCHMARKS.md).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from setuptools import setup

# The modules, from [tool.gpualloc] in pyproject.toml (the tests read the same list).
with open(Path(__file__).with_name("pyproject.toml"), "rb") as f:
    COMPILED = tomllib.load(f)["tool"]["gpualloc"]["mypyc"]

ext_modules = []
if os.environ.get("GPUALLOC_MYPYC") == "1":
    from mypyc.build import mypycify

    ext_modules = mypycify(COMPILED, opt_level="3")

setup(ext_modules=ext_modules)
