"""``fleet engines list``'s text: per platform fingerprint (backend and exact version, device, L4T
release), each engine's key, model, version and precision, size, who built it and when, how long
that build took, and how often other devices downloaded it instead of building, then the engines
withdrawn, then the build claims running (which device builds which key of which model, version
and precision, since when, last heard, how many devices wait for it).
The command itself is in :mod:`agent.fleet.cli.main`; the console's engines page shows the
same listing.

Fingerprints and builders' ids came from devices: they pass :func:`~agent.fleet.base.untrusted.shown`.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from agent.fleet.base.untrusted import shown
from agent.fleet.engines.store import WithdrawnNote

#: Withdrawn engines a listing names (the store remembers up to 1,024; the count says how many).
WITHDRAWN_LISTED = 100


def with_withdrawn(
    listing: dict[str, Any],
    withdrawn: Collection[tuple[str, str]],
    notes: Collection[WithdrawnNote] = (),
) -> dict[str, Any]:
    """The controller's listing with the engines it withdrew (a device found them bad): ``withdrawn``,
    up to :data:`WITHDRAWN_LISTED` ``{key, engine_sha256}`` sorted by key, each with its note's
    ``fingerprint``, ``built_by``, ``reason`` and ``at`` where the store has one (the newest note of
    that pair), and ``withdrawn_total``."""
    pairs = sorted(withdrawn)
    noted = {(n.key, n.engine_sha256): n for n in notes}
    rows: list[dict[str, Any]] = []
    for key, sha in pairs[:WITHDRAWN_LISTED]:
        note = noted.get((key, sha))
        extra = {} if note is None else note.model_dump(exclude={"key", "engine_sha256"})
        rows.append({"key": key, "engine_sha256": sha, **extra})
    return {**listing, "withdrawn": rows, "withdrawn_total": len(pairs)}


def engines_table(listing: dict[str, Any]) -> str:
    """The listing as text: a heading per fingerprint, a line per engine."""
    state = "on" if listing.get("sharing") else "off" if listing.get("signed") else "off (no signing key)"
    total = int(listing.get("bytes", 0))
    lines = [f"engines: {listing.get('engines', 0)} ({_size(total)}), sharing {state}"]
    for fingerprint, rows in sorted(dict(listing.get("fingerprints", {})).items()):
        lines.append(f"{shown(fingerprint, 200)}:")
        lines.append(
            f"  {'KEY':<12}  {'MODEL':<20}  {'VERSION':<12}  {'PREC':<4}  {'SIZE':>9}  {'BUILT BY':<24}  "
            f"{'BUILT AT (UTC)':<19}  {'BUILD':>7}  REUSED"
        )
        for row in rows:
            built = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(row["built_at"])))
            seconds = row.get("build_seconds")
            took = f"{float(seconds):.0f}s" if seconds is not None else "-"
            key, size, builder = (
                shown(str(row["key"])[:12]),
                _size(int(row["bytes"])),
                shown(row["built_by"], 24),
            )
            model = _model_cells(row)
            lines.append(
                f"  {key:<12}  {model}  {size:>9}  {builder:<24}  {built:<19}  {took:>7}  {row['reuse']}"
            )
    if listing.get("withdrawn_total"):
        lines.append(f"withdrawn (never taken again): {listing['withdrawn_total']}")
        lines += [_withdrawn_line(w) for w in listing["withdrawn"]]
    claims = list(listing.get("claims") or [])
    if claims:
        lines.append(f"being built now (build claims): {len(claims)}")
        lines.append(
            f"  {'KEY':<12}  {'MODEL':<20}  {'VERSION':<12}  {'PREC':<4}  {'BUILDER':<24}  "
            f"{'SINCE (UTC)':<19}  {'HEARD':>7}  WAITING  FINGERPRINT"
        )
        for claim in claims:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(claim["since"])))
            key, builder = shown(str(claim["key"])[:12]), shown(claim["device"], 24)
            heard, waiting = f"{float(claim['heard_s']):.0f}s ago", claim["waiting"]
            fingerprint = shown(claim["fingerprint"])
            model = _model_cells(claim)
            lines.append(
                f"  {key:<12}  {model}  {builder:<24}  {since:<19}  {heard:>7}  {waiting:>7}  {fingerprint}"
            )
    return "\n".join(lines)


def _model_cells(row: dict[str, Any]) -> str:
    """The model, version and precision columns of a row ("-" where the device did not say)."""
    model = shown(row.get("model_id") or "-", 20)
    version = shown(row.get("version") or "-", 12)
    precision = shown(row.get("precision") or "-", 4)
    return f"{model:<20}  {version:<12}  {precision:<4}"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def _withdrawn_line(row: dict[str, Any]) -> str:
    """One withdrawn engine: key, engine, and, where noted, its builder, fingerprint and why."""
    line = f"  {shown(str(row['key'])[:12])}  engine {shown(str(row['engine_sha256'])[:12])}"
    if "reason" in row:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(row["at"])))
        line += (
            f"  built by {shown(row['built_by'], 24)} on {shown(row['fingerprint'], 80)};"
            f" withdrawn {at}: {shown(row['reason'], 200)}"
        )
    return line


def released_line(result: dict[str, Any]) -> str:
    """``fleet engines release``'s answer: which claim ended, whose it was, how many devices waited."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(result["since"])))
    return (
        f"released the build claim on {shown(str(result['key'])[:12])} held by {shown(result['device'], 64)} "
        f"since {since} UTC; {result['waiting']} device(s) waited for it: the next to ask builds it"
    )
