"""Options: flag beats GPUALLOC_<DEST> env beats default; values from env are typed and checked."""

from __future__ import annotations

import argparse

import pytest

from gpualloc.runtime import options


def parser_with_env(env: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    options.add_common(parser)
    parser.add_argument("--node-name", default="")
    parser.add_argument("--pod-namespace", default="gpualloc-system")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--profiles", action="append", default=[])
    options.env_defaults(parser, environ=env)
    return parser


def test_default_applies_without_flag_or_env() -> None:
    args = parser_with_env({}).parse_args([])
    assert args.metrics_port == 8080
    assert args.health_port == 8081
    assert args.log_format == "json"
    assert args.log_level == "INFO"
    assert args.kubeconfig is None


def test_env_beats_default_and_is_converted_by_the_options_type() -> None:
    args = parser_with_env({"GPUALLOC_METRICS_PORT": "9100", "GPUALLOC_LOG_FORMAT": "text"}).parse_args([])
    assert args.metrics_port == 9100
    assert args.log_format == "text"


def test_flag_beats_env() -> None:
    args = parser_with_env({"GPUALLOC_METRICS_PORT": "9100"}).parse_args(["--metrics-port", "9200"])
    assert args.metrics_port == 9200


def test_env_value_outside_choices_is_an_error() -> None:
    with pytest.raises(SystemExit):
        parser_with_env({"GPUALLOC_LOG_FORMAT": "xml"})


def test_env_value_of_the_wrong_type_is_an_error() -> None:
    with pytest.raises(SystemExit):
        parser_with_env({"GPUALLOC_HEALTH_PORT": "eighty"})


def test_boolean_and_list_options_read_env() -> None:
    args = parser_with_env({"GPUALLOC_DRY_RUN": "true", "GPUALLOC_PROFILES": "h100-8, a100-4"}).parse_args([])
    assert args.dry_run is True
    assert args.profiles == ["h100-8", "a100-4"]
    assert parser_with_env({"GPUALLOC_DRY_RUN": "0"}).parse_args([]).dry_run is False


def test_downward_api_variables_fill_node_name_and_pod_namespace_below_the_prefixed_env() -> None:
    args = parser_with_env({"NODE_NAME": "gpu-node-3", "POD_NAMESPACE": "kube-gpu"}).parse_args([])
    assert (args.node_name, args.pod_namespace) == ("gpu-node-3", "kube-gpu")
    args = parser_with_env({"NODE_NAME": "a", "GPUALLOC_NODE_NAME": "b"}).parse_args([])
    assert args.node_name == "b"
    args = parser_with_env({"NODE_NAME": "a"}).parse_args(["--node-name", "c"])
    assert args.node_name == "c"


def test_help_names_the_env_variable() -> None:
    text = parser_with_env({}).format_help()
    assert "GPUALLOC_METRICS_PORT" in text
    assert "GPUALLOC_KUBECONFIG" in text


def test_env_name_is_prefix_plus_upper_snake_dest() -> None:
    assert options.env_name("metrics_port") == "GPUALLOC_METRICS_PORT"


def test_bind_address_defaults_to_loopback_outside_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert options.default_bind_address() == "127.0.0.1"
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    assert options.default_bind_address() == "0.0.0.0"
