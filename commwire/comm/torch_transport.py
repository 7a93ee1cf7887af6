"""The torch transport: a communicator's data over a ``torch.distributed`` process group.

gloo moves host buffers, NCCL moves CUDA buffers (a group made with
``"cpu:gloo,cuda:nccl"`` does both); MPI stays the control plane (the agreement
protocol, the flags, pickled objects, Adasum), as in Horovod. Every collective
runs as a torch collective on the group (``async_op=True``, then waited on;
on a lane thread NCCL's works are polled, yielding the CPU), with a few conversions
where torch's backends lack a type or an operation — each exact, so results are
bit-identical to the MPI transport's:

* gloo reduces no int16/uint16/uint32/uint64: int16/uint16 reduce as int32 and
  uint32 as int64 (sums and products wrap alike once narrowed back), uint64
  sums and products as int64 (two's complement adds and multiplies the same
  bits), uint64 min/max as int64 with the sign bit flipped;
* float min/max reduce as order-preserving integers with NaN mapped to the
  winning extreme (``DeviceOps.ordered``), so NaN propagates as numpy's does
  whatever the backend's comparison does (as the canonical quiet NaN);
* gathers of unequal blocks and reduce-scatters of unequal blocks pad every
  block to the largest (torch's collectives take equal blocks).

The codec pipeline's point-to-point messages over gloo travel on groups of their own
(``private``): gloo moves all of a rank pair's messages over one TCP connection guarded
by one lock, which its event-loop thread only try-locks, and spins on epoll until it
gets it (pytorch/gloo#246). A rank posting a send or receive on a connection its peer's
data is arriving on holds that lock; where cores are shared the spinning threads then
keep the poster off the CPU until the scheduler's slice ends, 2-4 ms. Each direction
(lower to higher rank, higher to lower) and tag parity (the pipeline's two phases) has
its own group, so a rank posts a send on a connection that carries no incoming data.

NCCL runs on its own stream: work queued on the caller's stream is complete
before NCCL reads a buffer (the communicator synchronises device buffers before
a move, as for MPI) and ``Work.wait()`` orders the caller's stream after NCCL's.

``init_torch_distributed`` starts torch.distributed inside an MPI job (rank and
size from MPI, rank 0's address and a free port shared by broadcast), and
``process_group_ranks`` checks a group's ranks against MPI's.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import Any

import numpy as np

from .handle import Blocked, in_lane
from .transport import Transport, spans_nodes

__all__ = ["TorchTransport", "init_torch_distributed", "default_backend", "free_port", "rendezvous_address",
           "interface_address", "BACKENDS"]

BACKENDS = ("gloo", "nccl", "cpu:gloo,cuda:nccl")
"""The torch.distributed backends commwire sets up itself (``init_torch_distributed``)."""
_YIELDS = 16
_NAP = 100e-6
_BESIDE_NAP = 200e-6


def default_backend() -> str:
    """Return the backend ``init(transport="torch")`` starts: gloo and NCCL where CUDA exists, else gloo."""
    import torch

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_torch_distributed(comm: Any, backend: str, timeout: Any = None) -> None:
    """Initialise torch.distributed over the ranks of MPI communicator ``comm`` (collective; once per process).

    The address is MASTER_ADDR if set (``commwire run --lab`` sets it), else loopback when every
    rank is on one node, else rank 0's host address; the port is MASTER_PORT if set, else a free
    one chosen on rank 0. An initialised torch.distributed must number its ranks as MPI does.
    """
    import torch
    import torch.distributed as dist

    problem = None
    if backend not in BACKENDS:
        problem = f"backend={backend!r} is not supported; use one of {', '.join(map(repr, BACKENDS))}"
    elif "nccl" in backend and not torch.cuda.is_available():
        problem = (f"backend={backend!r} needs CUDA, but torch {torch.__version__} sees no GPU on this rank; use "
                   "backend='gloo', or transport='mpi'")
    elif dist.is_initialized() and (dist.get_world_size() != comm.Get_size() or dist.get_rank() != comm.Get_rank()):
        problem = (f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()}, "
                   f"but this is MPI rank {comm.Get_rank()} of {comm.Get_size()}; initialise it with MPI's rank and "
                   "size (or let commwire do it)")
    problems = comm.allgather(problem)  # every rank raises together, naming each rank's problem
    if any(problems):
        raise (ValueError if backend not in BACKENDS else RuntimeError)(
            "cannot start torch.distributed:\n" + "\n".join(f"  rank {r}: {p}" for r, p in enumerate(problems) if p))
    if dist.is_initialized():
        return
    if "nccl" in backend:
        local = comm.Split_type(_shared_type(), key=comm.Get_rank())
        try:
            torch.cuda.set_device(local.Get_rank() % torch.cuda.device_count())
        finally:
            local.Free()
    single = not spans_nodes(comm)  # collective: every rank calls it, whatever MASTER_ADDR says
    address: tuple[str, int] | str | None = None
    if comm.Get_rank() == 0:
        try:
            host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if single else rendezvous_address())
            port = int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else free_port(host)
            address = (host, port)
        except (OSError, ValueError) as exc:  # the others learn it from the broadcast instead of waiting
            address = (f"rank 0 cannot choose an address for torch.distributed's rendezvous ({exc}); set MASTER_ADDR "
                       "(and MASTER_PORT) to an address of rank 0's host that the other hosts reach, or name its "
                       "interface (commwire run --network-interface, GLOO_SOCKET_IFNAME)")
    address = comm.bcast(address, root=0)
    if isinstance(address, str):
        raise RuntimeError(address)
    host, port = address
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), **kwargs)


def _shared_type() -> Any:
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED


def rendezvous_address() -> str:
    """Return an IPv4 address of this host that other hosts reach, for torch.distributed's rendezvous.

    The interface GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) names, as ``commwire run
    --network-interface`` sets them; else the host name's address unless it is a loopback one
    (Debian and Ubuntu map the host name to 127.0.1.1); else the source address of the default route.

    Raises:
        OSError: none of them gives an address (the message says which was tried).
    """
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        names = [n for n in os.environ.get(variable, "").split(",") if n and n[0] not in "^="]
        if names:
            return interface_address(names[0])
    try:
        found = socket.gethostbyname(socket.gethostname())
        if not found.startswith("127."):
            return found
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # a documentation address: no packet is sent, only the route looked up
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise OSError(f"the host name {socket.gethostname()!r} gives no address other hosts reach, and there is no "
                      f"default route ({exc})") from None


def interface_address(name: str) -> str:
    """Return the IPv4 address of network interface ``name`` (or of the first whose name starts with it)."""
    import fcntl
    import struct

    known = [n for _, n in socket.if_nameindex()]
    chosen = name if name in known else next((n for n in known if n.startswith(name)), None)
    if chosen is None:
        raise OSError(f"no network interface {name!r} on this host (it has {', '.join(known)})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", chosen[:15].encode()))  # SIOCGIFADDR
        except OSError as exc:
            raise OSError(f"network interface {chosen!r} has no IPv4 address ({exc})") from None
    return socket.inet_ntoa(packed[20:24])


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port free on ``host`` now (for a rendezvous that starts soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def process_group_ranks(pg: Any) -> list[int]:
    """Return the global ranks of process group ``pg`` in its rank order."""
    import torch.distributed as dist

    return [int(r) for r in dist.get_process_group_ranks(pg)]


def _device_backends(pg: Any) -> dict[str, str]:
    """Return {device type: backend name} of process group ``pg``."""
    import torch.distributed as dist

    name = str(dist.get_backend(pg))
    if ":" in name:
        return dict(part.split(":", 1) for part in name.split(","))
    devices = dist.Backend.backend_capability.get(name, ["cpu"])
    return {d: name for d in devices}


class _TorchOp:
    """How one (operation, dtype) reduces on torch: the ReduceOp and the exact conversion around it."""

    __slots__ = ("op", "how", "wide")

    def __init__(self, op: Any, how: str, wide: Any = None) -> None:
        self.op, self.how, self.wide = op, how, wide


class _Request:
    """A torch ``Work`` and what to do once it has completed (copy a padded result out, undo a conversion).

    ``pollable`` is False for works whose ``is_completed()`` stays False until ``wait()`` (gloo's
    reduce-scatter, in torch 2.13): a lane waits for those without polling.
    """

    __slots__ = ("work", "after", "pollable")

    def __init__(self, work: Any, after: Any = None, pollable: bool = True) -> None:
        self.work, self.after, self.pollable = work, after, pollable


class TorchTransport(Transport):
    """Data over a ``torch.distributed`` process group (see the module docstring).

    Args:
        pg: the process group (``torch.distributed.group.WORLD`` or one from ``new_group``).
        owned: whether this transport made ``pg`` (then ``free`` destroys it).
        prefix: the start of the names of the groups derived from this one (the same on every member).
        label: the name of this transport, the same on every member and unique in the process (the
            groups it makes for itself are named after it); default: ``prefix``.
    """

    name = "torch"

    def __init__(self, pg: Any, *, owned: bool = False, prefix: str = "commwire", label: str | None = None) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.pg = pg
        self.owned = owned
        self.prefix = prefix
        self.label = label or prefix
        self.ranks = process_group_ranks(pg)  # global ranks, in this group's order
        self.rank = dist.get_rank(pg)
        self.size = len(self.ranks)
        self.backends = _device_backends(pg)
        self._ops: dict[tuple[str, str], _TorchOp] = {}
        # gloo moves tagged isend/irecv in its own threads: the codec pipeline posts its receives
        # ahead and sends chunk by chunk, as over MPI. NCCL serialises a rank's point-to-point
        # operations on one stream (unmatched orders deadlock): there it uses all-to-all and all-gather.
        self.point_to_point = set(self.backends.values()) == {"gloo"}
        self._poll = "nccl" in self.backends.values()
        # (tag parity, lower to higher rank) -> the group those point-to-point messages take (``private``)
        self._routes: dict[tuple[int, bool], Any] | None = None

    def __repr__(self) -> str:
        return f"<TorchTransport rank {self.rank} of {self.size} ({self.describe()})>"

    def describe(self) -> str:
        """Return the group's backends, e.g. ``"cpu:gloo,cuda:nccl"``."""
        return ",".join(f"{d}:{b}" for d, b in self.backends.items())

    # ---------------------------------------------------------------- buffers
    def device_buffers(self, x: Any) -> bool:
        return self.backends.get("cuda") == "nccl"

    def check_buffer(self, x: Any, device: bool) -> None:
        """Raise a clear error if this group cannot move ``x`` (a device array if ``device``)."""
        where = "cuda" if device else "cpu"
        if where not in self.backends:
            fix = ("build the group with backend='nccl' or 'cpu:gloo,cuda:nccl'" if device else
                   "build the group with backend='gloo' or 'cpu:gloo,cuda:nccl', or move the tensor to the GPU")
            raise TypeError(f"a {'CUDA' if device else 'CPU'} {type(x).__name__} cannot travel over this process "
                            f"group (backends {self.describe()}): {fix}")
        if device and self.backends["cuda"] != "nccl":
            raise TypeError(f"a CUDA {type(x).__name__} on a process group whose CUDA backend is "
                            f"{self.backends['cuda']!r}: use an NCCL group ('cpu:gloo,cuda:nccl'), or copy the "
                            "tensor to the CPU")

    def _t(self, buf: Any) -> Any:
        """Return ``buf`` as a torch tensor sharing its memory."""
        torch = self._torch
        if isinstance(buf, np.ndarray):
            return torch.from_numpy(buf) if buf.dtype.kind != "V" else torch.from_numpy(buf.view(np.uint8))
        if isinstance(buf, torch.Tensor):
            return buf
        return torch.as_tensor(buf, device="cuda")  # cupy: through __cuda_array_interface__, no copy

    # ------------------------------------------------------------- reductions
    def reduce_op(self, op: str, dtype: np.dtype) -> _TorchOp:
        key = (op, dtype.str)
        found = self._ops.get(key)
        if found is None:
            found = self._ops[key] = self._make_op(op, np.dtype(dtype))
        return found

    def _make_op(self, op: str, dtype: np.dtype) -> _TorchOp:
        from .reduce import work_dtype

        torch, R = self._torch, self._dist.ReduceOp
        dtype = work_dtype(dtype)
        rop = {"sum": R.SUM, "avg": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}[op]
        if dtype.kind == "f" and op in ("min", "max"):
            return _TorchOp(rop, "ordered")
        if dtype in (np.dtype(np.int16), np.dtype(np.uint16)):
            return _TorchOp(rop, "widen", torch.int32)
        if dtype == np.dtype(np.uint32):
            return _TorchOp(rop, "widen", torch.int64)
        if dtype == np.dtype(np.uint64):
            return _TorchOp(rop, "flip" if op in ("min", "max") else "signed")
        return _TorchOp(rop, "direct")

    def allreduce(self, send: Any, recv: Any, rop: _TorchOp) -> None:
        self.wait([self._iallreduce(send, recv, rop)])

    def _iallreduce(self, send: Any, recv: Any, rop: _TorchOp) -> _Request:
        torch = self._torch
        out = self._t(recv)
        if send is not None:
            out.copy_(self._t(send).reshape(out.shape))
        how = rop.how
        if how == "direct":
            return _Request(self._dist.all_reduce(out, rop.op, group=self.pg, async_op=True))
        if how == "widen":
            work = out.to(rop.wide)
            after = _narrow(out, work)
        elif how == "signed":
            work, after = out.view(torch.int64), None
        elif how == "flip":
            work = out.view(torch.int64)
            work.bitwise_xor_(_SIGN64)
            after = _flip(work)
        else:  # ordered
            work, after = _to_ordered(torch, out, "min" if rop.op == self._dist.ReduceOp.MIN else "max")
        return _Request(self._dist.all_reduce(work, rop.op, group=self.pg, async_op=True), after)

    def reduce_scatter(self, send: Any, recv: Any, counts: np.ndarray, rop: _TorchOp) -> None:
        counts = [int(c) for c in counts]
        src, out = self._t(send).reshape(-1), self._t(recv).reshape(-1)
        if rop.how != "direct":  # rare (integer types gloo lacks, float min/max): reduce all, keep our block
            whole = src.clone()
            self.allreduce(None, whole, rop)
            start = sum(counts[:self.rank])
            out.copy_(whole[start:start + counts[self.rank]])
            return
        top = max(counts)
        if all(c == top for c in counts):
            self.wait([_Request(self._dist.reduce_scatter_tensor(out, src[:top * self.size], rop.op, group=self.pg,
                                                                 async_op=True), pollable=False)])
            return
        padded = src.new_zeros(top * self.size)
        start = 0
        for r, c in enumerate(counts):
            padded[r * top:r * top + c] = src[start:start + c]
            start += c
        mine = src.new_empty(top)
        self.wait([_Request(self._dist.reduce_scatter_tensor(mine, padded, rop.op, group=self.pg, async_op=True),
                            pollable=False)])
        out.copy_(mine[:counts[self.rank]])

    # ------------------------------------------------------------ data moves
    def allgather(self, send: Any, recv: Any) -> None:
        self.wait([self.iallgather(send, recv)])

    def iallgather(self, send: Any, recv: Any) -> _Request:
        out, src = self._t(recv).reshape(-1), self._t(send).reshape(-1)
        return _Request(self._all_gather(out, src, group=self.pg, async_op=True))

    def allgatherv(self, send: Any, recv: Any, counts: np.ndarray) -> None:
        self.wait([self.iallgatherv(send, recv, counts)])

    def iallgatherv(self, send: Any, recv: Any, counts: Any) -> _Request:
        """Start gathering blocks of ``counts[r]`` elements from each rank r into ``recv``, in rank order."""
        counts = [int(c) for c in counts]
        top = max(counts)
        src, out = self._t(send).reshape(-1), self._t(recv).reshape(-1)
        if all(c == top for c in counts):
            return self.iallgather(src[:top], out)
        padded = src.new_empty(top)
        padded[:counts[self.rank]] = src[:counts[self.rank]]
        every = src.new_empty(top * self.size)
        work = self._all_gather(every, padded, group=self.pg, async_op=True)

        def unpad() -> None:
            start = 0
            for r, c in enumerate(counts):
                out[start:start + c] = every[r * top:r * top + c]
                start += c

        return _Request(work, unpad)

    def broadcast(self, buf: Any, root: int) -> None:
        t = self._t(buf)
        self.wait([_Request(self._dist.broadcast(t, group=self.pg, group_src=root, async_op=True))])

    def alltoallv(self, send: Any, send_counts: np.ndarray, recv: Any, recv_counts: np.ndarray) -> None:
        self.wait([self.ialltoallv(send, send_counts, recv, recv_counts)])

    def ialltoallv(self, send: Any, send_counts: Any, recv: Any, recv_counts: Any) -> _Request:
        """Start sending ``send_counts[r]`` elements of ``send`` (in order) to each rank r; see ``alltoallv``."""
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        src, out = self._t(send).reshape(-1)[:sum(sc)], self._t(recv).reshape(-1)[:sum(rc)]
        return _Request(self._dist.all_to_all_single(out, src, rc, sc, group=self.pg, async_op=True))

    def alltoall_counts(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Exchange one int64 per rank pair (the row counts an ``alltoallv`` needs)."""
        self.wait([_Request(self._dist.all_to_all_single(self._t(recv), self._t(send), group=self.pg,
                                                         async_op=True))])

    def barrier(self) -> None:
        flag = self._torch.zeros(1, dtype=self._torch.int32)
        if "cpu" not in self.backends:
            flag = flag.cuda()
        self.allreduce(None, flag, self.reduce_op("sum", np.dtype(np.int32)))

    # gloo's send and receive works complete inside wait() (is_completed stays False until then):
    # not pollable, so a lane's wait waits on them instead of polling forever.
    def isend(self, buf: Any, dest: int, tag: int) -> Any:
        pg = self.pg if self._routes is None else self._routes[tag % 2, self.rank < dest]
        return _Request(self._dist.isend(self._t(buf), group=pg, group_dst=dest, tag=tag), pollable=False)

    def irecv(self, buf: Any, source: int, tag: int) -> Any:
        pg = self.pg if self._routes is None else self._routes[tag % 2, source < self.rank]
        return _Request(self._dist.irecv(self._t(buf), group=pg, group_src=source, tag=tag), pollable=False)

    def wait(self, requests: list[Any]) -> None:
        if self.beside is not None:
            self._move_beside(requests)
        # A gloo work's wait() sleeps on a condition variable while gloo's threads move and reduce
        # the data: a lane blocks in it. Polling there cost ~10% of a 4-rank training step on 2 cores
        # (its wake-ups took the CPU from gloo's threads). NCCL works are polled on a lane, as MPI's
        # requests are (see handle.wait_requests), and waited for below.
        with Blocked():
            if self._poll and in_lane():
                spins, start = 0, time.perf_counter()
                while not all(r.work.is_completed() for r in requests if r.pollable):
                    spins += 1
                    time.sleep(0 if spins < _YIELDS else min(_NAP, (time.perf_counter() - start) / 8))
            for r in requests:
                r.work.wait()  # raises the backend's error; orders the current CUDA stream after NCCL's
                if r.after is not None:
                    r.after()
                    r.after = None

    def progress(self, request: Any) -> None:
        # Between a pipeline's codec kernels: gloo's works move in gloo's threads, but the
        # collective's agreement flag (an MPI request) moves only inside MPI calls.
        beside = self.beside
        if beside is not None and beside.Test():
            self.beside = None

    def _move_beside(self, requests: list[Any]) -> None:
        """Test the collective's agreement flag (``beside``) until it or the data is complete.

        MPI moves the flag's all-reduce only inside MPI calls: left alone until the data is in,
        its rounds (log2 P round trips) came after the data's end. Tested every ``_BESIDE_NAP``
        while torch's work runs, it is done by then (1.4 ms into a 13 ms 1 MiB all-reduce on 4
        lab hosts); after it, the data is waited for without waking up.
        """
        beside = self.beside
        pollable = [r.work for r in requests if r.pollable]
        if not pollable:  # gloo's point-to-point works: one test each time the pipeline waits
            self.progress(None)
            return
        while not beside.Test():
            if all(w.is_completed() for w in pollable):
                return  # the next wait of this collective goes on testing it, or the protocol waits for it
            time.sleep(_BESIDE_NAP)
        self.beside = None

    # ------------------------------------------------------------------ groups
    def _backend(self) -> str:
        """Return the backend string that makes a group like this one (e.g. ``"gloo"``)."""
        if len(set(self.backends.values())) > 1:
            return ",".join(f"{d}:{b}" for d, b in self.backends.items())
        return next(iter(self.backends.values()))

    def derive(self, mpi_comm: Any, ranks: list[int], uid: str = "") -> TorchTransport:
        members = [self.ranks[r] for r in ranks]
        backend = self._backend()
        # Named by the new communicator's rank 0 and sent to its members over MPI: counters of derived
        # communicators differ between ranks (new_group is called by its members only) and a split's
        # parts share their uid, while a group's name keys its rendezvous in the store.
        name = mpi_comm.bcast(f"{self.prefix}:{uid}:{uuid.uuid4().hex}" if mpi_comm.Get_rank() == 0 else None, root=0)
        return TorchTransport(new_group(members, backend, name), owned=True, prefix=self.prefix, label=name)

    def private(self) -> TorchTransport:
        """Return this transport, its point-to-point routes made (collective over the group, once).

        The pipeline's collectives run inside one call of the communicator, in the same order on
        every rank, so the group's own sequence keeps them apart from every other collective. Over
        gloo, its sends and receives take four groups over the same ranks (see the module
        docstring): one per direction and tag parity.
        """
        if self.point_to_point and self.size > 1 and self._routes is None:
            backend = self._backend()
            self._routes = {(parity, up): new_group(self.ranks, backend, f"{self.label}:p2p{parity}{'du'[up]}")
                            for parity in (0, 1) for up in (False, True)}
        return self

    def free(self) -> None:
        if not self._dist.is_initialized():
            return
        for pg in (self._routes or {}).values():
            self._dist.destroy_process_group(pg)
        self._routes = None
        if self.owned:
            self._dist.destroy_process_group(self.pg)
            self.owned = False


def new_group(members: list[int], backend: str, name: str) -> Any:
    """Return a new process group over global ranks ``members`` (in that order), called by its members only.

    ``torch.distributed.new_group(use_local_synchronization=True)`` names a group after its
    ranks, so a second group over the same ranks (a lane's, a duplicate's) fails; this makes the
    group as ``new_group`` does, under ``name`` (the same on every member, unique in the process).
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    helper = getattr(c10d, "_new_process_group_helper", None)
    if helper is None:  # pragma: no cover - a torch without it: one group per set of ranks
        return dist.new_group(members, backend=backend, use_local_synchronization=True)
    default_pg = c10d._get_default_group()
    store = c10d._world.pg_map[default_pg][1]
    bk = dist.Backend(backend)
    pg, _ = helper(len(members), members.index(dist.get_rank()), members, bk, store, c10d.GroupName(name),
                   timeout=c10d._get_default_timeout(bk), device_id=default_pg.bound_device_id)
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(members)}
    return pg


_SIGN64 = -(1 << 63)


def _narrow(out: Any, work: Any) -> Any:
    def after() -> None:
        out.copy_(work)  # a wrapping (two's complement) narrowing, as MPI's own overflow

    return after


def _flip(work: Any) -> Any:
    def after() -> None:
        work.bitwise_xor_(_SIGN64)

    return after


def _to_ordered(torch: Any, out: Any, op: str) -> tuple[Any, Any]:
    """Return ``out`` (float32/float64) as order-preserving integers with NaN winning ``op``, and the inverse."""
    itype, mask = (torch.int64, (1 << 63) - 1) if out.dtype == torch.float64 else (torch.int32, (1 << 31) - 1)
    bits = out.view(itype)
    code = torch.where(bits < 0, bits ^ mask, bits)
    info = torch.iinfo(itype)
    code = torch.where(torch.isnan(out), torch.full_like(code, info.min if op == "min" else info.max), code)

    def after() -> None:
        bits.copy_(torch.where(code < 0, code ^ mask, code))
        out.masked_fill_(torch.isnan(out), float("nan"))  # the canonical quiet NaN, as numpy's minimum passes on

    return code, after
