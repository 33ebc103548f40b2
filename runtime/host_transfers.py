"""What a step moves between host and device without making the host wait for the device.

Reading a CUDA tensor (`.item()`) copies it on the current stream, so the host waits for every kernel
queued before the read, the next step's included. A training loop that reads each step's loss so
waits for the device once a step, and the device idles while the host then prepares and launches the
next step. Hand-written loops read the loss at their log steps only (nanoGPT, TorchTitan). autopar's
loop reads every step's loss, one step late: the value is copied to pinned host memory right after
it is made, behind an event, so reading it waits for that event alone while the next step runs.
The batch goes the other way through pinned memory: a copy from pageable memory synchronizes the
stream, so the host would wait there for the step before instead.
"""

from __future__ import annotations

import torch


class QueuedScalar:
    """One scalar on its way to the host: `value()` waits for the work before it, no later work."""

    def __init__(self, tensor: torch.Tensor, divisor: float = 1.0) -> None:
        self.divisor = divisor
        self._value: float | None = None
        tensor = tensor.detach().reshape(())
        if tensor.device.type == "cuda":
            self._host = torch.empty((), dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensor.device))  # the stream the copy went on
        else:  # on the host (or a device torch has no events for): read now, as `.item()` did
            self._value = float(tensor.item()) / divisor

    def value(self) -> float:
        if self._value is None:
            self._event.synchronize()
            self._value = float(self._host.item()) / self.divisor
        return self._value

    def __float__(self) -> float:
        return self.value()


def batch_to_device(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on `device`; from the host to a GPU through a pinned copy of its own, without blocking:
    the caching host allocator reuses that block only once the copy is done, and a caller's own pinned
    buffer (`pin_memory()` would return it as it is) stays free to refill at once."""
    if device.type != "cuda" or rows.device.type != "cpu":
        return rows.to(device)
    staged = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    staged.copy_(rows)
    return staged.to(device, non_blocking=True)
