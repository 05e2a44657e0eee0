"""``gpualloc webhook`` options: flags, their environment variables, and what is required."""

from __future__ import annotations

import pytest

from webhook import main as webhook_main


def test_defaults_are_the_documented_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    args = webhook_main.build_parser().parse_args(["--tls-cert-file=c", "--tls-key-file=k"])
    assert args.port == 8443
    assert args.host == "127.0.0.1"
    assert args.pending == "deny"
    assert args.device_ids == "uuid"
    assert args.allow_device_plugin is False
    assert args.shutdown_timeout == 10.0
    assert args.metrics_port == 0


def test_host_defaults_to_all_interfaces_in_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert webhook_main.build_parser().parse_args([]).host == "0.0.0.0"


def test_every_flag_reads_its_environment_variable_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUALLOC_PENDING", "gate")
    monkeypatch.setenv("GPUALLOC_DEVICE_IDS", "index")
    monkeypatch.setenv("GPUALLOC_ALLOW_DEVICE_PLUGIN", "true")
    monkeypatch.setenv("GPUALLOC_PORT", "9443")
    monkeypatch.setenv("GPUALLOC_TLS_CERT_FILE", "/tls/tls.crt")
    args = webhook_main.build_parser().parse_args(["--port=10443"])
    assert (args.pending, args.device_ids, args.allow_device_plugin) == ("gate", "index", True)
    assert args.tls_cert_file == "/tls/tls.crt"
    assert args.port == 10443


def test_missing_certificate_flags_are_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        webhook_main.main([])
    assert exc.value.code == 2


def test_bad_choices_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUALLOC_PENDING", "maybe")
    with pytest.raises(SystemExit):
        webhook_main.build_parser()
