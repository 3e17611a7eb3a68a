"""One controller per prefix when the store is PostgreSQL: the lease is a row of the database, and its
token fences every write (docs/fleet.md, "Two controllers on two hosts").

Why a lease row and not an advisory lock: a session's advisory lock lasts as long as its connection,
and a controller frozen by SIGSTOP (or a host that hangs) keeps its TCP connection open, so the lock
would never come free and the standby would wait forever; a lock released by a dropped connection
also tells the old holder nothing. The row carries a **token** that goes up by one at every take-over
and an expiry by the database's clock (one clock for every host); the holder renews it every third of
``ttl_s``. A standby takes the row when it has expired (or its holder was a process of this host that
no longer exists). Every store transition checks, in its own transaction, that the row still carries
this controller's token (statedb/postgres.py, ``check_fence``), so a holder that wakes up after a
standby took over cannot write: the write is refused, the controller steps down
(:class:`~agent.fleet.controller.lease.LeaseLostError`).

The same interface as the broker's :class:`~agent.fleet.controller.lease.PrefixLease`: ``acquire``,
``lost``, ``regain``, ``release``; the controller process uses either.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from pathlib import Path

import structlog

from agent.fleet.controller.lease import LeaseHeldError, LeaseLostError, describe, holder_is_gone
from agent.fleet.statedb.postgres import DatabaseUnavailableError, Fence, PgSql, StateDatabase
from agent.protocol.messages import ControllerLease

log = structlog.get_logger(__name__)

#: How often a standby looks at the lease row.
STANDBY_POLL_S = 1.0


class DatabaseLease:
    """This controller's lease on ``prefix`` in ``database`` (a connection of its own)."""

    def __init__(self, database: StateDatabase, prefix: str, state_dir: Path, *, ttl_s: int) -> None:
        self.database = database
        self.prefix = prefix
        host, pid = socket.gethostname(), os.getpid()
        self.claim = ControllerLease(
            holder=f"{host}:{pid}:{secrets.token_hex(4)}",
            host=host,
            pid=pid,
            state_dir=str(state_dir),
            since=time.time(),
            ttl_s=ttl_s,
        )
        #: The token this controller holds the lease with (None: not taken); writes carry it.
        self.fence: Fence | None = None
        self._confirmed = 0.0  # monotonic time at the start of the last renewal the database confirmed
        self._taken_by: str | None = None
        self._released = threading.Event()
        self._renewer: threading.Thread | None = None
        self._migrated = False
        self._unreachable = False  # inside an outage: its first failed renewal was logged

    # -- taking it -----------------------------------------------------------------------------------

    def acquire(
        self, *, standby: bool = False, stop: threading.Event | None = None, timeout: float = 10.0
    ) -> bool:
        """Take the lease; False only when ``stop`` was set while standing by. LeaseHeldError when
        another live controller holds it and ``standby`` is False; DatabaseUnavailableError when the
        database cannot be reached before standing by (a standby rides through an outage)."""
        del timeout  # the database connection has its own (database.connect_timeout_s)
        announced = False
        waiter = stop or threading.Event()
        while True:
            try:
                held = self._try_take()
            except DatabaseUnavailableError as exc:
                if not announced:
                    raise
                log.warning("fleet.controller.standby.database_unreachable", error=str(exc))
                held = None
            else:
                if held is None:
                    self._start_renewing()
                    return True
                if not standby:
                    raise LeaseHeldError(
                        f"prefix {self.prefix} is held by {describe(held)} (lease in {self.database.where}); "
                        "one controller per prefix: stop that one first, or set standby: true to take over "
                        "when it stops"
                    )
                if not announced:
                    log.warning("fleet.controller.standby", prefix=self.prefix, holder=describe(held))
                    print(
                        f"controller: standing by, prefix {self.prefix} is held by {describe(held)}",
                        flush=True,
                    )
            announced = True
            if waiter.wait(STANDBY_POLL_S):
                return False

    def _try_take(self) -> ControllerLease | None:
        """Take the row if it is free (None), or return the live holder's claim."""
        if not self._migrated:  # the first controller on a new database makes its tables
            self.database.migrate()
            self._migrated = True
        claim = self.claim.model_copy(update={"since": time.time()})
        started = time.monotonic()
        with self.database.transaction() as sql:
            row = sql.execute(
                "SELECT token, holder, host, pid, state_dir, since, ttl_s, "
                "expires_at < clock_timestamp() FROM controller_lease WHERE prefix = ? FOR UPDATE",
                (self.prefix,),
            ).fetchone()
            if row is not None:
                held = ControllerLease(
                    holder=row[1], host=row[2], pid=row[3], state_dir=row[4], since=row[5], ttl_s=row[6]
                )
                if not row[7] and not holder_is_gone(held):
                    return held
                if not row[7]:
                    log.warning("fleet.controller.lease.stale", holder=describe(held))
            token = 1 if row is None else int(row[0]) + 1
            self._write_claim(sql, claim, token)
        self.claim = claim
        self.fence = Fence(self.prefix, token)
        self._confirmed = started
        self._taken_by = None
        log.info("fleet.controller.lease.taken", prefix=self.prefix, holder=claim.holder, token=token)
        return None

    def _write_claim(self, sql: PgSql, claim: ControllerLease, token: int) -> None:
        sql.execute(
            "INSERT INTO controller_lease (prefix, token, holder, host, pid, state_dir, since, ttl_s, "
            "expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, clock_timestamp() + make_interval(secs => ?)) "
            "ON CONFLICT (prefix) DO UPDATE SET token = EXCLUDED.token, holder = EXCLUDED.holder, "
            "host = EXCLUDED.host, pid = EXCLUDED.pid, state_dir = EXCLUDED.state_dir, "
            "since = EXCLUDED.since, ttl_s = EXCLUDED.ttl_s, expires_at = EXCLUDED.expires_at",
            (
                self.prefix,
                token,
                claim.holder,
                claim.host,
                claim.pid,
                claim.state_dir,
                claim.since,
                claim.ttl_s,
                float(claim.ttl_s),
            ),
        )

    def _start_renewing(self) -> None:
        self._released.clear()
        # A thread of its own: a controller loop busy with one long request must not let it expire.
        self._renewer = threading.Thread(target=self._renew_loop, name="controller-db-lease", daemon=True)
        self._renewer.start()

    # -- holding it ----------------------------------------------------------------------------------

    def renew(self) -> bool:
        """One renewal now: True when the row still carries our token (its expiry pushed on); False when
        the database cannot be reached. LeaseLostError when another controller took it."""
        fence = self.fence
        if fence is None:
            return False
        started = time.monotonic()
        try:
            with self.database.transaction() as sql:
                row = sql.execute(
                    "UPDATE controller_lease SET expires_at = clock_timestamp() + make_interval(secs => ?) "
                    "WHERE prefix = ? AND token = ? RETURNING token",
                    (float(self.claim.ttl_s), fence.prefix, fence.token),
                ).fetchone()
                holder = None
                if row is None:
                    now = sql.execute(
                        "SELECT holder, token FROM controller_lease WHERE prefix = ?", (fence.prefix,)
                    ).fetchone()
                    holder = "nobody" if now is None else f"{now[0]} (token {now[1]})"
        except DatabaseUnavailableError as exc:
            if not self._unreachable:  # once per outage: the loop tries again every tick
                log.warning("fleet.controller.lease.renew_failed", prefix=self.prefix, error=str(exc))
                self._unreachable = True
            return False
        if self._unreachable:
            log.warning("fleet.controller.lease.database_back", prefix=self.prefix)
            self._unreachable = False
        if holder is not None:
            self._taken_by = holder
            raise LeaseLostError(str(self.lost_for_good))
        self._confirmed = started
        return True

    def _renew_loop(self) -> None:
        while not self._released.wait(self.claim.ttl_s / 3):
            try:
                renewed = self.renew()
            except LeaseLostError:
                return  # `lost_for_good` says so; the controller's loop stops
            if not renewed:
                # Unreachable: try again soon, the expiry by the database's clock goes on meanwhile.
                while not renewed and not self._released.wait(1.0):
                    try:
                        renewed = self.renew()
                    except LeaseLostError:
                        return

    @property
    def lost_for_good(self) -> str | None:
        """Why the lease is another's now (None: it is not known to be)."""
        if self._taken_by is None:
            return None
        token = None if self.fence is None else self.fence.token
        return (
            f"prefix {self.prefix} was taken by {self._taken_by}; this controller's token {token} is fenced"
        )

    @property
    def lost(self) -> str | None:
        """Why this controller may not act now (None: it may): taken, or not confirmed by the database
        for a whole ``ttl_s`` (a standby may have taken it: pause until :meth:`regain` confirms)."""
        final = self.lost_for_good
        if final is not None:
            return final
        if self.fence is None:
            return "the lease was never taken"
        if time.monotonic() - self._confirmed > self.claim.ttl_s:
            ttl = self.claim.ttl_s
            return f"the lease on prefix {self.prefix} was not confirmed by the database for {ttl} s"
        return None

    def regain(self, timeout: float = 10.0) -> bool:
        """One renewal now (see :meth:`renew`): True when held, False while the database is out of reach."""
        del timeout
        final = self.lost_for_good
        if final is not None:
            raise LeaseLostError(final)
        if self._released.is_set():
            return False
        return self.renew()

    def release(self, timeout: float = 5.0) -> None:
        """Give the lease up now (its row expired at once, the token kept) and close the connection."""
        del timeout
        self._released.set()
        if self._renewer is not None:
            self._renewer.join(5.0)
        fence = self.fence
        if fence is not None and self._taken_by is None:
            try:
                with self.database.transaction() as sql:
                    sql.execute(
                        "UPDATE controller_lease SET expires_at = '-infinity' WHERE prefix = ? AND token = ?",
                        (fence.prefix, fence.token),
                    )
                log.info("fleet.controller.lease.released", prefix=self.prefix)
            except DatabaseUnavailableError:
                log.warning("fleet.controller.lease.release_failed", prefix=self.prefix)
        self.database.close()
