"""Log lines: one JSON object per line with the fixed keys and the extras; text for humans."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from gpualloc.runtime import logging as runtime_logging


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_json_line_has_time_level_component_logger_msg_and_extras(restore_root_logger: None) -> None:
    stream = io.StringIO()
    runtime_logging.setup("controller", fmt="json", level="INFO", stream=stream)
    logging.getLogger("controller.reconciling").info(
        "allocated %d devices", 2, extra={"claim": "team-a/train", "node": "gpu-node-3"}
    )
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["level"] == "INFO"
    assert line["component"] == "controller"
    assert line["logger"] == "controller.reconciling"
    assert line["msg"] == "allocated 2 devices"
    assert line["claim"] == "team-a/train"
    assert line["node"] == "gpu-node-3"
    assert line["time"].endswith("Z") and "T" in line["time"]
    assert set(line) == {"time", "level", "component", "logger", "msg", "claim", "node"}


def test_json_line_carries_the_exception_and_stays_one_line(restore_root_logger: None) -> None:
    stream = io.StringIO()
    runtime_logging.setup("agent", stream=stream)
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        logging.getLogger("agent.nvml").exception("failed", extra={"obj": object()})
    (raw,) = stream.getvalue().splitlines()
    line = json.loads(raw)
    assert "ValueError: bad" in line["exc"]
    assert line["obj"].startswith("<object object")  # not JSON serialisable: written as str


def test_level_filters_lower_records(restore_root_logger: None) -> None:
    stream = io.StringIO()
    runtime_logging.setup("webhook", level="warning", stream=stream)
    logging.getLogger("webhook.server").info("quiet")
    logging.getLogger("webhook.server").warning("loud")
    assert [json.loads(x)["msg"] for x in stream.getvalue().splitlines()] == ["loud"]


def test_text_format_is_human_readable_with_key_values(restore_root_logger: None) -> None:
    stream = io.StringIO()
    runtime_logging.setup("agent", fmt="text", stream=stream)
    logging.getLogger("agent.publishing").info("published", extra={"node": "n1"})
    text = stream.getvalue().strip()
    assert not text.startswith("{")
    assert "INFO" in text and "agent agent.publishing: published node=n1" in text


def test_setup_twice_does_not_double_lines(restore_root_logger: None) -> None:
    stream = io.StringIO()
    runtime_logging.setup("agent", stream=stream)
    runtime_logging.setup("agent", stream=stream)
    logging.getLogger("x").warning("once")
    assert len(stream.getvalue().splitlines()) == 1


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format"):
        runtime_logging.formatter("agent", "xml")
