"""Train a GLM on a data file over N ranks with SGD and CA-SGD, side by side.

Each rank reads only its column block (a .npy file is memory-mapped; a
svmlight/libsvm file is read and densified), then both solvers run the same
inner steps on the same batches. Printed per solver: final objective, training
wall time (slowest rank; with --s auto the time spent choosing s included), and
the training loop's allreduce count and bytes this rank handed to MPI.

Run (a demo file is written first when it does not exist):
    mpiexec -n 4 python examples/glm_casgd.py /tmp/demo.svm --demo --loss logistic --s 16
    mpiexec -n 4 python examples/glm_casgd.py /tmp/demo.svm --demo --s auto     # s chosen at fit time
    mpiexec -n 4 python examples/glm_casgd.py X.npy --labels y.npy --loss poisson
    mpiexec -n 4 python examples/glm_casgd.py 'X_{rank}.npy' --labels y.npy   # per-rank blocks
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from threadpoolctl import threadpool_limits

import commwire as cw
from commwire import glm


def write_demo(path: str, loss: str, m: int, n: int, seed: int) -> None:
    """Write a synthetic dense set in svmlight format (rank 0 only)."""
    from sklearn.datasets import dump_svmlight_file

    rng = np.random.default_rng(seed)
    X = rng.standard_normal((m, n)) / np.sqrt(n)
    z = X @ rng.standard_normal(n)
    z = (z - z.mean()) / z.std()
    if loss == "logistic":
        y = (2 * z + rng.standard_normal(m) > 0).astype(float)
    elif loss == "poisson":
        y = rng.poisson(np.exp(0.5 * z + 1.0)).astype(float)
    else:
        y = z + 0.1 * rng.standard_normal(m)
    dump_svmlight_file(X, y, path)


def load(path: str, labels: str | None, comm: cw.Communicator) -> glm.ColumnBlocks:
    """Return this rank's column block of the file."""
    if path.endswith(".npy"):
        if labels is None:
            raise SystemExit("a .npy X needs --labels y.npy")
        return glm.load_npy(path, labels, comm=comm)
    return glm.load_svmlight(path, comm=comm)


def main() -> None:
    """Parse arguments, train SGD and CA-SGD, print the comparison on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", help="X as .npy (may contain {rank}) or svmlight/libsvm text")
    parser.add_argument("--labels", help="labels .npy (with a .npy X)")
    parser.add_argument("--loss", default="logistic", choices=["logistic", "least_squares", "poisson"])
    parser.add_argument("--s", type=_steps, default=16,
                        help="inner steps per Gram exchange, or 'auto' (chosen from the measured link and Gram cost)")
    parser.add_argument("--b", type=int, default=16, help="batch size")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--l2", type=float, default=1e-4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--precision", default="mixed", help="CA-SGD precision preset (SGD runs FP32)")
    parser.add_argument("--demo", action="store_true", help="write a synthetic file at DATA first if missing")
    parser.add_argument("--demo-shape", default="100000,32", help="rows,columns of the demo file")
    args = parser.parse_args()

    comm = cw.init()
    if args.demo and comm.rank == 0 and not os.path.exists(args.data):
        m, n = (int(v) for v in args.demo_shape.split(","))
        write_demo(args.data, args.loss, m, n, seed=0)
    comm.barrier()
    blocks = load(args.data, args.labels, comm)
    steps = args.epochs * (blocks.n_samples // args.b)
    runs = [("sgd", "fp32", 1), ("casgd", args.precision, args.s)]
    lines = []
    with threadpool_limits(limits=1, user_api="blas"):  # the ranks already fill the cores
        for solver, precision, s in runs:
            cfg = glm.SolverConfig(loss=args.loss, solver=solver, s=s, batch_size=args.b, lr=args.lr, l2=args.l2,
                                   precision=precision, max_steps=steps, tol=None, seed=0)
            glm.solve(blocks, cfg, comm=comm, max_steps=min(steps, 2 * s if s != "auto" else 64))  # compile
            result = glm.solve(blocks, cfg, comm=comm)
            # s="auto" spends a few all-reduces and Gram timings choosing s: its time counts, not its messages
            tune = result.auto.tune_s if result.auto else 0.0
            wall = comm.mpi.allreduce(result.time_s + tune, op=max_op())
            loss = glm.objective(blocks, result.coef, result.intercept, loss=args.loss, l2=args.l2, comm=comm)
            label = f"s=auto->{result.s}, tuning {1e3 * tune:.0f} ms" if s == "auto" else f"s={s}"
            lines.append((f"{solver} ({precision}, {label})", loss, wall, result.n_exchanges, result.exchange_bytes))
    if comm.rank == 0:
        print(f"{args.data}: {blocks.n_samples} x {blocks.n_features}, {comm.size} ranks, "
              f"{steps} steps of b={args.b}, loss={args.loss}")
        print(f"{'solver':40} {'loss':>12} {'wall s':>9} {'allreduces':>11} {'bytes/rank':>12}")
        for name, loss, wall, calls, nbytes in lines:
            print(f"{name:40} {loss:12.6f} {wall:9.3f} {calls:11d} {nbytes:12d}")
        base, ca = lines
        print(f"CA-SGD vs SGD: {base[2] / ca[2]:.2f}x wall time, loss gap {100 * (ca[1] - base[1]) / base[1]:+.3f}%")


def _steps(text: str) -> int | str:
    """Parse --s: a positive integer or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive integer nor 'auto'") from None


def max_op():
    """Return MPI.MAX (the slowest rank decides the wall time)."""
    from mpi4py import MPI

    return MPI.MAX


if __name__ == "__main__":
    main()
