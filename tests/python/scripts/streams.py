"""record_stream under streamalloc: a tensor used by a long kernel on a side
stream is freed on the main stream while that kernel still runs. Its
memory must not be handed out again until the side stream is done, which
the script checks by address, by the block's snapshot state and by data:
the side stream writes the tensor after sleeping, then reads it back."""

import torch

import streamalloc
from _common import block_states, emit

streamalloc.install()

ELEMENTS = 1 << 22  # 16 MiB of float32
SLEEP_CYCLES = 1_000_000_000  # about half a second at H200 clocks

main = torch.cuda.current_stream()
side = torch.cuda.Stream()


def side_work(tensor, cycles):
    """On the side stream: sleep, then write the tensor and read it back."""
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        tensor.mul_(2)
        return tensor.sum()


# cudaMalloc can wait for the device, which would end the sleep before the
# checks below. A rehearsal fills the caches with every block the real run
# needs: the reduction's scratch and result on the side stream, and on the
# main stream x's block and a spare one a little larger. A correct allocator
# then serves y from the spare block while x's waits for the side stream;
# one that ignored record_stream would pick x's exact fit.
rehearsal = torch.ones(ELEMENTS, device="cuda")
side_work(rehearsal, 1)
spare = torch.empty(ELEMENTS + (1 << 19), device="cuda")
torch.cuda.synchronize()
del rehearsal, spare

x = torch.ones(ELEMENTS, device="cuda")
total = side_work(x, SLEEP_CYCLES)
x.record_stream(side)
address = x.data_ptr()
del x

state_while_pending = block_states(streamalloc.snapshot()).get(address)
# Work the main stream queues now would corrupt the side stream's result if
# it landed in x's memory.
y = torch.empty(ELEMENTS, device="cuda")
y.fill_(7.0)
side_busy = not side.query()

side.synchronize()
total_value = total.item()

emit(
    {
        "address": address,
        "next_address": y.data_ptr(),
        "side_busy_when_reallocated": side_busy,
        "state_while_pending": state_while_pending,
        "total": total_value,
        "expected_total": 2.0 * ELEMENTS,
        "y_intact": bool((y == 7.0).all().item()),
    }
)
