"""The saved-tensor hooks that move what a layer saves for its backward to host memory and back.

torch's ``torch.autograd.graph.save_on_cpu`` copies each tensor synchronously: the forward waits for every copy. Here
the copy out runs on a side stream, after the compute stream's work that made the tensor, into page-locked host
memory; the device tensor's memory is released to the caching allocator once that copy is done
(``record_stream``), and the forward goes on meanwhile. In the backward each tensor is copied back on the
compute stream, after its copy out. (TRL's and torchtune's offloaders show the technique; this one is the same
idea without their prefetching of the next layer's tensors.) On a CPU the host is the device: the tensor is
copied, which exercises the path and saves nothing.
"""
from __future__ import annotations

import torch

MIN_BYTES = 1024  # smaller tensors stay where they are: the copy costs more than they hold


class HostOffload:
    """``pack`` / ``unpack`` for ``torch.autograd.graph.saved_tensors_hooks``. Tensors whose storage is one of
    ``keep`` (the layer's weights, gathered or not: the backward needs them where they are, and they are not
    activations) and tensors under ``MIN_BYTES`` are left alone."""

    def __init__(self):
        self.keep: set[int] = set()
        self._streams: dict = {}
        self.moved_bytes = 0  # what was sent to the host so far (the tests read it)

    def _stream(self, device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < MIN_BYTES or tensor.untyped_storage().data_ptr() in self.keep or tensor.is_sparse:
            return tensor
        self.moved_bytes += nbytes
        if tensor.device.type != "cuda":
            return ("host", tensor.device, tensor.detach().clone())
        stream = self._stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            done = stream.record_event()
        tensor.record_stream(stream)  # its memory is reused only after the copy out
        return ("host", tensor.device, host, done)

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        if len(packed) == 3:  # a CPU run: the copy itself
            return packed[2]
        _, device, host, done = packed
        torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=True)


def parameter_storages(module: torch.nn.Module) -> set[int]:
    """The storages of ``module``'s parameters as they are now (FSDP2's gathered ones inside the forward; a
    tensor-parallel weight's local shard)."""
    out = set()
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.device.type != "meta":
            out.add(local.untyped_storage().data_ptr())
    return out
