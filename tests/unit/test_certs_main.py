"""``gpualloc certs`` with ``--out-dir`` only (no API server): files, idempotence, usage errors."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509

from certs import main as certs_main


@pytest.fixture(autouse=True)
def _keep_test_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """main() sets up process logging; in a test process that would replace pytest's handlers."""
    monkeypatch.setattr(certs_main.runtime_logging, "setup", lambda *args, **kwargs: None)


def serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = certs_main.main(list(argv))
    return code, capsys.readouterr().out


def test_first_run_writes_the_four_files_with_private_keys_0600(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(capsys, "--service", "hook", "--namespace", "sys", "--out-dir", str(tmp_path))
    assert code == 0
    assert "CA: created" in out and "serving certificate: issued" in out
    for name, mode in [("ca.crt", 0o644), ("tls.crt", 0o644), ("ca.key", 0o600), ("tls.key", 0o600)]:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    cert = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "hook.sys.svc" in sans.get_values_for_type(x509.DNSName)


def test_second_run_keeps_everything_byte_for_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--dns-name", "hook.sys.svc", "--ip-address", "127.0.0.1", "--out-dir", str(tmp_path))
    assert run(capsys, *args)[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, out = run(capsys, *args)
    assert code == 0
    assert "CA: kept" in out and "serving certificate: kept" in out and "unchanged" in out
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_renew_reissues_the_serving_certificate_under_the_same_ca(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--dns-name", "hook", "--out-dir", str(tmp_path))
    run(capsys, *args)
    ca, cert = serial(tmp_path / "ca.crt"), serial(tmp_path / "tls.crt")
    code, out = run(capsys, *args, "--renew")
    assert code == 0 and "--renew" in out
    assert serial(tmp_path / "ca.crt") == ca
    assert serial(tmp_path / "tls.crt") != cert


def test_changed_sans_are_reissued_and_said_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "--dns-name", "a", "--out-dir", str(tmp_path))
    code, out = run(capsys, "--dns-name", "b", "--out-dir", str(tmp_path))
    assert code == 0 and "SANs differ" in out


def test_unreadable_files_are_replaced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ca.crt").write_text("garbage")
    code, out = run(capsys, "--dns-name", "a", "--out-dir", str(tmp_path))
    assert code == 0 and "unreadable" in out and "CA: created" in out


def test_options_come_from_the_environment_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUALLOC_OUT_DIR", str(tmp_path))
    monkeypatch.setenv("GPUALLOC_DNS_NAME", "x.example,y.example")
    assert run(capsys, "--key-type", "rsa")[0] == 0
    cert = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.DNSName)) == {"x.example", "y.example"}


@pytest.mark.parametrize(
    "argv",
    [
        ["--out-dir", "/nonexistent-never"],  # no SAN
        ["--dns-name", "a"],  # nowhere to store
        ["--service", "s", "--out-dir", "/nonexistent-never"],  # service without namespace
        ["--ip-address", "nope", "--out-dir", "/nonexistent-never"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    with pytest.raises(SystemExit) as exc:
        certs_main.main(argv)
    assert exc.value.code == 2


def test_namespace_is_the_flag_then_gpualloc_namespace_then_the_pods_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "from-pod")
    monkeypatch.delenv("GPUALLOC_NAMESPACE", raising=False)
    assert certs_main.build_parser().parse_args([]).namespace == "from-pod"
    monkeypatch.setenv("GPUALLOC_NAMESPACE", "from-env")
    assert certs_main.build_parser().parse_args([]).namespace == "from-env"
    assert certs_main.build_parser().parse_args(["--namespace", "from-flag"]).namespace == "from-flag"


def test_a_dns_name_given_twice_is_one_san(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(
        capsys,
        *("--service", "hook", "--namespace", "sys", "--dns-name", "extra", "--dns-name", "extra"),
        *("--dns-name", "hook.sys.svc", "--out-dir", str(tmp_path)),
    )
    assert code == 0
    cert = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    dns = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert dns == ["hook", "hook.sys", "hook.sys.svc", "hook.sys.svc.cluster.local", "extra"]
    assert "SANs: hook, hook.sys, hook.sys.svc, hook.sys.svc.cluster.local, extra;" in out
