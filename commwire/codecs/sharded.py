"""Compressed reduce-scatter (gradients) and all-gather (parameters) over codec payloads.

The collectives of sharded training (FSDP2, HSDP, ZeRO): gradients leave each
rank by reduce-scatter, parameters arrive by all-gather.

Reduce-scatter: rank j owns rows ``counts[j]`` of ``x`` (``numpy.array_split``'s
rule by default). Every rank encodes each peer's chunk of its own ``x`` and sends
it there (receives posted first; chunk r+1 is encoded while chunk r travels);
the owner starts from its own chunk in FP32, decodes and adds the peers' chunks
in rank order (so the result does not depend on arrival order), divides for
``avg`` and returns its rows. One quantisation per value, on the sender, so the
error is half the compressed all-reduce's (which re-encodes the reduced chunk).
Error feedback keeps one residual as long as ``x`` per name on the sending side
(each chunk its slice, ``Span``), so it survives a change of shard boundaries.

All-gather: every rank encodes its own rows once and the payloads travel by one
all-gather; every rank decodes every payload, its own included, so all ranks hold
bit-identical results. Error feedback is refused here: the full-precision shard
stays the master copy and is encoded afresh at each gather, so no error carries
over from one step to the next and nothing needs compensating.

Both run on either transport: point to point where it sends messages (MPI, gloo),
one all-to-all where it does not (NCCL). Errors agree on every rank
(``Communicator.run_collective``). Codecs that transform whole tensors before
chunking (GIFT) are refused: their inverse needs the whole reduced tensor.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

import numpy as np

from ..comm import arrays
from ..comm.arrays import adapter_for
from ..comm.buffers import describe, op_label, split_rows
from ..comm.communicator import Communicator, Signature
from ..comm.handle import Handle
from .base import Codec, Span, Wrapper
from .collective import _HOST, _HostSpace, _pipe, device_space, resolve_codec
from .feedback import ErrorFeedback

__all__ = ["compressed_reduce_scatter", "compressed_reduce_scatter_async", "compressed_allgather",
           "compressed_allgather_async", "check_sharded_codec"]

_F32 = np.dtype(np.float32)
_perf = time.perf_counter
_RS_TAG, _AG_TAG = 32100, 32101  # apart from the all-reduce pipeline's tags (below 32000), within MPI's 32767


def check_sharded_codec(codec: Any, operation: str) -> Codec:
    """Return ``codec`` resolved, or raise ValueError if it cannot serve ``operation``.

    ``operation`` is "reduce_scatter" or "allgather". Whole-tensor transforms (GIFT) are
    refused for both; error feedback is refused for all-gathers.
    """
    found = resolve_codec(codec)
    for stage in found.stages:
        if type(stage).tensor_forward not in (Codec.tensor_forward, Wrapper.tensor_forward):
            raise ValueError(
                f"codec {found.spec!r} transforms whole weight matrices before chunking ({type(stage).__name__}), "
                f"which a {operation} cannot undo on one rank's rows; use a codec without GIFT (e.g. "
                "'hadamard+fp8-e4m3', whose rotation is per block) or the compressed all-reduce")
    if operation == "allgather" and any(isinstance(s, ErrorFeedback) for s in found.stages):
        inner = found.spec.replace("ef+", "")
        raise ValueError(
            f"codec {found.spec!r}: error feedback compensates sums across steps; an all-gather re-encodes the "
            f"full-precision shard at every call, so no error carries over. Use {inner!r} for the all-gather")
    return found


class _Call:
    """Bookkeeping of one compressed reduce-scatter or all-gather."""

    def __init__(self, comm: Communicator, codec: Codec, dry: bool, flag: int | None = None) -> None:
        self.comm, self.codec, self.dry = comm, codec, dry
        # The agreement flag rides in the payload (one byte after each message) when ``flag`` is set
        # (0: this rank's arguments are the agreed ones, 1: they deviate); ``flagged``: anyone's was 1.
        self.flag, self.extra, self.flagged = flag, 0 if flag is None else 1, False
        self.times = {"encode": 0.0, "transfer": 0.0, "decode": 0.0}
        self.wire_sent = self.encoded_elems = self.encoded_wire = 0

    def encode(self, x: Any, out: Any, key: Hashable) -> None:
        if self.dry:  # a deviating rank moves zeros in the agreed pattern
            out[...] = 0
            return
        t = _perf()
        self.codec._encode(x, out, key)
        self.times["encode"] += _perf() - t
        self.encoded_elems += int(x.shape[0])
        self.encoded_wire += int(out.shape[0])

    def decode(self, buf: Any, n: int, out: Any, add: bool) -> None:
        if self.dry:
            return
        t = _perf()
        if add:
            self.codec._decode_add(buf, n, out)
        else:
            self.codec._decode(buf, n, out)
        self.times["decode"] += _perf() - t

    def mark(self, buf: Any, at: int) -> None:
        """Write this rank's flag byte at ``buf[at]`` (flagged calls only)."""
        if self.extra:
            buf[at] = self.flag

    def read(self, buf: Any, at: int) -> None:
        """Note a peer's flag byte at ``buf[at]`` (flagged calls only)."""
        if self.extra and int(buf[at]):
            self.flagged = True

    def wait(self, pipe: Any, reqs: list[Any], label: str, name: str | None) -> None:
        if not reqs:
            return
        t = _perf()
        with self.comm.watched(label, name):
            pipe.wait(reqs)
        self.times["transfer"] += _perf() - t

    def account(self, operation: str, name: str | None, start: float, input_bytes: int) -> None:
        end = _perf()
        counters = self.comm.counters
        counters.record(operation, self.wire_sent, end - start, input_bytes=input_bytes)
        counters.record_codec(self.codec.spec, self.encoded_elems * 4, self.encoded_wire, self.encoded_elems)
        counters.add(operation + "_phases", **self.times)
        if self.comm.timeline is not None:
            self.comm.timeline.add(name or operation, start, end, op=operation, codec=self.codec.spec,
                                   bytes=self.wire_sent, **{k + "_s": v for k, v in self.times.items()})


def _rows_of(counts: Any, rows: int, size: int, what: str) -> np.ndarray:
    if counts is None:
        return split_rows(rows, size)
    values = np.asarray(counts).reshape(-1)
    if values.dtype.kind not in "iu" or values.size != size or (values < 0).any():
        raise ValueError(f"counts={values.tolist()} must give a non-negative number of rows for each of the "
                         f"{size} ranks ({what})")
    return values.astype(np.int64)


def _reduce_scatter_flat(call: _Call, flat: Any, elems: list[int], key: Hashable, average: bool,
                         sp: _HostSpace, name: str | None, into: Any = None) -> Any:
    """Reduce-scatter the flat FP32 vector ``flat`` cut into ``elems`` per rank; return this rank's FP32 chunk.

    ``into``: optional float32 vector for the chunk (the caller's output, not overlapping ``flat``).
    """
    comm = call.comm
    size, rank, n = comm.size, comm.rank, int(flat.shape[0])
    starts = [int(s) for s in np.concatenate(([0], np.cumsum(elems)[:-1]))]
    x1 = call.extra
    wire = [int(call.codec.wire_nbytes(c)) for c in elems]
    peers = [(rank + k) % size for k in range(1, size)]  # each rank starts with a different peer
    w_me = wire[rank] + x1  # a message: the encoded chunk, then the flag byte of flagged calls
    send_off, o = {}, 0
    for r in range(size):
        if r != rank:
            send_off[r], o = o, o + wire[r] + x1
    send, h_send = sp.empty_u8(o), sp.mirror(o)
    recv, h_recv = sp.empty_u8(w_me * size), sp.mirror(w_me * size)  # slot r: rank r's encoding of my chunk
    pipe = _pipe(comm)
    acc = sp.empty_f32(elems[rank]) if into is None else into
    sp.ready()
    if pipe.point_to_point:
        recvs = {r: pipe.irecv(sp.incoming(recv, h_recv, r * w_me, (r + 1) * w_me), r, _RS_TAG) for r in peers}
        sends = []
        for r in peers:
            part = slice(starts[r], starts[r] + elems[r])
            lo = send_off[r]
            call.encode(flat[part], send[lo:lo + wire[r]], Span((key, "rs"), part.start, n))
            call.mark(send, lo + wire[r])
            sp.ready()
            sends.append(pipe.isend(sp.outgoing(send, h_send, lo, lo + wire[r] + x1), r, _RS_TAG))
        sp.copy(acc, flat[starts[rank]:starts[rank] + elems[rank]])
        for r in range(size):  # rank order: the same sum whatever order the chunks arrive in
            if r == rank:
                continue
            call.wait(pipe, [recvs[r]], "compressed_reduce_scatter", name)
            sp.arrived(recv, h_recv, r * w_me, (r + 1) * w_me)
            call.read(recv, (r + 1) * w_me - 1)
            call.decode(recv[r * w_me:r * w_me + wire[rank]], elems[rank], acc, add=True)
        call.wait(pipe, sends, "compressed_reduce_scatter", name)
    else:  # one all-to-all (NCCL): this rank's own slot travels empty
        for r in peers:
            part = slice(starts[r], starts[r] + elems[r])
            lo = send_off[r]
            call.encode(flat[part], send[lo:lo + wire[r]], Span((key, "rs"), part.start, n))
            call.mark(send, lo + wire[r])
        sp.ready()
        send_counts = [0 if r == rank else wire[r] + x1 for r in range(size)]
        recv_counts = [0 if r == rank else w_me for r in range(size)]
        packed = sp.empty_u8(w_me * (size - 1))
        h_packed = sp.mirror(w_me * (size - 1))
        call.wait(pipe, [pipe.ialltoallv(sp.outgoing(send, h_send, 0, o), send_counts,
                                         sp.incoming(packed, h_packed, 0, w_me * (size - 1)), recv_counts)],
                  "compressed_reduce_scatter", name)
        sp.arrived(packed, h_packed, 0, w_me * (size - 1))
        sp.copy(acc, flat[starts[rank]:starts[rank] + elems[rank]])
        for i in range(size - 1):
            call.read(packed, (i + 1) * w_me - 1)
            call.decode(packed[i * w_me:i * w_me + wire[rank]], elems[rank], acc, add=True)
    call.wire_sent += o - x1 * (size - 1)  # the flag bytes are the protocol's, not the payload's
    if average and not call.dry:
        sp.scale(acc, 1.0 / size)
    return acc


def compressed_reduce_scatter(comm: Communicator, x: Any, op: str = "sum", *, codec: Any, counts: Any = None,
                              out: Any = None, name: str | None = None) -> Any:
    """Reduce ``x`` over ``comm`` with ``codec`` payloads on the wire; return this rank's block of rows.

    Args:
        comm: the communicator.
        x: float array (numpy, torch or cupy) with at least one dimension, the same shape on every rank.
        op: "sum" or "avg".
        codec: spec string or codec object (``commwire.codecs.get``); a lossless codec runs
            ``comm.reduce_scatter``. Whole-tensor transforms (GIFT) are refused.
        counts: rows per rank (the same on every rank, summing to ``len(x)``); default
            ``numpy.array_split``'s rule. Uneven blocks are fine for every codec.
        out: optional array of this rank's block shape and x's dtype for the result.
        name: stable tensor name; keys error-feedback state and labels statistics.

    Returns:
        This rank's rows of the reduction, same kind, dtype and device as ``x``.

    Example:
        >>> shard = cw.reduce_scatter(grad, op="avg", codec="ef+fp8-e4m3", name="layer1")
    """
    codec_obj = resolve_codec(codec)
    if codec_obj.lossless:
        result = comm.reduce_scatter(x, op, name=name, counts=counts)
        return _into(out, result) if out is not None else result
    error = host = adapter = space = dtype = rows = None
    try:
        check_sharded_codec(codec_obj, "reduce_scatter")
        if op_label(op) not in ("sum", "avg"):
            raise ValueError(f"op={op!r} cannot run on codec {codec_obj.spec!r} payloads; use op='sum' or 'avg', "
                             "or codec=None")
        adapter = adapter_for(x)
        space = device_space(comm, codec_obj, x)
        if space is None:
            host = adapter.host(x)
            dtype = host.dtype
        else:
            dtype = arrays.device_ops(x).numpy_dtype(x)
        if dtype.kind != "f" and dtype.name != "bfloat16":
            raise TypeError(f"codec {codec_obj.spec!r} needs a float array, got {dtype}; pass codec=None")
        if len(x.shape) == 0:
            raise ValueError("reduce_scatter needs an array with at least one dimension, got a scalar; "
                             "reshape it to (1,) or use allreduce")
        rows = _rows_of(counts, int(x.shape[0]), comm.size, "reduce_scatter")
        if int(rows.sum()) != int(x.shape[0]):
            raise ValueError(f"counts={rows.tolist()} sum to {int(rows.sum())} rows, but x has {int(x.shape[0])}; "
                             "give each rank's rows so that they add up to len(x)")
        want = (int(rows[comm.rank]),) + tuple(int(d) for d in x.shape[1:])
        if out is not None and (tuple(out.shape) != want or arrays.dtype_name(out.dtype) != str(dtype)):
            raise ValueError(f"out= has shape {tuple(out.shape)} and dtype {arrays.dtype_name(out.dtype)}; this "
                             f"rank's block needs shape {want} and dtype {dtype}")
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it (Communicator.run_collective)
        error = exc
    shape, dtype_label = ((tuple(int(d) for d in x.shape), str(dtype)) if error is None else describe(x))
    sig = Signature("compressed_reduce_scatter", name, shape, dtype_label, op_label(op), codec=codec_obj.spec,
                    counts=None if counts is None else tuple(int(c) for c in np.asarray(counts).reshape(-1)))
    average = sig.op == "avg"
    key = name if name is not None else ("shape", shape)

    def elems_of(rows_: np.ndarray, shape_: tuple[int, ...]) -> list[int]:
        row = int(np.prod(shape_[1:], dtype=np.int64))
        return [int(r) * row for r in rows_]

    flagged = [False]

    def run(flag: int | None = None) -> Any:
        assert rows is not None and dtype is not None and adapter is not None
        start = _perf()
        call = _Call(comm, codec_obj, dry=False, flag=flag)
        block = (int(rows[comm.rank]),) + shape[1:]
        if space is None:
            assert host is not None
            flat = host.reshape(-1) if host.dtype == _F32 else host.astype(_F32).reshape(-1)
            into = _f32_view(out, flat)
            acc = _reduce_scatter_flat(call, flat, elems_of(rows, shape), key, average, _HOST, name, into)
            adapter.release(host)
            if into is not None:
                value = out
            else:
                final = acc.reshape(block) if dtype == _F32 else acc.reshape(block).astype(dtype)
                value = adapter.write(out, final) if out is not None else adapter.wrap(final, x)
        else:
            t = arrays.to_torch(x).detach()
            flat = t.reshape(-1)
            if flat.dtype != space.torch.float32 or not flat.is_contiguous():
                flat = flat.to(space.torch.float32).contiguous()
            acc = _reduce_scatter_flat(call, flat, elems_of(rows, shape), key, average, space, name)
            final = acc.reshape(block).to(t.dtype)
            value = _into(out, final) if out is not None else arrays.from_torch(final, arrays.kind_of(x))
        call.account("compressed_reduce_scatter", name, start, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        flagged[0] = call.flagged
        return value

    def dummy(agreed: Signature, flag: int | None = None) -> bool:
        flat = np.zeros(int(np.prod(agreed.shape, dtype=np.int64)), dtype=_F32)
        agreed_rows = _rows_of(agreed.counts, int(agreed.shape[0]), comm.size, "reduce_scatter")
        call = _Call(comm, codec_obj, dry=True, flag=flag)
        _reduce_scatter_flat(call, flat, elems_of(agreed_rows, tuple(agreed.shape)), None, False, _HOST, name)
        return call.flagged

    return comm.run_collective(sig, error, run, dummy, _flag_in_payload(run, dummy, flagged), flag_in_data=True)


def _allgather_flat(call: _Call, flat: Any, elems: list[int], key: Hashable, sp: _HostSpace,
                    name: str | None, into: Any = None) -> Any:
    """All-gather this rank's flat FP32 vector (``elems[rank]`` elements); return the decoded concatenation.

    ``into``: optional float32 vector for the result; it may hold ``flat`` itself (FSDP gathers in
    place), since ``flat`` is encoded before anything is decoded.
    """
    comm = call.comm
    size, rank = comm.size, comm.rank
    x1 = call.extra
    wire = [int(call.codec.wire_nbytes(c)) for c in elems]
    sizes = [w + x1 for w in wire]  # a payload, then the flag byte of flagged calls
    offs = [int(s) for s in np.concatenate(([0], np.cumsum(sizes)[:-1]))]
    total = sum(sizes)
    mine, h_mine = sp.empty_u8(sizes[rank]), sp.mirror(sizes[rank])
    every, h_every = sp.empty_u8(total), sp.mirror(total)
    call.encode(flat, mine[:wire[rank]], (key, "ag"))
    call.mark(mine, wire[rank])
    sp.ready()
    pipe = _pipe(comm)
    call.wait(pipe, [pipe.iallgatherv(sp.outgoing(mine, h_mine, 0, sizes[rank]),
                                      sp.incoming(every, h_every, 0, total), sizes)], "compressed_allgather", name)
    call.wire_sent += wire[rank]
    sp.arrived(every, h_every, 0, total)
    for r in range(size):
        call.read(every, offs[r] + wire[r])
    result = sp.empty_f32(sum(elems)) if into is None else into
    lo = 0
    for r in range(size):  # own payload decoded too: every rank holds the same values
        call.decode(every[offs[r]:offs[r] + wire[r]], elems[r], result[lo:lo + elems[r]], add=False)
        lo += elems[r]
    return result


def compressed_allgather(comm: Communicator, x: Any, *, codec: Any, counts: Any = None, out: Any = None,
                         name: str | None = None) -> Any:
    """Concatenate every rank's ``x`` along the first dimension with ``codec`` payloads on the wire.

    Every rank decodes every payload, its own included, so all ranks get bit-identical
    results (this rank's own rows come back quantised, like the others').

    Args:
        comm: the communicator.
        x: float array with at least one dimension; the trailing shape is the same on every rank.
        codec: spec string or codec object; a lossless codec runs ``comm.allgather``. Error
            feedback and whole-tensor transforms (GIFT) are refused.
        counts: every rank's number of rows (the same list on every rank): saves the exchange of
            sizes. Default: sizes are exchanged and may differ.
        out: optional array for the result (total rows, x's trailing shape and dtype); needs ``counts``.
        name: stable tensor name; labels statistics.

    Returns:
        The concatenation, same kind, dtype and device as ``x``.

    Example:
        >>> full = cw.allgather(shard, codec="fp8-e4m3", name="layer1.weight")
    """
    codec_obj = resolve_codec(codec)
    if codec_obj.lossless:
        result = comm.allgather(x, name=name)
        return _into(out, result) if out is not None else result
    error = host = adapter = space = dtype = rows = None
    try:
        check_sharded_codec(codec_obj, "allgather")
        adapter = adapter_for(x)
        space = device_space(comm, codec_obj, x)
        if space is None:
            host = adapter.host(x)
            dtype = host.dtype
        else:
            dtype = arrays.device_ops(x).numpy_dtype(x)
        if dtype.kind != "f" and dtype.name != "bfloat16":
            raise TypeError(f"codec {codec_obj.spec!r} needs a float array, got {dtype}; pass codec=None")
        if len(x.shape) == 0:
            raise ValueError("allgather with a codec needs an array with at least one dimension, got a scalar; "
                             "reshape it to (1,)")
        if counts is not None:
            rows = _rows_of(counts, int(x.shape[0]), comm.size, "allgather")
            if int(rows[comm.rank]) != int(x.shape[0]):
                raise ValueError(f"counts={rows.tolist()} gives rank {comm.rank} {int(rows[comm.rank])} rows, but "
                                 f"its x has {int(x.shape[0])}; pass every rank's true row count or counts=None")
            full = (int(rows.sum()),) + tuple(int(d) for d in x.shape[1:])
            if out is not None and (tuple(out.shape) != full or arrays.dtype_name(out.dtype) != str(dtype)):
                raise ValueError(f"out= has shape {tuple(out.shape)} and dtype {arrays.dtype_name(out.dtype)}; the "
                                 f"gathered array has shape {full} and dtype {dtype}")
        elif out is not None:
            raise ValueError("out= needs counts= (every rank's rows) so that its shape can be checked before the "
                             "gather; pass counts=[...] or out=None")
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        error = exc
    trailing, dtype_label = ((tuple(int(d) for d in x.shape[1:]), str(dtype)) if error is None
                             else describe(x))
    sig = Signature("compressed_allgather", name, trailing, dtype_label, codec=codec_obj.spec,
                    counts=None if counts is None else tuple(int(c) for c in np.asarray(counts).reshape(-1)))
    key = name if name is not None else ("shape", trailing)

    def sizes(my_rows: int) -> np.ndarray:
        if counts is not None:
            return _rows_of(counts, my_rows, comm.size, "allgather")
        found = np.empty(comm.size, dtype=np.int64)
        with comm.watched("compressed_allgather sizes", name):
            comm.transport.allgather(np.array([my_rows], dtype=np.int64), found)
        return found

    def elems_of(rows_: np.ndarray, trailing_: tuple[int, ...]) -> list[int]:
        row = int(np.prod(trailing_, dtype=np.int64))
        return [int(r) * row for r in rows_]

    flagged = [False]

    def run(flag: int | None = None) -> Any:
        assert dtype is not None and adapter is not None
        start = _perf()
        call = _Call(comm, codec_obj, dry=False, flag=flag)
        all_rows = sizes(int(x.shape[0]))
        full = (int(all_rows.sum()),) + trailing
        if space is None:
            assert host is not None
            flat = host.reshape(-1) if host.dtype == _F32 else host.astype(_F32).reshape(-1)
            into = _f32_view(out, None)
            result = _allgather_flat(call, flat, elems_of(all_rows, trailing), key, _HOST, name, into)
            adapter.release(host)
            if into is not None:
                value = out
            else:
                final = result.reshape(full) if dtype == _F32 else result.reshape(full).astype(dtype)
                value = adapter.write(out, final) if out is not None else adapter.wrap(final, x)
        else:
            t = arrays.to_torch(x).detach()
            flat = t.reshape(-1)
            if flat.dtype != space.torch.float32 or not flat.is_contiguous():
                flat = flat.to(space.torch.float32).contiguous()
            result = _allgather_flat(call, flat, elems_of(all_rows, trailing), key, space, name)
            final = result.reshape(full).to(t.dtype)
            value = _into(out, final) if out is not None else arrays.from_torch(final, arrays.kind_of(x))
        call.account("compressed_allgather", name, start, int(x.shape[0] * np.prod(trailing, dtype=np.int64))
                     * dtype.itemsize)
        flagged[0] = call.flagged
        return value

    def dummy(agreed: Signature, flag: int | None = None) -> bool:
        trailing_ = tuple(agreed.shape)
        all_rows = sizes(0) if agreed.counts is None else np.asarray(agreed.counts, dtype=np.int64)
        elems = elems_of(all_rows, trailing_)
        if agreed.counts is not None:
            flat = np.zeros(elems[comm.rank], dtype=_F32)
        else:
            flat = np.zeros(0, dtype=_F32)
        call = _Call(comm, codec_obj, dry=True, flag=flag)
        _allgather_flat(call, flat, elems, None, _HOST, name)
        return call.flagged

    return comm.run_collective(sig, error, run, dummy, _flag_in_payload(run, dummy, flagged), flag_in_data=True)


def _flag_in_payload(run: Any, dummy: Any, flagged: list[bool]) -> Any:
    """Return the ``fused`` step of ``Communicator.run_collective``: the agreement flag rides in the payload.

    A rank whose arguments match the agreed ones moves its data with flag 0; a deviating rank
    moves zeros in the agreed pattern with flag 1. Every rank receives every other rank's flag
    (each message carries its sender's), so all learn together whether anyone deviated, with
    no separate flag exchange.
    """
    def fused(agreed: Any, deviates: bool) -> tuple[Any, bool]:
        if deviates:
            dummy(agreed.sig, 1)
            return None, True
        value = run(0)
        return value, flagged[0]

    return fused


def _f32_view(out: Any, avoid: Any) -> Any:
    """Return a flat float32 numpy view writing into ``out``, or None (no out, another dtype, or memory
    shared with ``avoid``)."""
    if out is None:
        return None
    view = adapter_for(out).out_view(out)
    if view is None or view.dtype != _F32 or (avoid is not None and np.may_share_memory(view, avoid)):
        return None
    return view.reshape(-1)


def _into(out: Any, value: Any) -> Any:
    """Copy ``value`` into the caller's ``out`` (same kind) and return ``out``."""
    if isinstance(out, np.ndarray):
        np.copyto(out, np.asarray(value).reshape(out.shape), casting="no")
    else:
        out.copy_(arrays.to_torch(value).reshape(out.shape))
    return out


def compressed_reduce_scatter_async(comm: Communicator, x: Any, op: str = "sum", *, codec: Any, counts: Any = None,
                                    out: Any = None, name: str | None = None) -> Handle:
    """Start a compressed reduce-scatter on a background lane; ``wait()`` returns this rank's block."""
    return comm.submit(compressed_reduce_scatter, x, op, codec=codec, counts=counts, out=out, name=name)


def compressed_allgather_async(comm: Communicator, x: Any, *, codec: Any, counts: Any = None, out: Any = None,
                               name: str | None = None) -> Handle:
    """Start a compressed all-gather on a background lane; ``wait()`` returns the concatenation."""
    return comm.submit(compressed_allgather, x, codec=codec, counts=counts, out=out, name=name)
