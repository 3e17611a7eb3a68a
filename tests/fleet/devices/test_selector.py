"""The ``--select`` parser: every form of requirement, what each matches, and every error."""

from __future__ import annotations

import pytest

from agent.errors import UsageError
from agent.fleet.devices.selector import DeviceFacts, SelectorError, parse_selector

BERLIN = DeviceFacts(
    "jet-1",
    labels={"site": "berlin-3", "camera": "dock", "hw": "orin-nx", "example.com/tier": "gold"},
    platform={"dla_cores": 2, "tensorrt_version": "8.6.2", "jetson": True, "cuda_driver": None},
    agent_version="0.2.1",
)
PARIS = DeviceFacts(
    "jet-2",
    labels={"site": "paris-1", "hw": "orin-nano"},
    platform={"dla_cores": 0, "tensorrt_version": "10.3.0", "jetson": True},
    agent_version="0.1.9",
)
BARE = DeviceFacts("jet-3", agent_version="0.2.0rc1")  # no labels, no platform, a pre-release

# selector text -> which of BERLIN, PARIS, BARE it matches
MATCHES = [
    ("site=berlin-3", "jet-1"),
    ("site==berlin-3", "jet-1"),
    ("site = berlin-3", "jet-1"),
    ("site!=berlin-3", "jet-2 jet-3"),  # != also matches a device without the key (Kubernetes)
    ("site in (berlin-3,paris-1)", "jet-1 jet-2"),
    ("site in ( berlin-3 , nowhere )", "jet-1"),
    ("site notin (berlin-3)", "jet-2 jet-3"),
    ("camera", "jet-1"),
    ("!camera", "jet-2 jet-3"),
    ("site,!camera", "jet-2"),
    ("site=berlin-3,hw=orin-nano", ""),  # comma = AND
    ("hw!=orin-nano,site", "jet-1"),
    ("example.com/tier=gold", "jet-1"),
    ("camera=", ""),  # the empty value: a device labelled `camera: ""` only
    ("platform.dla_cores>=1", "jet-1"),
    ("platform.dla_cores>1", "jet-1"),
    ("platform.dla_cores<1", "jet-2"),
    ("platform.dla_cores<=2", "jet-1 jet-2"),
    ("platform.dla_cores=0", "jet-2"),
    ("platform.tensorrt_version>=10", "jet-2"),  # versions compare by parts: 10.3.0 > 8.6.2
    ("platform.tensorrt_version<8.10", "jet-1"),  # 8.6.2 < 8.10: not a decimal comparison
    ("platform.jetson=true", "jet-1 jet-2"),
    ("platform.cuda_driver", ""),  # a fact reported as null is not there
    ("platform.tensorrt_version", "jet-1 jet-2"),
    ("agent.version>=0.2", "jet-1"),  # 0.2.0rc1 is no plain version: matches no comparison
    ("agent.version<0.2", "jet-2"),
    ("agent.version", "jet-1 jet-2 jet-3"),
    ("agent.version>=0.2,platform.dla_cores>=1,site in (berlin-3)", "jet-1"),
]


@pytest.mark.parametrize(("text", "expected"), MATCHES)
def test_each_form_matches_what_it_says(text: str, expected: str) -> None:
    selector = parse_selector(text)
    assert " ".join(d.device for d in (BERLIN, PARIS, BARE) if selector.matches(d)) == expected


def test_the_selector_prints_in_one_canonical_form() -> None:
    text = " site == berlin-3 , !camera,hw in (a, b, a), platform.dla_cores>=1,agent.version "
    assert (
        str(parse_selector(text)) == "site=berlin-3,!camera,hw in (a,b),platform.dla_cores>=1,agent.version"
    )


# selector text -> (column of the error, words the message must hold)
ERRORS = [
    ("", 1, "empty selector"),
    ("   ", 4, "empty selector"),
    ("site=berlin-3,", 15, "expected a key"),
    ("site=berlin-3,,hw", 15, "agent.version), found ','"),
    ("site=berlin-3 hw", 15, "expected ',' or the end, found 'h'"),
    ("site ~ x", 6, "expected an operator"),
    ("site within (a)", 6, "found 'within'"),
    ("site in a,b", 9, "expected '('"),
    ("site in (a,b", 13, "expected ',' or ')' in the set of values, found the end"),
    ("site in (a b)", 12, "expected ',' or ')'"),
    ("site in ()", 10, "empty values are not allowed"),
    ("site in (a,,b)", 12, "empty values are not allowed"),
    ("site=a(b", 7, "expected ',' or the end"),
    ("site=*", 6, "expected a value, found '*'"),
    ("site=-x", 6, "label value '-x'"),
    ("-site=x", 1, "label key '-site'"),
    ("Example.com/site=x", 1, "prefix before '/'"),
    ("platform.DLA>=1", 1, "a platform key is platform.NAME"),
    ("agent.name=x", 1, "unknown key 'agent.name' (agent keys: agent.version)"),
    ("agent.version>=latest", 16, ">= compares numbers or versions"),
    ("platform.dla_cores>1.x", 20, "> compares numbers or versions"),
    ("site<", 6, "< compares numbers or versions"),
    ("!", 2, "expected a key"),
    ("!site=x", 6, "expected ',' or the end, found '='"),
    ("a" * 64, 1, "use 1-63 letters"),
]


@pytest.mark.parametrize(("text", "column", "words"), ERRORS)
def test_each_error_names_its_column_and_what_is_wrong(text: str, column: int, words: str) -> None:
    with pytest.raises(SelectorError) as info:
        parse_selector(text)
    error = info.value
    assert isinstance(error, UsageError)  # the CLI prints it as a plain `error:`, exit 1
    assert error.column == column, str(error)
    assert str(error) == f"--select: at column {column}: {error.what}"
    assert words in error.what
    # The second and third problem lines show the text with a caret under the column.
    assert error.problems[1:] == [f"  {text}", "  " + " " * (column - 1) + "^"]
