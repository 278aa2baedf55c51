"""Inductor's on-disk cache of compiled graphs, keyed on the CPU's vector instruction set.

torch (2.13 at least) keys a cached graph on the thread count its C++ kernels were written
for, but not on the vector ISA they were written for (AVX2, AVX-512 or none, which
``ATEN_CPU_CAPABILITY`` and ``TORCHINDUCTOR_VEC_ISA_OK`` choose), while the kernels are rebuilt
for the ISA of the process that loads them. A graph written under ``ATEN_CPU_CAPABILITY=avx2``
(8-float vectors) and loaded by an AVX-512 process (16-float vectors) stores 16 floats where
it steps by 8: a heap overrun, seen as "double free or corruption" in a compiled run on two
gloo ranks whose cache an earlier AVX2 run had filled. Setting ``cpp.simdlen`` to the width
of the ISA inductor picks (which picks the same ISA) puts the ISA in the cache key.
"""

from __future__ import annotations


def key_compile_cache_on_vector_isa() -> None:
    """Make inductor's cache key name this process's CPU vector ISA (idempotent; a width the
    user set is kept). Call before compiling."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if config.cpp.simdlen is None:
        config.cpp.simdlen = pick_vec_isa().bit_width()
