"""Stream scheduling for input pipelines: keep the GPU busy while data crosses PCIe.

- ``PinnedPool``: a caching pool of page-locked host memory whose blocks are
  handed out as torch tensors and come back when the tensors die.
- ``Prefetcher``: wraps an iterable of batches and yields them already on the
  device, copied on a side stream ``depth`` batches ahead.
- ``to_device``: copies a pageable CPU tensor through pinned staging buffers,
  several times faster than a direct copy from pageable memory.

This module imports without torch; using it without torch (or without the
compiled extension) raises an ImportError that says what is missing.
"""

import collections
import collections.abc
import copy

__all__ = ["PinnedPool", "Prefetcher", "to_device"]

# Below this a pageable tensor goes through tensor.to(): staging costs a few
# thread wake-ups, which only pay off for larger copies.
_STAGED_MIN_BYTES = 1 << 20


def _torch():
    try:
        import torch
    except Exception as error:  # a broken torch install raises OSError too
        raise ImportError(
            f"streamalloc's PinnedPool, Prefetcher and to_device need PyTorch, and `import torch` failed: {error}"
        ) from error
    return torch


def _extension():
    _torch()  # the extension links against torch's libraries, which torch loads
    try:
        from . import _C
    except ImportError as error:
        raise ImportError(
            "streamalloc's compiled extension streamalloc._C is missing: this copy of the package was not "
            f"built. Install it from the source tree with `pip install .` ({error})"
        ) from error
    return _C


def _cuda_device(device):
    torch = _torch()
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class PinnedPool:
    """A caching allocator of page-locked (pinned) host memory.

    ``PinnedPool()`` is a handle on the process-wide pool that ``to_device``
    and ``Prefetcher`` stage through; ``PinnedPool(capacity=n)`` makes a
    separate pool that never holds more than ``n`` pinned bytes (a request
    beyond it first waits for copies in flight, then raises MemoryError).
    ``pin_method`` chooses how new memory is pinned: ``"register"`` (touch
    pages in parallel, then cudaHostRegister), ``"host_alloc"``
    (cudaHostAlloc) or ``"auto"`` (register from 16 MiB up); it also makes a
    separate pool.

    A tensor from ``empty`` or ``pin`` gives its memory back when it dies,
    but the memory is reused only after the work enqueued by then on the
    stream current at its death, and on every stream named with
    ``record_stream``, has finished. A non-blocking copy issued on another
    stream must be named: ``pool.record_stream(tensor, stream)``.
    """

    def __init__(self, capacity=None, *, pin_method="auto"):
        _C = _extension()
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be a positive number of bytes or None, got {capacity}")
        if capacity is None and pin_method == "auto":
            self._pool = _C._default_pinned_pool()
        else:
            self._pool = _C._PinnedPool(capacity or 0, pin_method)
        self.capacity = capacity

    def empty(self, shape, dtype=None):
        """An uninitialized contiguous pinned CPU tensor backed by pool memory."""
        torch = _torch()
        if isinstance(shape, int):
            shape = (shape,)
        return self._pool.empty(list(shape), dtype if dtype is not None else torch.get_default_dtype())

    def pin(self, tensor):
        """A pinned copy of the CPU tensor ``tensor`` in pool memory (contiguous)."""
        return self._pool.pin(tensor)

    def record_stream(self, tensor, stream):
        """Makes the memory of ``tensor`` (from a PinnedPool) wait, after the
        tensor dies, for the work enqueued on ``stream`` by then."""
        if not _extension()._record_pinned_stream(tensor, stream):
            raise ValueError("record_stream: the tensor's memory does not come from a streamalloc PinnedPool")

    def stats(self):
        """Counters named like ``torch.cuda.host_memory_stats()`` (``allocations.current``,
        ``active_bytes.peak``, ``num_host_alloc``, ``host_alloc_time.avg``, ...) plus
        ``cached_bytes``, ``hits``, ``misses``, ``hit_rate`` and ``pending_blocks``."""
        return self._pool.stats()

    def trim(self, keep_bytes=0):
        """Returns idle pinned memory to the system, largest slabs first, until at most
        ``keep_bytes`` stay cached; returns the number of bytes released."""
        return self._pool.trim(keep_bytes)

    def empty_cache(self):
        """Returns all idle pinned memory to the system."""
        self._pool.trim(0)

    def process_events(self):
        """Makes memory whose copies have finished reusable now; returns how many blocks."""
        return self._pool.process_events()

    def reset_peak_stats(self):
        self._pool.reset_peak_stats()

    def reset_accumulated_stats(self):
        self._pool.reset_accumulated_stats()

    def __repr__(self):
        stats = self._pool.stats()
        return (
            f"PinnedPool(capacity={self.capacity}, pinned={stats['allocated_bytes.current']}, "
            f"in_use={stats['active_bytes.current']}, cached={stats['cached_bytes']})"
        )


def to_device(tensor, device="cuda", non_blocking=True):
    """Copies ``tensor`` to ``device``.

    A pageable CPU tensor of 1 MiB or more bound for a CUDA device goes
    through a ring of pinned staging buffers: host threads copy one chunk
    while the DMA of the previous one runs. The call returns once the source
    may be modified. The DMAs run on a copy stream of their own, so they do
    not wait for the work queued on the current stream; the current stream
    waits for them, so work enqueued there afterwards sees the data
    (``non_blocking=False`` also waits for the copy). The result is
    contiguous and recorded on the current stream. Everything else (pinned
    or small tensors, tensors that require grad, other devices) is
    ``tensor.to(device, non_blocking=non_blocking)``.
    """
    torch = _torch()
    target = torch.device(device)
    if (
        target.type != "cuda"
        or tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or tensor.requires_grad
        or tensor.nbytes < _STAGED_MIN_BYTES
        or tensor.is_pinned()
    ):
        return tensor.to(target, non_blocking=non_blocking)
    target = _cuda_device(target)
    return _extension()._staged_to_device(tensor, target.index, non_blocking)


class Prefetcher:
    """Iterates over ``iterable`` and yields its batches already on ``device``.

    Batches may be tensors or tuples, lists, named tuples and dicts of them,
    nested; other values pass through unchanged. The host-to-device copies of
    the next ``depth`` batches run on a dedicated copy stream while the
    caller computes. Each yielded batch is ready for the stream current when
    it is taken: that stream waits on the batch's copy event, and its tensors
    are recorded on that stream so the allocator cannot reuse them early.
    Pinned sources (DataLoader(pin_memory=True)) are copied directly; pageable
    ones are first copied into ``pool`` (default: the process-wide
    PinnedPool). Exceptions raised by the iterable surface after the batches
    before them. Breaking out early is safe; ``close()`` (also called by the
    context manager and on garbage collection) releases queued batches.

        with Prefetcher(loader, device="cuda", depth=2) as batches:
            for inputs, targets in batches:
                loss = loss_fn(model(inputs), targets)
    """

    def __init__(self, iterable, device="cuda", depth=2, *, pool=None):
        torch = _torch()
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.device = _cuda_device(device)
        self.depth = depth
        self._pool = pool if pool is not None else PinnedPool()
        try:
            self._length = len(iterable)
        except TypeError:  # no len(), or an IterableDataset's loader
            self._length = None
        self._source = iter(iterable)
        self.copy_stream = torch.cuda.Stream(device=self.device)
        self._ready = collections.deque()  # (batch on device, copy event, device tensors)
        self._error = None
        self._exhausted = False
        self._closed = False
        self._issued = 0

    def __iter__(self):
        return self

    def __len__(self):
        if self._length is None:
            raise TypeError("the wrapped iterable has no len()")
        return self._length

    def __next__(self):
        torch = _torch()
        if self._closed:
            raise StopIteration
        if not self._ready:
            self._fill()
        if not self._ready:
            error = self._error
            self.close()
            if error is not None:
                raise error
            raise StopIteration
        batch, event, tensors = self._ready.popleft()
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for tensor in tensors:
            tensor.record_stream(consumer)
        self._fill()
        return batch

    def close(self):
        """Stops prefetching and drops every queued batch. Their device memory
        was allocated on the copy stream, so the allocator reuses it only in
        that stream's order; pinned staging memory waits for its copy events."""
        if self._closed:
            return
        self._closed = True
        self._ready.clear()
        self._source = None
        self._error = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown may have torn torch down
            pass

    def _fill(self):
        while len(self._ready) < self.depth and not self._exhausted and self._error is None:
            try:
                batch = next(self._source)
            except StopIteration:
                self._exhausted = True
                return
            except Exception as error:  # surfaces after the batches already queued
                self._error = error
                return
            try:
                self._issue(batch)
            except Exception as error:
                self._error = error
                return

    def _issue(self, batch):
        torch = _torch()
        tensors = []
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            torch.cuda.nvtx.range_push(f"streamalloc.prefetch batch {self._issued}")
            try:
                moved = self._move(batch, tensors)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            finally:
                torch.cuda.nvtx.range_pop()
        self._issued += 1
        self._ready.append((moved, event, tensors))

    def _move(self, obj, tensors):
        torch = _torch()
        if isinstance(obj, torch.Tensor):
            return self._move_tensor(obj, tensors)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(self._move(item, tensors) for item in obj))
        if isinstance(obj, tuple):
            return tuple(self._move(item, tensors) for item in obj)
        if isinstance(obj, list):
            return [self._move(item, tensors) for item in obj]
        if isinstance(obj, dict):
            moved = copy.copy(obj)
            for key, value in obj.items():
                moved[key] = self._move(value, tensors)
            return moved
        if isinstance(obj, collections.abc.Mapping):
            return {key: self._move(value, tensors) for key, value in obj.items()}
        return obj

    def _move_tensor(self, tensor, tensors):
        if tensor.device == self.device:
            return tensor
        if tensor.device.type == "cpu" and not tensor.is_pinned():
            # The host copy happens now, so the source may change as soon as
            # the iterable resumes; the staging block waits for the DMA.
            staged = self._pool.pin(tensor)
            moved = staged.to(self.device, non_blocking=True)
            self._pool.record_stream(staged, self.copy_stream)
        else:
            moved = tensor.to(self.device, non_blocking=True)
            # A pinned source from a PinnedPool learns about the copy stream;
            # torch's own pinned memory learns it inside tensor.to().
            if tensor.device.type == "cpu":
                _extension()._record_pinned_stream(tensor, self.copy_stream)
        tensors.append(moved)
        return moved
