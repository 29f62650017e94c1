"""Gradients across data-parallel replicas: summed in buckets, optionally sharded.

- :mod:`~potluck.runtime.grads.data_parallel`: the gradient sum
  (:class:`~potluck.runtime.grads.data_parallel.GradSync`);
- :mod:`~potluck.runtime.grads.buckets`: which parameters cross the wire together;
- :mod:`~potluck.runtime.grads.grad_ready`: when a bucket's gradients are final,
  so its reduction overlaps the backward pass;
- :mod:`~potluck.runtime.grads.zero`: ZeRO-1, optimizer states on one replica each
  (shares proportional to device memory);
- :mod:`~potluck.runtime.grads.zero2`: ZeRO-2, gradients reduce-scattered after every
  micro-batch;
- :mod:`~potluck.runtime.grads.zero3`: ZeRO-3, parameters sharded by torch's FSDP2;
- :mod:`~potluck.runtime.grads.offload`: optimizer states and step in host memory.
"""
