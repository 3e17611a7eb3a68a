"""Every wait of the suite is under one patience rule (docs/testing.md, "Bounds and a loaded machine").

A bound handed to a wait that does not stretch it itself (the standard library's ``Event.wait``,
``Thread.join``, ``Popen.wait``, ``Queue.get``, ``Condition.wait_for``, ``subprocess.run``, Playwright's
millisecond ``timeout=``, agent code such as ``FleetDeploy.wait``) is written ``patient(seconds)`` (or
``patient_ms(seconds)``): a number there, or a name bound to a number (a parameter's default, a module
constant), is a bound that a loaded machine can outrun while the test is right. The helpers of tests/
that stretch their bounds themselves (``wait_until``, ``Probe.wait_for``, ``Daemon.wait_for_event``, ...)
take plain seconds, and ``patient(...)`` handed to one of them would stretch it twice.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: Methods whose bound is the first positional argument or ``timeout=`` (a ``str.join`` or ``dict.get``
#: takes no number there, so a number or a numeric name is a wait's bound).
RAW_WAITS = {"wait", "join", "result", "communicate", "acquire", "get"}
#: Playwright waits: their ``timeout=`` is in milliseconds.
BROWSER_WAITS = {
    "wait_for_selector",
    "wait_for_function",
    "wait_for_url",
    "wait_for_load_state",
    "goto",
    "to_have_count",
    "to_have_text",
    "to_contain_text",
    "to_have_attribute",
    "to_be_visible",
    "to_be_hidden",
}
#: ``subprocess``'s functions, whose ``timeout=`` is a wait for the child.
SUBPROCESS_RUNS = {"run", "check_output", "check_call", "call"}
#: Network clients whose ``timeout=`` (or ``settimeout``'s argument) bounds a wait for a server.
NETWORK_WAITS = {
    "urlopen",
    "HTTPConnection",
    "HTTPSConnection",
    "create_connection",
    "settimeout",
    "wait_for_publish",
}
#: Helpers of tests/ that stretch the bound they are given by the patience themselves.
PATIENT_HELPERS = {
    "wait_until",
    "wait_for_count",
    "wait_for_event",
    "final_status",
    "finish",
    "subscribe_many",
}

#: A bound of at most this many seconds is a pace (a poll loop's wait) or a look at what has not
#: happened yet (``assert not done.wait(0.5)``): its expiry is the expected outcome, not a failure.
POLL_S = 0.5

#: Raw waits whose bound is not a give-up bound, each with why (file, line text): keep it short.
ALLOWED: dict[tuple[str, str], str] = {
    ("tests/fleet/metrics/scraped_fleet.py", "self._stop.wait(TELEMETRY_EVERY_S)"): "the fake devices' pace",
    ("tests/run_processes.py", "self._stopped.wait(SCAN_EVERY_S)"): "the descendants' scan's pace",
    ("tests/fleetsim/test_fleet_convergence.py", "d.wait(timeout=8)"): "a window in which an off device "
    "stays silent while the others go on, not a bound on an event",
    ("tests/fleet/controller/test_db_failover.py", "threading.Event().wait(OUTAGE_S)"): "the database "
    "outage the test makes, not a bound on an event",
    ("tests/lifecycle/release/test_install.py", "time.monotonic() + 0.5"): "the install time limit the "
    "test makes expire, not a bound on an event",
}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    text: str
    why: str
    bound: ast.expr | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.why}: {self.text}"


def _numeric(node: ast.expr) -> bool:
    """A number, or arithmetic of numbers only (``3 * 60``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int | float) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    return False


def _poll(node: ast.expr) -> bool:
    return _numeric(node) and float(eval(compile(ast.Expression(node), "<bound>", "eval"))) <= POLL_S


def _is_patient(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("patient", "patient_ms")
    )


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str, source: str, tree: ast.Module) -> None:
        self.path, self.source = path, source
        self.findings: list[Finding] = []
        # Module constants bound to a number (SHOWS_WITHIN_MS = 5000), and per function the
        # parameters with a numeric default (timeout: float = 30.0).
        self.constants = {
            target.id
            for stmt in tree.body
            if isinstance(stmt, ast.Assign | ast.AnnAssign)
            and stmt.value is not None
            and _numeric(stmt.value)
            for target in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
            if isinstance(target, ast.Name)
        }
        self.numeric_params: list[set[str]] = []

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        defaults = dict(
            zip(
                [a.arg for a in positional[len(positional) - len(args.defaults) :]],
                args.defaults,
                strict=True,
            )
        )
        defaults |= {
            a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None
        }
        self.numeric_params.append({name for name, default in defaults.items() if _numeric(default)})
        self.generic_visit(node)
        self.numeric_params.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _fixed(self, node: ast.expr) -> bool:
        """A bound that is a number, or a name bound to one."""
        if _numeric(node):
            return True
        if isinstance(node, ast.Name):
            in_function = any(node.id in params for params in self.numeric_params)
            return in_function or node.id in self.constants
        return False

    def _flag(self, call: ast.Call, why: str, bound: ast.expr) -> None:
        text = (ast.get_source_segment(self.source, call) or "").splitlines()[0].strip()
        if (self.path, text) not in ALLOWED:
            self.findings.append(Finding(self.path, call.lineno, text, why, bound))

    def visit_BinOp(self, node: ast.BinOp) -> None:
        """``time.monotonic() + 30``: a deadline of a wait written out by hand."""
        self.generic_visit(node)
        clock = node.left
        if (
            isinstance(node.op, ast.Add)
            and isinstance(clock, ast.Call)
            and ast.unparse(clock.func) in ("time.monotonic", "monotonic")
            and self._fixed(node.right)
        ):
            text = (ast.get_source_segment(self.source, node) or "").strip()
            if (self.path, text) not in ALLOWED:
                why = f"a deadline {ast.unparse(node.right)} s ahead, not stretched"
                self.findings.append(Finding(self.path, node.lineno, text, why, node.right))

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        receiver = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
        keywords = {k.arg: k.value for k in node.keywords if k.arg is not None}
        bound = keywords.get("timeout")
        condition = receiver.rsplit(".", 1)[-1].lstrip("_").lower() in ("cond", "condition")
        if name in PATIENT_HELPERS or (
            name == "wait_for" and node.args and not condition and receiver != "asyncio"
        ):
            # The bound may come by keyword or by position (the helpers differ in where it sits).
            for arg in [*node.args, *keywords.values()]:
                if _is_patient(arg):
                    self._flag(
                        node, f"{name} stretches its bound itself: patient() here stretches it twice", arg
                    )
            return
        raw = False
        if name in RAW_WAITS:
            if bound is None and name in ("wait", "join", "result") and node.args:
                bound = node.args[0]
            raw = True
        elif name == "wait_for":  # a Condition's (predicate, timeout) or a Playwright locator's
            if bound is None and len(node.args) >= 2:
                bound = node.args[1]
            raw = True
        elif name in BROWSER_WAITS or (name in SUBPROCESS_RUNS and receiver == "subprocess"):
            raw = True
        elif name in NETWORK_WAITS:
            if bound is None and name in ("settimeout", "wait_for_publish") and node.args:
                bound = node.args[0]
            raw = True
        if raw and bound is not None and self._fixed(bound) and not _poll(bound):
            self._flag(
                node,
                f"a fixed bound {ast.unparse(bound)} given to {name}(), which does not stretch it",
                bound,
            )


def findings(root: Path = TESTS) -> list[Finding]:
    found: list[Finding] = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        scan = _Scan(str(path.relative_to(root.parent)), source, tree)
        scan.visit(tree)
        found += scan.findings
    return found


if __name__ == "__main__":
    for f in findings():
        print(f)


def test_every_wait_of_the_suite_is_under_the_patience_rule() -> None:
    found = findings()
    rule = "raw waits (docs/testing.md, 'Bounds and a loaded machine'):\n"
    assert not found, rule + "\n".join(map(str, found))


def _scan(source: str) -> list[str]:
    tree = ast.parse(source)
    scan = _Scan("tests/example.py", source, tree)
    scan.visit(tree)
    return [f.text for f in scan.findings]


def test_the_scan_finds_each_kind_of_raw_wait() -> None:
    source = """
import subprocess, threading
SHOWS_MS = 5000

class Socket:
    def wait_for(self, what, predicate, timeout: float = 30.0):
        self._cond.wait_for(lambda: predicate(self.received), timeout)

def helper(done, proc, page, q):
    done.wait(10)
    proc.wait(timeout=2 * 60)
    q.get(timeout=5)
    subprocess.run(["true"], timeout=30)
    page.wait_for_selector("#x", timeout=SHOWS_MS)
    wait_until(lambda: True, timeout=patient(10))
    wait_until(lambda: True, patient(10), "by position")
    deadline = time.monotonic() + 30
    urllib.request.urlopen(url, timeout=10)
    asyncio.wait_for(task, 5)
"""
    assert _scan(source) == [
        "self._cond.wait_for(lambda: predicate(self.received), timeout)",
        "done.wait(10)",
        "proc.wait(timeout=2 * 60)",
        "q.get(timeout=5)",
        'subprocess.run(["true"], timeout=30)',
        'page.wait_for_selector("#x", timeout=SHOWS_MS)',
        "wait_until(lambda: True, timeout=patient(10))",
        'wait_until(lambda: True, patient(10), "by position")',
        "time.monotonic() + 30",
        "urllib.request.urlopen(url, timeout=10)",
        "asyncio.wait_for(task, 5)",
    ]


def test_patient_bounds_polls_and_the_suites_own_helpers_pass() -> None:
    source = """
def fine(done, proc, probe, items, deadline, timeout):
    done.wait(patient(10))
    proc.wait(timeout=patient(5))
    assert not done.wait(0.5)
    ", ".join(items)
    done.wait(deadline - 1)
    done.wait(timeout)
    probe.wait_for(lambda ms: bool(ms), timeout=10)
    wait_until(lambda: True, timeout=10)
    deadline = time.monotonic() + patient(30)
"""
    assert _scan(source) == []
