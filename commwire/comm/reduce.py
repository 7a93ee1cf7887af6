"""Reduction operations: names, the MPI op for each (operation, dtype), and their checks.

``sum``, ``avg``, ``min``, ``max`` and ``prod`` map to MPI's own reductions
(float16/bfloat16 reduce in float32, since MPI has no 16-bit float arithmetic;
bool takes logical and/or for min/max). ``adasum`` is not an MPI op: the
communicator runs commwire.comm.adasum for it. Float min/max use ops that
propagate NaN as numpy does (MPI's compare with ``<``, so a NaN would win or
lose depending on the reduction order and ranks could end with different
results).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import HALF_DTYPES, dtype_name

__all__ = ["REDUCE_OPS", "normalize_op", "work_dtype", "mpi_op", "flag_values", "check_reduction"]

REDUCE_OPS = ("sum", "avg", "min", "max", "prod", "adasum")
_ALIASES = {"average": "avg", "mean": "avg", "add": "sum", "product": "prod", "multiply": "prod"}
_FLOAT32 = np.dtype(np.float32)
_BOOL = np.dtype(bool)


def normalize_op(op: Any) -> str:
    """Return the canonical name of reduction ``op``; raise ValueError naming the choices."""
    key = _ALIASES.get(op, op) if isinstance(op, str) else op
    if key not in REDUCE_OPS:
        raise ValueError(f"op={op!r} is not supported; use one of {', '.join(REDUCE_OPS)}")
    return key


def work_dtype(dtype: np.dtype) -> np.dtype:
    """Return the dtype MPI reduces ``dtype`` in (float32 for the half types)."""
    return _FLOAT32 if dtype in HALF_DTYPES else dtype


def check_reduction(op: str, dtype: np.dtype) -> None:
    """Raise TypeError if ``op`` cannot reduce ``dtype`` exactly as documented."""
    if op == "avg" and dtype.kind in "iub":
        raise TypeError(f"op='avg' on {dtype_name(dtype)} would truncate; use op='sum' and divide, "
                        "or cast to a float dtype")
    if dtype == _BOOL and op not in ("min", "max"):
        raise TypeError(f"op={op!r} on bool is not defined; use op='min' (logical and) or 'max' (logical or), "
                        "or cast to an integer dtype")
    if op == "adasum" and dtype.kind != "f" and dtype not in HALF_DTYPES:
        raise TypeError(f"op='adasum' needs a float dtype, got {dtype_name(dtype)}")


def mpi_op(op: str, dtype: np.dtype) -> Any:
    """Return the MPI op that reduces ``dtype`` (its work dtype) for canonical ``op``."""
    from mpi4py import MPI

    if dtype == _BOOL:
        return MPI.LAND if op == "min" else MPI.LOR
    if op in ("min", "max") and (dtype.kind == "f" or dtype in HALF_DTYPES):
        return _nan_ops()[op]
    return {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}[op]


def flag_values(op: str) -> tuple[int, int]:
    """Return (value of a valid rank, value of a deviating rank) for a flag reduced with ``op``.

    The reduced flag equals the valid value exactly when no rank deviates:
    sums and maxima of 0/1 are 0 unless some rank sent 1; minima and products
    of 1/0 are 1 unless some rank sent 0.
    """
    return (1, 0) if op in ("min", "prod") else (0, 1)


_NAN_OPS: dict[str, Any] = {}


def _nan_ops() -> dict[str, Any]:
    if not _NAN_OPS:
        from mpi4py import MPI

        def make(fn: Any) -> Any:
            def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
                dtype = np.float32 if datatype.Get_size() == 4 else np.float64
                a = np.frombuffer(inbuf, dtype=dtype)
                b = np.frombuffer(inoutbuf, dtype=dtype)
                fn(a, b, out=b)

            return MPI.Op.Create(reduce, commute=True)

        _NAN_OPS.update(min=make(np.minimum), max=make(np.maximum))
    return _NAN_OPS
