"""The parts of ``benchmarks/gpu_check.py`` (its entry point), one module each: what they
share (:mod:`.common`), the memory contract (f, :mod:`.memory_contract`), swap and
offload numerics (g, h, :mod:`.numerics`) and the same under CUDA's sanitizer (i,
:mod:`.sanitizer`), the MFU of Llama-7B-wide blocks (j, :mod:`.mfu`) and the multi-GPU
cases run two at a time on disjoint GPUs (:mod:`.multi`)."""
