"""Small TensorRT helpers that the runner (:mod:`agent.backends.tensorrt`) and the build steps
(:mod:`agent.engines.trt.steps`) share: is a real TensorRT here, its major version, and honest
types over the stubs' gaps. Imports TensorRT lazily, so it imports everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from agent.errors import EngineError

if TYPE_CHECKING:
    import tensorrt as trt

T = TypeVar("T")

TENSORRT_INSTALL_HINT = (
    "on Jetson install JetPack's python3-libnvinfer (TensorRT is not a pip dependency of the agent)"
)


def tensorrt_status() -> tuple[bool, str]:
    """Whether a real TensorRT is importable here, and its version or why not.

    ``import tensorrt`` alone proves nothing: the ``tensorrt-stubs`` type stubs make it succeed as
    an empty namespace package, so the check looks for ``tensorrt.Builder``.
    """
    try:
        import tensorrt as trt
    except ImportError:
        return False, f"TensorRT is not installed: {TENSORRT_INSTALL_HINT}"
    if not hasattr(trt, "Builder") or not hasattr(trt, "Runtime"):
        return False, f"TensorRT is not installed (only its type stubs are): {TENSORRT_INSTALL_HINT}"
    return True, f"TensorRT {getattr(trt, '__version__', '?')}"


def trt_major(version: str) -> int:
    """Major version from ``tensorrt.__version__`` (``"10.3.0.30"`` -> 10, ``"8.5.2.2"`` -> 8)."""
    head = version.strip().split(".", 1)[0]
    if not head.isdigit():
        raise EngineError(f"cannot read a TensorRT major version from {version!r}")
    return int(head)


def nullable(value: T) -> T | None:
    """Widen a TensorRT return type to include None.

    ``deserialize_cuda_engine``, ``build_serialized_network`` and ``create_execution_context``
    return None on failure, which the stubs do not declare; this keeps the None checks honest for
    the type checker.
    """
    return value


def succeeded(status: object) -> bool:
    """A TensorRT boolean status as a real ``bool``.

    The stubs annotate these returns as ``bool`` inside a module that rebinds ``bool`` to a
    ``DataType`` member, so the type checker would otherwise call every failure branch unreachable.
    """
    return bool(status)


def dims_of(dims: trt.Dims) -> list[int]:
    """A TensorRT ``Dims`` as a list of ints (the stubs give it ``__getitem__``, not ``__iter__``)."""
    return [int(dims[i]) for i in range(len(dims))]
