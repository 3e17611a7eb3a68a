"""The fleet root's cost on a device, as JSON: checking one desired state, taking one root version, and
the installed size of the Python packages it adds (tuf, securesystemslib, urllib3).

A root of three root keys (threshold two), one release key and one controller key is made in memory;
the desired state names a real released model of the demo's size. ``check_desired_ms``: JSON, the
controller's signature, the manifest, the release's threshold and binding (what a device runs before a
download starts). ``root_update_ms``: parse a chain of two versions and take the second.

    .venv/bin/python bench/trust.py [--repeats 2000]
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from securesystemslib.signer import CryptoSigner
from tuf.api.metadata import Metadata, Root

from agent.protocol.manifest import SignedManifest, build_manifest
from agent.trust.deployment import check_desired
from agent.trust.release import release_for
from agent.trust.roles import CONTROLLER, RELEASE, ROOT, UNUSED
from agent.trust.root import newest_root, read_root


def _root(
    root_keys: list[CryptoSigner], release: CryptoSigner, controller: CryptoSigner, version: int
) -> bytes:
    root = Root(version=version, expires=datetime.now(timezone.utc) + timedelta(days=365))
    for key in root_keys:
        root.add_key(key.public_key, ROOT)
    root.add_key(release.public_key, RELEASE)
    for role in (CONTROLLER, UNUSED):
        root.add_key(controller.public_key, role)
    root.roles[ROOT].threshold = 2
    metadata = Metadata(root)
    for key in root_keys:
        metadata.sign(key, append=True)
    return metadata.to_bytes()


def _installed_bytes(package: str) -> int:
    spec = importlib.util.find_spec(package)
    assert spec is not None
    assert spec.submodule_search_locations is not None
    top = Path(next(iter(spec.submodule_search_locations)))
    return sum(p.stat().st_size for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _timed_ms(repeats: int, run: object) -> list[float]:
    assert callable(run)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000.0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    root_keys = [CryptoSigner.generate_ed25519() for _ in range(3)]
    release_key, controller = CryptoSigner.generate_ed25519(), CryptoSigner.generate_ed25519()
    v1 = _root(root_keys, release_key, controller, 1)
    v2 = _root(root_keys, release_key, controller, 2)
    root = read_root(v1)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model.onnx"
        model.write_bytes(os.urandom(26_000))
        manifest = build_manifest(model, job_id="j", sequence=1, slot="main", model_id="m", version="1")
    release = release_for(manifest, version=1, expires=datetime.now(timezone.utc) + timedelta(days=30))
    release.sign(release_key)
    text = manifest.model_dump_json(exclude_none=True)
    signature = bytes.fromhex(controller.sign(text.encode()).signature)
    payload = (
        SignedManifest(
            manifest=text,
            key_id=controller.public_key.keyid,
            signature=base64.b64encode(signature).decode(),
            release=release.to_bytes().decode(),
        )
        .model_dump_json(exclude_none=True)
        .encode()
    )
    now = datetime.now(timezone.utc)
    check = _timed_ms(args.repeats, lambda: check_desired(root, payload, "cam-1", now))
    chain = [json.loads(v1), json.loads(v2)]
    update = _timed_ms(
        args.repeats,
        lambda: newest_root(root, [read_root(json.dumps(item).encode()) for item in chain]),
    )
    sizes = {name: _installed_bytes(name) for name in ("tuf", "securesystemslib", "urllib3")}
    print(
        json.dumps(
            {
                "repeats": args.repeats,
                "check_desired_ms": {
                    "median": statistics.median(check),
                    "p99": sorted(check)[int(0.99 * len(check))],
                },
                "root_update_ms": {
                    "median": statistics.median(update),
                    "p99": sorted(update)[int(0.99 * len(update))],
                },
                "payload_bytes": len(payload),
                "installed_bytes": sizes,
                "installed_bytes_total": sum(sizes.values()),
                "load_average": os.getloadavg(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
