"""``fleet engines list``'s text: per platform fingerprint (backend and exact version, device, L4T
release), each engine's key, size, who built it and when, how long that build took, and how often
other devices downloaded it instead of building; then the build claims running (which device builds
which key since when, last heard, how many devices wait for it). The command itself is in
:mod:`agent.fleet.cli.main`.
"""

from __future__ import annotations

import time
from typing import Any


def engines_table(listing: dict[str, Any]) -> str:
    """The listing as text: a heading per fingerprint, a line per engine."""
    state = "on" if listing.get("sharing") else "off" if listing.get("signed") else "off (no signing key)"
    total = int(listing.get("bytes", 0))
    lines = [f"engines: {listing.get('engines', 0)} ({_size(total)}), sharing {state}"]
    for fingerprint, rows in sorted(dict(listing.get("fingerprints", {})).items()):
        lines.append(f"{fingerprint}:")
        lines.append(
            f"  {'KEY':<12}  {'SIZE':>9}  {'BUILT BY':<24}  {'BUILT AT (UTC)':<19}  {'BUILD':>7}  REUSED"
        )
        for row in rows:
            built = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(row["built_at"])))
            seconds = row.get("build_seconds")
            took = f"{float(seconds):.0f}s" if seconds is not None else "-"
            key, size, builder = str(row["key"])[:12], _size(int(row["bytes"])), str(row["built_by"])[:24]
            lines.append(f"  {key:<12}  {size:>9}  {builder:<24}  {built:<19}  {took:>7}  {row['reuse']}")
    claims = list(listing.get("claims") or [])
    if claims:
        lines.append(f"being built now (build claims): {len(claims)}")
        lines.append(
            f"  {'KEY':<12}  {'BUILDER':<24}  {'SINCE (UTC)':<19}  {'HEARD':>7}  WAITING  FINGERPRINT"
        )
        for claim in claims:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(claim["since"])))
            key, builder = str(claim["key"])[:12], str(claim["device"])[:24]
            heard, waiting = f"{float(claim['heard_s']):.0f}s ago", claim["waiting"]
            lines.append(
                f"  {key:<12}  {builder:<24}  {since:<19}  {heard:>7}  {waiting:>7}  {claim['fingerprint']}"
            )
    return "\n".join(lines)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"
