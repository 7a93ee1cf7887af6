"""1D block-column data: each rank holds a column block of X and the replicated labels."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._validate import positive_int
from ..comm.runtime import default_comm

__all__ = ["ColumnBlocks", "column_ranges", "from_array", "load_npy", "load_svmlight"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ColumnBlocks:
    """Hold this rank's column block of X and the labels every rank shares."""

    X: Any
    """This rank's block: m rows, columns start .. start + X.shape[1] of the full X."""
    y: Any
    """All m labels (replicated on every rank)."""
    start: int
    """Global index of this block's first column."""
    n_features: int
    """Number of columns of the full X."""

    def __post_init__(self) -> None:
        if getattr(self.X, "ndim", None) != 2:
            raise ValueError(f"X must be a 2-D array (rows x this rank's columns), "
                             f"got shape {getattr(self.X, 'shape', None)}")
        if getattr(self.y, "ndim", None) != 1:
            raise ValueError(f"y must be a 1-D array of labels, got shape {getattr(self.y, 'shape', None)}")
        if self.X.shape[0] != self.y.shape[0]:
            raise ValueError(f"X has {self.X.shape[0]} rows but y has {self.y.shape[0]} labels; they must match")
        if not 0 <= self.start <= self.start + self.X.shape[1] <= self.n_features:
            raise ValueError(
                f"columns {self.start}..{self.start + self.X.shape[1]} do not fit in n_features={self.n_features}"
            )

    @property
    def n_samples(self) -> int:
        """Return the number of rows m."""
        return int(self.X.shape[0])


def column_ranges(n_features: int, n_parts: int) -> list[tuple[int, int]]:
    """Split n_features columns into n_parts contiguous ranges differing by at most one."""
    positive_int("n_parts", n_parts)
    base, extra = divmod(n_features, n_parts)
    bounds = np.cumsum([0] + [base + (p < extra) for p in range(n_parts)])
    return [(int(bounds[p]), int(bounds[p + 1])) for p in range(n_parts)]


def from_array(X: Any, y: Any, *, comm: Any = None, root: int | None = None) -> ColumnBlocks:
    """Return this rank's column block of an in-memory X held by every rank or by root only.

    Args:
        X: the full m x n array; with root set, only root's argument is read (others pass None).
        y: the m labels, likewise.
        comm: the Communicator (None: the world, initialising commwire if needed).
        root: None when every rank holds X and y; else the rank that holds them and
            sends each rank its block (one-off setup traffic, not a training message).
    """
    comm = default_comm(comm, init_if_needed=True)
    if root is None:
        X = np.asarray(X) if not hasattr(X, "__cuda_array_interface__") else X
        if getattr(X, "ndim", None) != 2:
            raise ValueError(f"X must be a 2-D array, got shape {getattr(X, 'shape', None)}")
        lo, hi = column_ranges(X.shape[1], comm.size)[comm.rank]
        return ColumnBlocks(X=X[:, lo:hi], y=y, start=lo, n_features=int(X.shape[1]))
    if comm.rank == root:
        X = np.asarray(X)
        if X.ndim != 2:
            raise ValueError(f"X must be a 2-D array, got shape {X.shape}")
        ranges = column_ranges(X.shape[1], comm.size)
        blocks = [np.ascontiguousarray(X[:, lo:hi]) for lo, hi in ranges]
        header = (int(X.shape[1]), ranges, np.asarray(y))
    else:
        blocks, header = None, None
    # Setup traffic goes through mpi4py's object scatter: blocks of different
    # widths are one call, and it is not part of what the solvers count.
    block = comm.mpi.scatter(blocks, root=root)
    n_features, ranges, labels = comm.broadcast_object(header, root=root)
    return ColumnBlocks(X=block, y=labels, start=ranges[comm.rank][0], n_features=n_features)


def _gather_widths(comm: Any, width: int) -> tuple[int, int]:
    widths = comm.allgather_object(int(width))
    return int(sum(widths[:comm.rank])), int(sum(widths))


def load_npy(x_path: str, y_path: str, *, comm: Any = None) -> ColumnBlocks:
    """Memory-map this rank's column block from .npy files.

    Args:
        x_path: a per-rank file with "{rank}" in the name (each holds that rank's
            columns, in rank order), or one file holding the full X that every rank
            maps and slices.
        y_path: the labels (.npy, length m), read by every rank.
        comm: the Communicator (None: the world, initialising commwire if needed).
    """
    comm = default_comm(comm, init_if_needed=True)
    y = np.load(y_path)
    if "{rank}" in x_path:
        X = np.load(x_path.format(rank=comm.rank), mmap_mode="r")
        if X.ndim != 2:
            raise ValueError(f"{x_path.format(rank=comm.rank)} holds shape {X.shape}; a 2-D block is needed")
        start, n_features = _gather_widths(comm, X.shape[1])
        return ColumnBlocks(X=X, y=y, start=start, n_features=n_features)
    X = np.load(x_path, mmap_mode="r")
    if X.ndim != 2:
        raise ValueError(f"{x_path} holds shape {X.shape}; a 2-D array is needed")
    lo, hi = column_ranges(X.shape[1], comm.size)[comm.rank]
    return ColumnBlocks(X=X[:, lo:hi], y=y, start=lo, n_features=int(X.shape[1]))


def load_svmlight(path: str, *, comm: Any = None, n_features: int | None = None,
                  zero_based: bool | str = "auto") -> ColumnBlocks:
    """Read this rank's column block from svmlight/libsvm text (densified).

    Args:
        path: a per-rank file with "{rank}" in the name whose feature indices are local
            to that rank's block (n_features then sets the block width, else the widest
            index read), or one file with the full X that every rank reads and slices.
        comm: the Communicator (None: the world, initialising commwire if needed).
        n_features: width of the file's feature space (per-rank files: of this block).
        zero_based: as in sklearn.datasets.load_svmlight_file.
    """
    from sklearn.datasets import load_svmlight_file

    comm = default_comm(comm, init_if_needed=True)
    name = path.format(rank=comm.rank) if "{rank}" in path else path
    X_sparse, y = load_svmlight_file(name, n_features=n_features, zero_based=zero_based)
    if "{rank}" in path:
        start, total = _gather_widths(comm, X_sparse.shape[1])
        return ColumnBlocks(X=X_sparse.toarray(), y=y, start=start, n_features=total)
    lo, hi = column_ranges(X_sparse.shape[1], comm.size)[comm.rank]
    return ColumnBlocks(X=X_sparse[:, lo:hi].toarray(), y=y, start=lo, n_features=int(X_sparse.shape[1]))
