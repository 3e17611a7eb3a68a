"""A refusal of the CA's checks: a code the device reads in its reply and one line saying why."""

from __future__ import annotations

from typing import Generic, TypeVar

CodeT = TypeVar("CodeT", bound=str)


class Refused(Exception, Generic[CodeT]):  # noqa: N818 - a refusal, not a crash
    """Something untrusted the CA will not accept: ``code`` for the reply, ``message`` one line."""

    def __init__(self, code: CodeT, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code: CodeT = code
        self.message = message
