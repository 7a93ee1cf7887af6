"""Verify that all ranks call the same collective with matching arguments.

A rank that calls allreduce on a (3,) float32 array while another passes a
(4,) float64 one makes MPI hang or return garbage. In check mode every
collective first gathers a small signature from all ranks; any disagreement
raises ``CollectiveMismatchError`` on every rank, listing each rank's value.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CollectiveMismatchError", "verify"]


class CollectiveMismatchError(ValueError):
    """Ranks disagree on the operation, shape, dtype or reduction of a collective."""


_FIELDS = ("operation", "name", "shape", "dtype", "op", "root", "codec")


def verify(mpi_comm: Any, signature: tuple[Any, ...]) -> None:
    """Gather ``signature`` from every rank and raise if any field differs."""
    everyone = mpi_comm.allgather(signature)
    if all(sig == everyone[0] for sig in everyone):
        return
    lines = []
    for field_index, field in enumerate(_FIELDS[: len(signature)]):
        values = [sig[field_index] if len(sig) > field_index else None for sig in everyone]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            lines.append(f"  {field} differs -> {per_rank}")
    raise CollectiveMismatchError(
        f"ranks disagree on collective {signature[0]!r} (rank {mpi_comm.Get_rank()} of "
        f"{mpi_comm.Get_size()}):\n" + "\n".join(lines) + "\nmake every rank pass the same arguments"
    )
