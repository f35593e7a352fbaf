"""Shared pieces of the replay kernels: sentinels, the prefetch intrinsic, and the record layout's notes."""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


NIL = -1
INF_USE = np.int32(2**31 - 1)  # next use of a block never referenced again (int32 sentinel)


# the intrinsic's mangled name: typed pointers up to LLVM 14, opaque ones after
_PREFETCH_NAME = "llvm.prefetch.p0" if llvm_binding.llvm_version_info >= (15,) else "llvm.prefetch.p0i8"


@intrinsic
def _prefetch(typingctx, arr, idx):  # pragma: no cover - compiled
    """A hint that ``arr[idx]`` will be read soon (LLVM's prefetch; never faults)."""
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_NAME)
        i32 = ir.IntType(32)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, high locality, data
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


PREFETCH_AHEAD = 16  # block references ahead whose record is prefetched
QUEUE_AHEAD = 4  # queue entries ahead of the oldest whose record is prefetched


# ----------------------------------------------------------------------------- layout

# What made these fast (each measured A/B in one process, docs/benchmarks.md):
# prefetching — the trace says which block comes 16 references ahead, and a
# queue read in order says which records its oldest end reaches next, so their
# cache misses overlap the current one (1.1-1.9x everywhere); list code written
# inline (an array argument to a helper costs reference-count traffic per call:
# 5x on LRU); a block's fields interleaved in one record so a block costs one
# cache line, 16 bytes where they fit; and a queue that only loses its oldest
# entry kept as an array read in order (FIFO, SIEVE, S3-FIFO) instead of a
# linked list. ARC's list code is written out at each use on purpose: the same
# kernel through two inline helpers (unlink, append) measured 0.84x (A/B), while
# the small ring helpers below cost nothing measurable.
