"""``gpualloc certs``: make or renew the webhook's CA and serving certificate, store them, patch the caBundle.

Idempotent: run again, it keeps certificates that are still good (same CA, same
serial) and renews those in the last third of their lifetime, or whose SANs,
key or key type are not the ones asked for. It prints one line per thing it
looked at, and exits 0 when everything is in place (1 on an error, 2 on bad
usage), so it can run as a Helm hook Job.

Where the current certificates are read from: the Secret when ``--secret`` is
given and it exists, else ``--out-dir``. They are written to both when both are
given. A webhook configuration that does not exist yet is reported and skipped
(a Helm pre-install run comes before the configuration is created).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import sys
from collections.abc import Sequence

from certs import building, keys, storing
from gpualloc.kube import client, errors
from gpualloc.runtime import eventloop
from gpualloc.runtime import logging as runtime_logging
from gpualloc.runtime import options as runtime_options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpualloc certs", description=__doc__.split("\n")[0].replace("``", "")
    )
    parser.add_argument("--service", help="the webhook's Service: its DNS names go into the certificate")
    parser.add_argument(
        "--namespace", help="namespace of the Service and the Secret (default $POD_NAMESPACE)"
    )
    parser.add_argument("--dns-name", action="append", default=[], help="another DNS name (repeatable)")
    parser.add_argument("--ip-address", action="append", default=[], help="an IP address SAN (repeatable)")
    parser.add_argument("--out-dir", help="write ca.crt, ca.key, tls.crt, tls.key here (keys 0600)")
    parser.add_argument("--secret", help="write a kubernetes.io/tls Secret of this name (with ca.crt)")
    parser.add_argument(
        "--webhook-config", help="MutatingWebhookConfiguration whose webhooks get the CA as caBundle"
    )
    parser.add_argument(
        "--key-type", choices=building.KEY_TYPES, default="ecdsa", help="ECDSA P-256 or RSA 2048"
    )
    parser.add_argument("--validity-days", type=int, default=365, help="lifetime of the serving certificate")
    parser.add_argument("--ca-validity-days", type=int, default=3650, help="lifetime of the CA")
    parser.add_argument(
        "--renew", action="store_true", default=False, help="re-issue the serving certificate now"
    )
    runtime_options.add_kubeconfig_and_logging(parser, log_format="text", log_level="WARNING")
    # --namespace: the flag, then GPUALLOC_NAMESPACE, then the pod's own (POD_NAMESPACE).
    runtime_options.env_defaults(
        parser, fallbacks={**runtime_options.DOWNWARD_API, "namespace": "POD_NAMESPACE"}
    )
    return parser


def _wanted(parser: argparse.ArgumentParser, args: argparse.Namespace) -> building.Wanted:
    dns: list[str] = []
    if args.service:
        dns += building.service_dns_names(args.service, args.namespace)
    for name in args.dns_name:  # a name given twice, or also a Service name, goes in once
        if name not in dns:
            dns.append(name)
    ips = []
    for ip in args.ip_address:
        try:
            ips.append(str(ipaddress.ip_address(ip)))
        except ValueError:
            parser.error(f"--ip-address {ip!r} is not an IP address")
    if not dns and not ips:
        parser.error(
            "give --service (with --namespace), --dns-name or --ip-address: the certificate needs a name"
        )
    if args.validity_days < 1 or args.ca_validity_days < 1:
        parser.error("validity must be at least one day")
    return building.Wanted(
        dns_names=tuple(dns),
        ip_addresses=tuple(ips),
        key_type=args.key_type,
        validity=datetime.timedelta(days=args.validity_days),
        ca_validity=datetime.timedelta(days=args.ca_validity_days),
    )


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if (args.service or args.secret) and not args.namespace:
        parser.error("--service and --secret need --namespace (or $POD_NAMESPACE)")
    if not args.out_dir and not args.secret:
        parser.error("nowhere to store the certificates: give --out-dir and/or --secret")
    wanted = _wanted(parser, args)
    runtime_logging.setup("certs", fmt=args.log_format, level=args.log_level)
    try:
        return eventloop.run(run(args, wanted, now=datetime.datetime.now(datetime.UTC)))
    except (errors.KubeError, storing.StoreError, OSError) as exc:
        print(f"gpualloc certs: error: {exc}", file=sys.stderr)
        return 1


async def run(args: argparse.Namespace, wanted: building.Wanted, *, now: datetime.datetime) -> int:
    needs_api = bool(args.secret or args.webhook_config)
    api = await client.connect(args.kubeconfig) if needs_api else None
    try:
        secret = await storing.read_secret(api, args.namespace, args.secret) if api and args.secret else None
        if secret is not None:
            files, source = secret[0], f"Secret {args.namespace}/{args.secret}"
        elif args.out_dir:
            files, source = storing.read_dir(args.out_dir), args.out_dir
        else:
            files, source = {}, ""
        try:
            existing = building.read_bundle(files)
        except building.BundleError as exc:
            print(f"existing certificates in {source} are unreadable ({exc}); making new ones")
            existing = None

        decided = building.plan(existing, wanted, now=now, renew=args.renew)
        bundle = building.issue(
            existing,
            decided,
            wanted,
            now=now,
            new_ca_key=keys.generate_key("ecdsa") if decided.new_ca else None,
            new_key=keys.generate_key(wanted.key_type) if decided.new_cert else None,
            ca_serial=keys.random_serial(),
            serial=keys.random_serial(),
        )
        assert bundle.cert is not None
        print(f"CA: {'created, because ' + decided.ca_reason if decided.new_ca else decided.ca_reason}")
        if decided.new_cert:
            issued = building.describe(bundle.cert)
            print(f"serving certificate: issued ({issued}), because {decided.cert_reason}")
        else:
            print(f"serving certificate: {decided.cert_reason}")
        sans = ", ".join([*wanted.dns_names, *wanted.ip_addresses])
        print(f"  SANs: {sans}; renewal due {building.renew_after(bundle.cert):%Y-%m-%d %H:%M} UTC")

        out = building.bundle_files(bundle)
        if args.out_dir:
            written = storing.write_dir(args.out_dir, out)
            print(f"{args.out_dir}: {'wrote ' + ', '.join(written) if written else 'unchanged'}")
        if api is not None and args.secret:
            result = await storing.write_secret(api, args.namespace, args.secret, out, existing=secret)
            print(f"Secret {args.namespace}/{args.secret}: {result}")
        if api is not None and args.webhook_config:
            patched = await storing.patch_ca_bundle(api, args.webhook_config, building.ca_bundle_pem(bundle))
            config = f"MutatingWebhookConfiguration {args.webhook_config}"
            if patched is None:
                print(f"{config}: not found; caBundle not written (run again once it exists)")
            elif patched[0]:
                print(f"{config}: caBundle written to {patched[0]} of {patched[1]} webhooks")
            else:
                print(f"{config}: caBundle unchanged ({patched[1]} webhooks)")
        return 0
    finally:
        if api is not None:
            await api.close()
