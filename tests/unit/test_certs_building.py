"""Certificate building and the renewal rules, at chosen instants (pure)."""

from __future__ import annotations

import datetime
import ipaddress

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from certs import building, keys

NOW = datetime.datetime(2025, 6, 1, 12, 0, tzinfo=datetime.UTC)
DAY = datetime.timedelta(days=1)
WANTED = building.Wanted(
    dns_names=tuple(building.service_dns_names("hook", "sys")), ip_addresses=("127.0.0.1",), validity=90 * DAY
)
CA_KEY = keys.generate_key("ecdsa")
KEY = keys.generate_key("ecdsa")
OTHER_KEY = keys.generate_key("ecdsa")


def fresh(now: datetime.datetime = NOW, wanted: building.Wanted = WANTED) -> building.Bundle:
    decided = building.plan(None, wanted, now=now)
    return building.issue(
        None, decided, wanted, now=now, new_ca_key=CA_KEY, new_key=KEY, ca_serial=1, serial=2
    )


def test_service_dns_names_are_the_four_forms() -> None:
    assert building.service_dns_names("hook", "sys") == [
        "hook",
        "hook.sys",
        "hook.sys.svc",
        "hook.sys.svc.cluster.local",
    ]


def test_ca_is_a_self_signed_path_length_zero_ca_backdated_five_minutes() -> None:
    ca = building.build_ca(CA_KEY, now=NOW, serial=7, validity=3650 * DAY)
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    assert building.issued_by(ca, ca)
    assert ca.not_valid_before_utc == NOW - datetime.timedelta(minutes=5)
    assert ca.not_valid_after_utc == NOW + 3650 * DAY
    assert ca.serial_number == 7


def test_serving_certificate_has_the_sans_server_auth_and_is_signed_by_the_ca() -> None:
    bundle = fresh()
    assert bundle.cert is not None
    dns, ips = building.sans_of(bundle.cert)
    assert dns == {"hook", "hook.sys", "hook.sys.svc", "hook.sys.svc.cluster.local"}
    assert ips == {"127.0.0.1"}
    eku = bundle.cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not bundle.cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert building.issued_by(bundle.cert, bundle.ca_cert)
    assert bundle.cert.not_valid_after_utc == NOW + 90 * DAY
    assert building.key_type_of(bundle.cert.public_key()) == "ecdsa"


def test_serving_certificate_never_outlives_its_ca() -> None:
    ca = building.build_ca(CA_KEY, now=NOW, serial=1, validity=10 * DAY)
    cert = building.build_serving_cert(
        KEY, ca_cert=ca, ca_key=CA_KEY, dns_names=["x"], now=NOW, serial=2, validity=365 * DAY
    )
    assert cert.not_valid_after_utc == ca.not_valid_after_utc


def test_rsa_serving_key_gets_key_encipherment() -> None:
    rsa_key = keys.generate_key("rsa")
    ca = building.build_ca(CA_KEY, now=NOW, serial=1)
    cert = building.build_serving_cert(rsa_key, ca_cert=ca, ca_key=CA_KEY, dns_names=["x"], now=NOW, serial=2)
    assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_encipherment
    assert building.key_type_of(rsa_key) == "rsa"


def test_naive_times_are_refused() -> None:
    with pytest.raises(ValueError, match="timezone"):
        building.build_ca(CA_KEY, now=datetime.datetime(2025, 1, 1), serial=1)


def test_wanted_needs_a_name_and_valid_ips() -> None:
    with pytest.raises(ValueError):
        building.Wanted()
    with pytest.raises(ValueError):
        building.Wanted(ip_addresses=("not-an-ip",))


# ------------------------------------------------------------------ plan


def test_nothing_stored_means_a_new_ca_and_certificate() -> None:
    decided = building.plan(None, WANTED, now=NOW)
    assert decided.new_ca and decided.new_cert


def test_a_valid_bundle_is_kept_as_it_is() -> None:
    bundle = fresh()
    decided = building.plan(bundle, WANTED, now=NOW + 10 * DAY)
    assert not decided.new_ca and not decided.new_cert
    again = building.issue(
        bundle, decided, WANTED, now=NOW + 10 * DAY, new_ca_key=None, new_key=None, ca_serial=9, serial=9
    )
    assert again.cert is bundle.cert and again.ca_cert is bundle.ca_cert
    assert building.bundle_files(again) == building.bundle_files(bundle)


def test_serving_certificate_is_renewed_in_the_last_third_of_its_lifetime() -> None:
    bundle = fresh()
    assert bundle.cert is not None
    due = building.renew_after(bundle.cert)
    life = bundle.cert.not_valid_after_utc - bundle.cert.not_valid_before_utc
    assert due == bundle.cert.not_valid_after_utc - life / 3
    second = datetime.timedelta(seconds=1)
    assert not building.plan(bundle, WANTED, now=due - second).new_cert
    later = building.plan(bundle, WANTED, now=due + second)
    assert later.new_cert and not later.new_ca and "last third" in later.cert_reason


def test_ca_in_its_last_third_is_replaced_along_with_the_certificate() -> None:
    bundle = fresh()
    when = building.renew_after(bundle.ca_cert) + DAY
    decided = building.plan(bundle, WANTED, now=when)
    assert decided.new_ca and decided.new_cert and "last third" in decided.ca_reason


def test_changed_sans_reissue_the_certificate_under_the_same_ca() -> None:
    bundle = fresh()
    wanted = building.Wanted(dns_names=("hook.sys.svc",), validity=90 * DAY)
    decided = building.plan(bundle, wanted, now=NOW)
    assert not decided.new_ca and decided.new_cert and "SANs differ" in decided.cert_reason
    renewed = building.issue(
        bundle, decided, wanted, now=NOW, new_ca_key=None, new_key=OTHER_KEY, ca_serial=5, serial=6
    )
    assert renewed.ca_cert is bundle.ca_cert
    assert renewed.cert is not None and building.sans_of(renewed.cert) == ({"hook.sys.svc"}, frozenset())


def test_ip_sans_compare_in_canonical_form() -> None:
    wanted = building.Wanted(ip_addresses=("::1",))
    bundle = fresh(wanted=wanted)
    same = building.Wanted(ip_addresses=(str(ipaddress.ip_address("0:0:0:0:0:0:0:1")),))
    assert not building.plan(bundle, same, now=NOW).new_cert


def test_key_type_change_reissues_the_certificate() -> None:
    bundle = fresh()
    rsa_wanted = building.Wanted(dns_names=WANTED.dns_names, ip_addresses=WANTED.ip_addresses, key_type="rsa")
    decided = building.plan(bundle, rsa_wanted, now=NOW)
    assert decided.new_cert and "rsa" in decided.cert_reason


def test_missing_or_mismatched_ca_key_means_a_new_ca() -> None:
    bundle = fresh()
    no_key = building.Bundle(ca_cert=bundle.ca_cert, ca_key=None, cert=bundle.cert, key=bundle.key)
    assert building.plan(no_key, WANTED, now=NOW).new_ca
    wrong = building.Bundle(ca_cert=bundle.ca_cert, ca_key=OTHER_KEY, cert=bundle.cert, key=bundle.key)
    assert building.plan(wrong, WANTED, now=NOW).new_ca


def test_certificate_from_another_ca_or_with_a_wrong_key_is_reissued() -> None:
    bundle = fresh()
    other = building.build_ca(OTHER_KEY, now=NOW, serial=3)
    foreign = building.Bundle(ca_cert=other, ca_key=OTHER_KEY, cert=bundle.cert, key=bundle.key)
    assert "not signed by the CA" in building.plan(foreign, WANTED, now=NOW).cert_reason
    wrong_key = building.Bundle(ca_cert=bundle.ca_cert, ca_key=CA_KEY, cert=bundle.cert, key=OTHER_KEY)
    assert "does not match" in building.plan(wrong_key, WANTED, now=NOW).cert_reason


def test_a_replaced_ca_stays_trusted_until_it_expires() -> None:
    bundle = fresh()
    when = building.renew_after(bundle.ca_cert) + DAY
    decided = building.plan(bundle, WANTED, now=when)
    rotated = building.issue(
        bundle, decided, WANTED, now=when, new_ca_key=OTHER_KEY, new_key=KEY, ca_serial=11, serial=12
    )
    assert rotated.previous_cas == (bundle.ca_cert,)
    assert building.ca_bundle_pem(rotated).count(b"BEGIN CERTIFICATE") == 2
    # Read back: the CA in use is the one its key matches, whatever the order in ca.crt.
    reread = building.read_bundle(building.bundle_files(rotated))
    assert (
        reread is not None and reread.ca_cert == rotated.ca_cert and reread.previous_cas == (bundle.ca_cert,)
    )
    # Once the old CA has expired, the next run drops it.
    after = bundle.ca_cert.not_valid_after_utc + DAY
    kept = building.issue(
        reread,
        building.plan(reread, WANTED, now=after),
        WANTED,
        now=after,
        new_ca_key=CA_KEY,
        new_key=KEY,
        ca_serial=13,
        serial=14,
    )
    assert bundle.ca_cert not in kept.previous_cas


def test_files_round_trip() -> None:
    bundle = fresh()
    files = building.bundle_files(bundle)
    assert set(files) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}
    back = building.read_bundle(files)
    assert back is not None and building.bundle_files(back) == files
    assert building.read_bundle({}) is None


@pytest.mark.parametrize(
    "files",
    [{"ca.crt": b"junk"}, {"ca.crt": b""}, {"ca.crt": building.cert_pem(fresh().ca_cert), "ca.key": b"junk"}],
)
def test_unreadable_files_raise_bundle_error(files: dict[str, bytes]) -> None:
    with pytest.raises(building.BundleError):
        building.read_bundle(files)
