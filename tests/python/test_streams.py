"""The streams layer on a GPU: Prefetcher batches arrive bit for bit, staging
memory is never reused before its copy has run, early exits and exceptions
leave no pinned or device memory behind, DataLoader works with pin_memory on
and off, to_device is exact for any size and layout, and PinnedPool tensors
return their memory when they die.

These tests run in this process with torch's own CUDA allocator (the
streams layer does not depend on which allocator torch uses), except
test_prefetcher_under_streamalloc, which installs streamalloc in a
subprocess. Every test is also skipped, with the reason, when the
extension lacks the streams bindings. Without torch only the import test
runs."""

import collections
import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import RESULT_PREFIX, script_env

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20

try:
    import torch
    import torch.utils.data

    _TORCH_ERROR = None
except Exception as error:  # the import test below still runs
    torch = None
    _TORCH_ERROR = f"{type(error).__name__}: {error}"


def _bindings_missing():
    """Why the streams bindings cannot be used here, or None."""
    if torch is None:
        return f"no usable torch: {_TORCH_ERROR}"
    try:
        from streamalloc import streams

        extension = streams._extension()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    if not hasattr(extension, "_PinnedPool"):
        return "streamalloc._C has no streams bindings (bind_streams is not called in module.cpp)"
    return None


_MISSING = _bindings_missing()
needs_bindings = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


def _streams():
    from streamalloc import streams

    return streams


def _settle(pool):
    """Waits for the GPU, then lets the pool take back what finished."""
    torch.cuda.synchronize()
    pool.process_events()


def _sleep_ms(ms):
    torch.cuda._sleep(int(ms * 2_000_000))  # about 2 GHz of GPU clock cycles


def test_module_imports_without_torch():
    # Loaded from its file, so neither the package nor torch is involved.
    code = textwrap.dedent(
        f"""
        import importlib.util, sys
        sys.modules["torch"] = None
        spec = importlib.util.spec_from_file_location("streams", {str(REPO / "python/streamalloc/streams.py")!r})
        streams = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(streams)
        for use in (lambda: streams.PinnedPool(), lambda: streams.to_device(None), lambda: streams.Prefetcher([])):
            try:
                use()
            except ImportError as error:
                assert "need PyTorch" in str(error), error
            else:
                raise AssertionError("no ImportError")
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# --- Prefetcher ------------------------------------------------------------------


Pair = collections.namedtuple("Pair", "left right")


def _batch(i, kind, pool):
    """Batch i (the same values every time it is made), its tensors pageable,
    torch-pinned or PinnedPool memory."""
    gen = torch.Generator().manual_seed(i)
    rows, cols = 1 + (i * 7) % 97, 1 + (i * 13) % 511
    if i % 50 == 0:
        rows = 0
    x = torch.rand(rows, cols, generator=gen)
    labels = torch.randint(-(1 << 40), 1 << 40, (rows,), generator=gen)
    # A column of a wider tensor: a non-contiguous source.
    mask = torch.randint(0, 256, (cols, 3), generator=gen).to(torch.uint8)[:, 1]
    half = torch.randn(cols, generator=gen).to(torch.bfloat16)
    tensors = [x, labels, mask, half]
    if kind == "pinned":
        tensors = [t.pin_memory() for t in tensors]
    elif kind == "pool":
        tensors = [pool.pin(t) for t in tensors]
    x, labels, mask, half = tensors
    return {"x": x, "pair": Pair(labels, [mask, (half, i)]), "id": i, "name": f"batch{i}"}


def _assert_same(device_tensor, expected):
    assert device_tensor.is_cuda
    assert device_tensor.dtype == expected.dtype and device_tensor.shape == expected.shape
    assert torch.equal(device_tensor.cpu(), expected)


@pytest.mark.gpu
@needs_bindings
@pytest.mark.parametrize("depth", [1, 3])
def test_prefetcher_1000_batches_are_bit_exact(depth):
    streams = _streams()
    pool = streams.PinnedPool(capacity=512 * MiB)
    kinds = ("pageable", "pinned", "pool")

    def source():
        for i in range(1000):
            yield _batch(i, kinds[i % 3], pool)

    count = 0
    with streams.Prefetcher(source(), device="cuda", depth=depth, pool=pool) as batches:
        for i, batch in enumerate(batches):
            expected = _batch(i, "pageable", pool)
            assert batch["id"] == i and batch["name"] == f"batch{i}"
            assert isinstance(batch["pair"], Pair) and isinstance(batch["pair"].right, list)
            _assert_same(batch["x"], expected["x"])
            _assert_same(batch["pair"].left, expected["pair"].left)
            _assert_same(batch["pair"].right[0], expected["pair"].right[0])
            half, index = batch["pair"].right[1]
            _assert_same(half, expected["pair"].right[1][0])
            assert index == i
            count += 1
    assert count == 1000


@pytest.mark.gpu
@needs_bindings
def test_prefetcher_passes_device_tensors_and_other_values_through():
    streams = _streams()
    on_device = torch.arange(10, device="cuda")
    batches = list(streams.Prefetcher([(on_device, None, 3.5, "text")], depth=2))
    assert len(batches) == 1
    tensor, none, number, text = batches[0]
    assert tensor is on_device and none is None and number == 3.5 and text == "text"


@pytest.mark.gpu
@needs_bindings
def test_prefetched_batches_do_not_depend_on_the_source_after_the_copy_is_issued():
    streams = _streams()
    pool = streams.PinnedPool(capacity=256 * MiB)
    elements = 1 << 20  # 4 MiB of int32

    def source():
        buffer = torch.empty(elements, dtype=torch.int32)  # pageable, rewritten for every batch
        for i in range(48):
            buffer.fill_(i)
            yield buffer

    prefetcher = streams.Prefetcher(source(), depth=4, pool=pool)
    # Every copy queues behind this: staging blocks stay in flight while the
    # source is rewritten and new batches are staged.
    with torch.cuda.stream(prefetcher.copy_stream):
        _sleep_ms(20)
    for i, batch in enumerate(prefetcher):
        assert bool((batch == i).all()), f"batch {i} holds other data"
    assert i == 47
    _settle(pool)
    assert pool.stats()["active_requests.current"] == 0


def _leak_baseline():
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _assert_released(pool, baseline):
    gc.collect()
    _settle(pool)
    assert torch.cuda.memory_allocated() == baseline
    stats = pool.stats()
    assert stats["active_requests.current"] == 0, stats
    assert stats["pending_blocks"] == 0, stats


def _pageable_batches(count, fail_at=None):
    for i in range(count):
        if i == fail_at:
            raise LookupError(f"source failed at {i}")
        yield {"x": torch.full((512, 1024), float(i)), "y": torch.arange(512) + i}


@pytest.mark.gpu
@needs_bindings
def test_early_break_leaves_no_memory_behind():
    streams = _streams()
    pool = streams.PinnedPool(capacity=1 << 30)
    baseline = _leak_baseline()
    prefetcher = streams.Prefetcher(_pageable_batches(100), depth=3, pool=pool)
    for i, batch in enumerate(prefetcher):
        if i == 4:
            break
    del batch
    assert torch.cuda.memory_allocated() > baseline  # the batches queued ahead
    prefetcher.close()
    _assert_released(pool, baseline)
    with pytest.raises(StopIteration):
        next(prefetcher)


@pytest.mark.gpu
@needs_bindings
def test_context_manager_and_garbage_collection_release_everything():
    streams = _streams()
    pool = streams.PinnedPool(capacity=1 << 30)
    baseline = _leak_baseline()
    with streams.Prefetcher(_pageable_batches(100), depth=2, pool=pool) as prefetcher:
        first = next(prefetcher)
        assert float(first["x"][0, 0]) == 0.0
    del first
    _assert_released(pool, baseline)

    prefetcher = streams.Prefetcher(_pageable_batches(100), depth=2, pool=pool)
    taken = [next(prefetcher), next(prefetcher)]
    del prefetcher, taken
    _assert_released(pool, baseline)


@pytest.mark.gpu
@needs_bindings
def test_an_exception_from_the_source_arrives_after_the_batches_before_it():
    streams = _streams()
    pool = streams.PinnedPool(capacity=1 << 30)
    baseline = _leak_baseline()
    seen = []
    prefetcher = streams.Prefetcher(_pageable_batches(10, fail_at=6), depth=2, pool=pool)
    caught = None
    try:
        for batch in prefetcher:
            seen.append(float(batch["x"][0, 0]))
    except LookupError as error:
        caught = str(error)
    assert caught == "source failed at 6"
    assert seen == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(StopIteration):
        next(prefetcher)
    del batch, prefetcher
    _assert_released(pool, baseline)


class _Squares(torch.utils.data.Dataset if torch is not None else object):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((3, 5), float(i)), i * i


@pytest.mark.gpu
@needs_bindings
@pytest.mark.parametrize("pin_memory,workers", [(False, 0), (True, 0), (False, 2), (True, 2)])
def test_dataloader(pin_memory, workers):
    streams = _streams()
    loader = torch.utils.data.DataLoader(
        _Squares(), batch_size=8, shuffle=False, num_workers=workers, pin_memory=pin_memory
    )
    prefetcher = streams.Prefetcher(loader, device="cuda:0", depth=2)
    assert len(prefetcher) == 8
    seen = 0
    for k, (x, y) in enumerate(prefetcher):
        index = torch.arange(8 * k, 8 * k + 8)
        _assert_same(x, index.float().view(8, 1, 1).expand(8, 3, 5).contiguous())
        _assert_same(y, index * index)
        seen += 8
    assert seen == 64


# --- to_device ---------------------------------------------------------------------


@pytest.mark.gpu
@needs_bindings
@pytest.mark.parametrize("nbytes", [0, 1, 7, 4095, MiB - 1, MiB, MiB + 3, 8 * MiB + 1, 37 * MiB + 13])
def test_to_device_is_exact_for_any_size(nbytes):
    streams = _streams()
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    out = streams.to_device(source, "cuda")
    _assert_same(out, source)


@pytest.mark.gpu
@needs_bindings
@pytest.mark.parametrize("nbytes", [0, 1, 7, 4095, 65537])
def test_staged_copy_path_is_exact_for_small_sizes(nbytes):
    streams = _streams()
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    out = streams._extension()._staged_to_device(source, torch.cuda.current_device(), True)
    _assert_same(out, source)


@pytest.mark.gpu
@needs_bindings
def test_to_device_dtypes_layouts_streams_and_devices():
    streams = _streams()
    odd = torch.randn((1 << 18) + 3, dtype=torch.float64)  # 2 MiB + 24 B
    _assert_same(streams.to_device(odd, torch.device("cuda", 0)), odd)
    transposed = torch.randn(2048, 1024).t()  # non-contiguous: staged into a contiguous copy
    out = streams.to_device(transposed, "cuda:0")
    _assert_same(out, transposed)
    assert out.is_contiguous()
    conjugated = torch.randn(1 << 17, dtype=torch.complex64).conj()  # 1 MiB, a lazy conjugate view
    _assert_same(streams.to_device(conjugated), conjugated.resolve_conj())
    negated = torch.randn(1 << 18, dtype=torch.complex64).conj().imag  # 1 MiB, a lazy negative view
    assert negated.is_neg()
    _assert_same(streams.to_device(negated), negated.resolve_neg())
    blocking = torch.randint(0, 1 << 30, (3 * MiB,), dtype=torch.int32)
    out = streams.to_device(blocking, non_blocking=False)
    reader = torch.cuda.Stream()  # ordered after nothing: it sees the data only if the copy has finished
    with torch.cuda.stream(reader):
        seen = out.clone()
    reader.synchronize()
    _assert_same(seen, blocking)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _sleep_ms(5)
        source = torch.randn(5 * MiB // 4)
        out = streams.to_device(source)  # `side` is current: it waits for the copy
        _assert_same(out, source)
    pinned = torch.randn(MiB).pin_memory()
    _assert_same(streams.to_device(pinned), pinned)
    graded = torch.randn(MiB, requires_grad=True)
    out = streams.to_device(graded)
    assert out.requires_grad and out.grad_fn is not None
    assert streams.to_device(odd, "cpu") is odd


@pytest.mark.gpu
@needs_bindings
def test_to_device_source_may_change_as_soon_as_it_returns():
    streams = _streams()
    device = torch.cuda.current_device()
    copy_stream = torch.cuda.ExternalStream(streams._extension()._staged_copy_stream(device), device=device)
    outs = []
    for i in range(32):
        with torch.cuda.stream(copy_stream):
            _sleep_ms(3)  # the staged DMAs queue behind it, so the ring must wait for them
        source = torch.full((5 * MiB + 3,), i, dtype=torch.uint8)
        outs.append(streams.to_device(source))
        source.fill_(255)
    # No synchronize: the current stream must wait for the delayed copies by itself.
    for i, out in enumerate(outs):
        assert bool((out == i).all()), f"copy {i} holds other data"


# --- PinnedPool ----------------------------------------------------------------------


@pytest.mark.gpu
@needs_bindings
def test_pool_staging_is_not_reused_before_its_copy_has_run():
    streams = _streams()
    pool = streams.PinnedPool(capacity=64 * MiB)
    side = torch.cuda.Stream()
    source = torch.empty(MiB, dtype=torch.int32)  # 4 MiB: 16 blocks fill the capacity
    outs = []
    for i in range(64):
        source.fill_(i)
        with torch.cuda.stream(side):
            _sleep_ms(5)  # the DMA below runs long after the host has moved on
            staged = pool.pin(source)
            outs.append(staged.to("cuda", non_blocking=True))
            pool.record_stream(staged, side)
        del staged
        source.fill_(-1)
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert bool((out == i).all()), f"copy {i} holds other data"
    stats = pool.stats()
    assert stats["capacity_waits"] > 0  # the host outran the GPU and had to wait at capacity
    assert stats["allocated_bytes.peak"] <= 64 * MiB
    _settle(pool)
    assert pool.stats()["active_requests.current"] == 0


@pytest.mark.gpu
@needs_bindings
def test_pool_tensor_lifetime():
    streams = _streams()
    pool = streams.PinnedPool(capacity=64 * MiB)
    tensor = pool.empty((1024, 1024), torch.float32)
    assert tensor.is_pinned() and tensor.is_contiguous()
    assert tensor.shape == (1024, 1024) and tensor.dtype == torch.float32
    stats = pool.stats()
    assert stats["active_requests.current"] == 1 and stats["active_bytes.current"] == 4 * MiB
    tensor.fill_(3.0)
    on_device = tensor.to("cuda", non_blocking=True)
    address = tensor.data_ptr()
    view = tensor[10:20]
    del tensor
    assert pool.stats()["active_requests.current"] == 1  # the view keeps the storage
    del view
    # Dead now, but an event on the current stream, behind the copy, holds the block.
    stats = pool.stats()
    assert stats["pending_blocks"] == 1 and stats["active_requests.current"] == 1
    _settle(pool)
    assert pool.stats()["active_requests.current"] == 0
    _assert_same(on_device, torch.full((1024, 1024), 3.0))
    again = pool.empty((MiB,), torch.float32)
    assert again.data_ptr() == address  # served from the cache
    assert pool.stats()["hits"] >= 1
    del again
    _settle(pool)
    assert pool.trim() == 4 * MiB
    assert pool.stats()["allocations.current"] == 0


@pytest.mark.gpu
@needs_bindings
def test_pool_outlives_its_python_object_while_tensors_live():
    streams = _streams()
    pool = streams.PinnedPool(capacity=64 * MiB)
    tensor = pool.empty(1000, torch.int64)
    del pool
    gc.collect()
    tensor.fill_(2)
    assert int(tensor.sum()) == 2000
    del tensor


@pytest.mark.gpu
@needs_bindings
def test_pool_pin_empty_and_errors():
    streams = _streams()
    pool = streams.PinnedPool(capacity=16 * MiB)
    source = torch.randn(300, 200).t()
    pinned = pool.pin(source)
    assert pinned.is_pinned() and pinned.is_contiguous() and torch.equal(pinned, source)
    assert pool.empty((0, 5)).shape == (0, 5)
    assert pool.empty(4).dtype == torch.get_default_dtype()
    with pytest.raises(MemoryError, match="exceeds the pool's capacity"):
        pool.empty(32 * MiB, torch.uint8)
    with pytest.raises(ValueError, match="does not come from a streamalloc PinnedPool"):
        pool.record_stream(torch.empty(4), torch.cuda.current_stream())
    with pytest.raises(ValueError):
        streams.PinnedPool(capacity=0)
    with pytest.raises(ValueError, match="pin_method"):
        streams.PinnedPool(pin_method="mmap")


@pytest.mark.gpu
@needs_bindings
@pytest.mark.parametrize("method", ["register", "host_alloc"])
def test_pool_pin_methods_give_pinned_memory(method):
    streams = _streams()
    pool = streams.PinnedPool(pin_method=method)
    tensor = pool.empty(8 * MiB, torch.uint8)
    assert tensor.is_pinned()
    tensor.fill_(9)
    _assert_same(tensor.to("cuda", non_blocking=True), torch.full((8 * MiB,), 9, dtype=torch.uint8))
    assert pool.stats()["num_host_alloc"] == 1


@pytest.mark.gpu
@needs_bindings
def test_default_pool_is_shared_and_stats_use_torch_names():
    streams = _streams()
    a, b = streams.PinnedPool(), streams.PinnedPool()
    before = b.stats()["active_requests.current"]
    tensor = a.empty(1000)
    assert b.stats()["active_requests.current"] == before + 1
    del tensor
    stats = a.stats()
    names = ["allocations", "allocated_bytes", "active_requests", "active_bytes"]
    documented = {f"{n}.{m}" for n in names for m in ("current", "peak", "allocated", "freed")}
    documented |= {"num_host_alloc", "num_host_free"}
    documented |= {f"host_{w}_time.{m}" for w in ("alloc", "free") for m in ("total", "max", "min", "count", "avg")}
    assert documented <= set(stats)
    assert {"cached_bytes", "hit_rate", "hits", "misses", "pending_blocks"} <= set(stats)
    torch_keys = {k for k in torch.cuda.host_memory_stats() if not k.startswith("bucket")}
    assert torch_keys <= set(stats), torch_keys - set(stats)


# --- under streamalloc's allocator -------------------------------------------------------

_UNDER_STREAMALLOC = """
import json, torch, streamalloc
streamalloc.install()
from streamalloc import streams
pool = streams.PinnedPool(capacity=1 << 30)
def source():
    for i in range(200):
        yield torch.full((256, 1024), float(i)), torch.arange(i % 7 + 1)
ok = 0
for i, (x, y) in enumerate(streams.Prefetcher(source(), depth=3, pool=pool)):
    ok += bool((x == i).all()) and torch.equal(y.cpu(), torch.arange(i % 7 + 1))
del x, y
torch.cuda.synchronize()
pool.process_events()
print({prefix!r} + json.dumps({{"ok": ok, "allocated": streamalloc.stats()["allocated_bytes.all.current"],
      "installed": streamalloc.is_installed(), "pinned_active": pool.stats()["active_requests.current"]}}))
"""


@pytest.mark.gpu
@needs_bindings
def test_prefetcher_under_streamalloc(tmp_path):
    script = tmp_path / "under_streamalloc.py"
    script.write_text(_UNDER_STREAMALLOC.format(prefix=RESULT_PREFIX))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=script_env(),
                         timeout=300, cwd=str(tmp_path))
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert out.returncode == 0 and lines, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    assert result["ok"] == 200
    assert result["allocated"] == 0
    assert result["pinned_active"] == 0
    assert result["installed"]
