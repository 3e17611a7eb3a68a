"""``edge-agent fleet ca init|intermediate|claim|crl`` and ``fleet devices revoke``: the fleet's
certificate authority from the command line (the work is :mod:`agent.fleet.ca`; docs/enrollment.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agent.fleet.ca.layout import DEFAULT_CA_DIR, CaDir

#: A claim's defaults: a batch of devices over two weeks.
DEFAULT_CLAIM_USES = 100
DEFAULT_CLAIM_DAYS = 14


def add_ca_arguments(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """Add ``fleet ca`` and its verbs and ``fleet devices revoke`` to the ``fleet`` sub-parsers
    ``sub``; the ``fleet devices`` verbs, for the admission verbs to join."""
    from agent.fleet.ca.init_steps import INTERMEDIATE_DAYS

    ca = sub.add_parser("ca", help="the fleet's certificate authority: make it, claims, the CRL")
    verbs = ca.add_subparsers(dest="ca_command", required=True, metavar="VERB")
    init = verbs.add_parser(
        "init",
        help="make the root (offline), the devices intermediate, the claims CA, the broker's certificate",
    )
    _root_dir(init)
    _ca_dir(init)
    init.add_argument(
        "--broker-host",
        action="append",
        required=True,
        metavar="NAME",
        help="a DNS name or IP devices reach the broker by (repeat for each); the first is its CN",
    )
    init.add_argument(
        "--broker-pid-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="pid file of the mosquitto on this host, told to reload after each revocation "
        "(default: none, the broker runs elsewhere)",
    )
    init.add_argument("--prefix", default="fleet/v1", help="topic prefix the devices ACL scopes")
    _days(init, INTERMEDIATE_DAYS, "the devices intermediate's life")
    intermediate = verbs.add_parser(
        "intermediate", help="re-certify the devices intermediate from the root (same key), before it expires"
    )
    _root_dir(intermediate)
    _ca_dir(intermediate)
    _days(intermediate, INTERMEDIATE_DAYS, "the renewed intermediate's life")
    claim = verbs.add_parser("claim", help="make a claim bundle a batch of devices enrolls with")
    claim.add_argument("name", metavar="NAME", help="the claim's name (its certificate's CN is claim:NAME)")
    claim.add_argument(
        "--uses", type=int, default=DEFAULT_CLAIM_USES, help="how many devices may enroll with it"
    )
    _days(claim, DEFAULT_CLAIM_DAYS, "how long it is valid")
    _ca_dir(claim)
    claim.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory for the bundle (default: ./claim-NAME)",
    )
    crl = verbs.add_parser("crl", help="re-issue the CRL and the devices ACL now, and tell the broker")
    _ca_dir(crl)
    for parser in (init, intermediate, claim, crl):
        _verbose(parser)

    devices = sub.add_parser(
        "devices", help="a device's place in the fleet: register, pending, accept, reject, enrolled, revoke"
    )
    device_verbs = devices.add_subparsers(dest="devices_command", required=True, metavar="VERB")
    revoke = device_verbs.add_parser(
        "revoke", help="revoke every certificate of a device: the broker refuses it, and cuts it if connected"
    )
    revoke.add_argument("device", metavar="ID", help="device id")
    revoke.add_argument("--reason", default="revoked", metavar="TEXT", help="why (kept in the CA's ledger)")
    revoke.add_argument("--json", action="store_true", help="machine-readable output")
    _ca_dir(revoke)
    _verbose(revoke)
    return device_verbs


def add_ca_dir(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--ca-dir DIR`` for a command that only uses the CA when there is one (``fleet decommission``)."""
    parser.add_argument("--ca-dir", type=Path, default=None, metavar="DIR", help=help_text)


def run_ca(args: argparse.Namespace) -> int:
    """``fleet ca VERB``."""
    verb = args.ca_command
    if verb == "init":
        return _init(args)
    if verb == "intermediate":
        return _intermediate(args)
    if verb == "claim":
        return _claim(args)
    return _crl(args)


def run_revoke(args: argparse.Namespace) -> int:
    """``fleet devices revoke ID``: exit 0 with certificates revoked, 1 when the device had none."""
    from agent.fleet.ca.authority import DeviceAuthority
    from agent.fleet.deploy.manifest import check_device_ids

    check_device_ids([args.device])
    authority = DeviceAuthority.load(ca_dir(args))
    serials = authority.revoke_device(args.device, args.reason, tell=False)
    told = authority.tell_broker()
    if args.json:
        print(
            json.dumps(
                {"device": args.device, "revoked": serials, "broker_told": told.told, "broker": told.line}
            )
        )
    else:
        shown = ", ".join(serials) if serials else "none (no current certificate)"
        print(f"{args.device}: revoked {shown}; CRL {authority.crl_path}")
        print(f"broker: {told.line}")
    return 0 if serials else 1


def _init(args: argparse.Namespace) -> int:
    from agent.fleet.ca.broker import BrokerSettings
    from agent.fleet.ca.init_steps import init_ca

    broker = BrokerSettings(prefix=args.prefix, pid_file=args.broker_pid_file)
    done = init_ca(
        args.root_dir, ca_dir(args), tuple(args.broker_host), intermediate_days=args.days, broker=broker
    )
    ca = done.ca
    print(f"root          {done.root.path}")
    print("              (move it off the controller host: only `fleet ca intermediate` needs it)")
    print(f"intermediate  {ca.devices_cert}  (until {done.intermediate_not_after:%Y-%m-%d})")
    print("broker files (docs/enrollment.md):")
    print(f"  devices listener     cafile {ca.devices_trust}  crlfile {ca.crl}  acl_file {ca.devices_acl}")
    print(f"  enrollment listener  cafile {ca.claims_cert}")
    print(f"  both                 certfile {ca.server_cert}  keyfile {ca.server_key}")
    print(f"devices and operators verify the broker with ca_file {ca.root_cert}")
    return 0


def _intermediate(args: argparse.Namespace) -> int:
    from agent.fleet.ca.broker import tell_broker
    from agent.fleet.ca.init_steps import certify_intermediate
    from agent.fleet.ca.layout import RootDir

    ca = CaDir(ca_dir(args))
    cert = certify_intermediate(RootDir(args.root_dir), ca, args.days)
    print(f"intermediate  {ca.devices_cert}  (until {cert.not_valid_after_utc:%Y-%m-%d})")
    print(f"broker: {tell_broker(ca).line}")
    return 0


def _claim(args: argparse.Namespace) -> int:
    from agent.fleet.ca.claims import make_claim

    out = args.out or Path(f"claim-{args.name}")
    bundle = make_claim(ca_dir(args), args.name, uses=args.uses, days=args.days, out_dir=out)
    record = bundle.record
    print(f"claim {record.name}: {record.uses} uses until {record.not_after:%Y-%m-%d %H:%M} UTC")
    print(f"  serial    {record.serial}")
    print(f"  cert_file {bundle.cert_file}")
    print(f"  key_file  {bundle.key_file}  (mode 0600)")
    print(f"  ca_file   {bundle.ca_file}")
    return 0


def _crl(args: argparse.Namespace) -> int:
    from agent.fleet.ca.authority import DeviceAuthority

    authority = DeviceAuthority.load(ca_dir(args))
    path = authority.reissue_crl()
    told = authority.tell_broker()
    print(f"CRL {path} re-issued")
    print(f"broker: {told.line}")
    return 0 if told.told else 2


def _root_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root-dir", type=Path, required=True, metavar="DIR", help="the offline root's directory"
    )


def _ca_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ca-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"the controller's CA directory (default: {DEFAULT_CA_DIR})",
    )


def ca_dir(args: argparse.Namespace) -> Path:
    """``--ca-dir``, or the controller's default CA directory."""
    return Path(args.ca_dir) if args.ca_dir is not None else DEFAULT_CA_DIR


def _days(parser: argparse.ArgumentParser, default: int, what: str) -> None:
    parser.add_argument("--days", type=int, default=default, help=what)


def _verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (info level)")
