"""Diagnosis under streamalloc, one case per run (argv[1]):

  attribution          tags of forward, backward, optimizer and user scopes;
                       report() sums against memory_allocated(); snapshot tags;
                       sampling; an in-place ReLU after BatchNorm under attribute()
  sampled_attribution  attribute(sample_passes=4) over 9 training steps: module
                       tags and hook calls in each pass
  leak MODEL [history] watch() over a model that keeps (leaky) or drops
                       (steady) each step's activations; with "history", also
                       the call sites of torch's memory history
  steady_workloads     watch() over GPT-2 (bench/workloads), ResNet-50
                       (torchvision) and a Hugging Face GPT-2, where present
  oom                  an out-of-memory error under a memory fraction: torch's
                       wording, the holders, the suggestion, last_oom_report()
  oom_fragmentation    (plain segments) reserved memory in pieces too small
  max_batch MODEL      max_batch_size on mlp, cnn or transformer under a 2 GiB
                       limit, then the batch it returns and the next power of
                       two are run for real
"""

import gc
import math
import os
import re
import sys
import warnings

import torch
from torch import nn

from _common import BENCH_WORKLOADS, emit, select_allocator

MiB = 1 << 20
GiB = 1 << 30
case = sys.argv[1]
select_allocator("streamalloc_plain" if case == "oom_fragmentation" else "streamalloc")
import streamalloc  # noqa: E402  (installed above)

torch.cuda.init()
torch.manual_seed(0)
result = {"case": case}


def total_memory():
    return torch.cuda.get_device_properties(0).total_memory


def cap_memory(limit_bytes):
    """A memory fraction whose cap is `limit_bytes`."""
    torch.cuda.set_per_process_memory_fraction(limit_bytes / total_memory())


def by_tag(data):
    return {e["tag"]: e["bytes"] for e in data["by_tag"]}


def block_tags():
    """address -> tag of every allocated block of streamalloc's snapshot."""
    tags = {}
    for segment in streamalloc.snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                tags[block["address"]] = block.get("tag", "<no key>")
    return tags


class mlp(nn.Module):
    def __init__(self, width=1024, depth=3, classes=10):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                      for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.norm(self.layers(self.embed(x))))


class cnn(nn.Module):
    """Conv, BatchNorm and in-place ReLU, as in ResNets."""

    def __init__(self, classes=10):
        super().__init__()

        def stage(cin, cout, stride):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU(inplace=True))

        self.features = nn.Sequential(stage(3, 32, 1), stage(32, 64, 2), stage(64, 128, 2), stage(128, 128, 1))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(128, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


def small_gpt2():
    sys.path.insert(0, BENCH_WORKLOADS)
    from gpt2_model import gpt2, gpt2_config

    return gpt2(gpt2_config(vocab_size=8192, n_ctx=256, n_embd=256, n_layer=2, n_head=4))


def make_step(kind):
    """(model, step_fn(batch)) of a fresh model and AdamW optimizer."""
    if kind == "mlp":
        model = mlp().cuda()

        def inputs(b):
            return torch.randn(b, 1024, device="cuda"), torch.randint(0, 10, (b,), device="cuda")
    elif kind == "cnn":
        model = cnn().cuda()

        def inputs(b):
            return torch.randn(b, 3, 64, 64, device="cuda"), torch.randint(0, 10, (b,), device="cuda")
    elif kind == "transformer":
        model = small_gpt2().cuda()

        def inputs(b):
            tokens = torch.randint(0, 8192, (b, 257), device="cuda")
            return tokens[:, :-1], tokens[:, 1:]
    else:
        sys.exit(f"unknown model {kind!r}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(b):
        optimizer.zero_grad(set_to_none=True)
        x, y = inputs(b)
        out = model(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        return loss.item()

    return model, optimizer, step


# ---------------------------------------------------------------- attribution


def attribution():
    streamalloc.enable_tagging()
    checks = {}
    model = mlp().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    handle = streamalloc.attribute(model)
    x = torch.randn(64, 1024, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")

    def sums_match(label):
        data = streamalloc.report(print_report=False)
        checks[label] = {"report_sum": sum(by_tag(data).values()), "memory_allocated": torch.cuda.memory_allocated(),
                         "before_tagging": by_tag(data).get("before_tagging", 0)}

    with streamalloc.tag("data"):
        extra = torch.randn(256, 1024, device="cuda")
    out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    sums_match("after_forward")
    after_forward = by_tag(streamalloc.report(print_report=False))
    result["forward_tags"] = sorted(t for t, b in after_forward.items() if b > 0)
    loss.backward()
    sums_match("after_backward")
    # Every gradient under the tag of the module that owns its parameter.
    owners = {}
    for name, p in model.named_parameters():
        owners[p.grad.data_ptr()] = (name.rpartition(".")[0] or "mlp", p.grad.numel() * p.grad.element_size())
    tags = block_tags()
    right = sum(size for ptr, (owner, size) in owners.items() if tags.get(ptr) == owner)
    result["grad_bytes"] = sum(size for _, size in owners.values())
    result["grad_bytes_tagged_with_owner"] = right
    result["grad_tags_sample"] = {owner: tags.get(ptr) for ptr, (owner, _) in list(owners.items())[:6]}
    with streamalloc.tag("optimizer"):
        optimizer.step()
    sums_match("after_optimizer")
    data = streamalloc.report(print_report=True)
    result["optimizer_bytes"] = by_tag(data).get("optimizer", 0)
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    result["data_bytes"] = by_tag(data).get("data", 0)
    result["by_size_sum"] = sum(e["bytes"] for e in data["by_size"])
    result["report_allocated"] = data["allocated_bytes"]
    result["snapshot_has_tags"] = all(t != "<no key>" for t in block_tags().values())
    result["extra_tag"] = block_tags().get(extra.data_ptr())

    # The inherited tag reaches autograd's threads.
    handle.remove()
    optimizer.zero_grad(set_to_none=True)
    out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    with streamalloc.tag("backward"):
        loss.backward()
    tags = block_tags()
    result["inherited_grad_tags"] = sorted({tags.get(p.grad.data_ptr()) for p in model.parameters()})
    optimizer.zero_grad(set_to_none=True)
    sums_match("after_remove")
    out = model(x)
    result["after_remove_output_tag"] = block_tags().get(out.data_ptr())
    del out, loss

    # An in-place ReLU after BatchNorm trains under attribute().
    net = cnn().cuda()
    with streamalloc.attribute(net):
        images = torch.randn(8, 3, 32, 32, device="cuda")
        loss = net(images).sum()
        loss.backward()
        result["cnn_backward_ok"] = True
        tags = block_tags()
        result["cnn_conv_grad_tag"] = tags.get(net.features[0][0].weight.grad.data_ptr())
    del net, images, loss
    gc.collect()
    sums_match("after_cnn")

    # Sampling: an estimate, exact for allocations of 1 MiB and more.
    streamalloc.enable_tagging(sample_every=8)
    kept = [torch.empty(4096, device="cuda") for _ in range(800)]  # 16 KiB each
    data = streamalloc.report(print_report=False)
    result["sampled"] = data["sampled"]
    result["sampled_estimate"] = sum(by_tag(data).values())
    result["sampled_allocated"] = torch.cuda.memory_allocated()
    del kept
    streamalloc.disable_tagging()
    result["disabled_report_tagging"] = streamalloc.report(print_report=False)["tagging"]
    result["checks"] = checks


def sampled_attribution():
    streamalloc.enable_tagging()
    real = streamalloc._extension()

    class counting_extension:
        """streamalloc._C, counting the tag changes of attribute()'s hooks."""

        tag_changes = 0

        def __getattr__(self, name):
            return getattr(real, name)

        def set_thread_tag(self, tag_id):
            self.tag_changes += 1  # also from autograd's thread
            return real.set_thread_tag(tag_id)

    every = 4
    model = mlp().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    module_names = {name for name, _ in model.named_modules() if name} | {"mlp"}
    counting = counting_extension()
    extension = streamalloc._extension
    streamalloc._extension = lambda: counting  # the hooks keep the extension attribute() found
    try:
        handle = streamalloc.attribute(model, sample_passes=every)
    finally:
        streamalloc._extension = extension
    x = torch.randn(64, 1024, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")
    passes = []
    for _ in range(2 * every + 1):
        optimizer.zero_grad(set_to_none=True)
        tag_changes = counting.tag_changes
        before = by_tag(streamalloc.report(print_report=False))
        out = model(x)  # kept: the graph does not keep the head's output
        loss = nn.functional.cross_entropy(out, y)
        after = by_tag(streamalloc.report(print_report=False))
        loss.backward()
        del out, loss
        tags = block_tags()
        grads = {p.grad.data_ptr(): (name.rpartition(".")[0] or "mlp", p.grad.numel() * p.grad.element_size())
                 for name, p in model.named_parameters()}
        with streamalloc.tag("optimizer"):
            optimizer.step()
        data = streamalloc.report(print_report=False)
        passes.append({
            # Growth, not presence: cuBLAS keeps the workspace of its first call under that call's tag.
            "forward_module_tags": sorted(t for t in module_names if after.get(t, 0) > before.get(t, 0)),
            "grad_bytes_tagged_with_owner": sum(size for ptr, (owner, size) in grads.items() if tags.get(ptr) == owner),
            "grad_bytes": sum(size for _, size in grads.values()),
            "grad_tags": sorted({tags.get(ptr) for ptr in grads}),
            "tag_changes": counting.tag_changes - tag_changes,
            "submodule_hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
                                   for m in model.modules() if m is not model),
            "report_sum": sum(by_tag(data).values()),
            "memory_allocated": torch.cuda.memory_allocated(),
            "before_tagging": by_tag(data).get("before_tagging", 0),
        })
    result["every"] = every
    result["passes"] = passes
    result["handle_passes"] = handle.passes
    result["handle_sampled_passes"] = handle.sampled_passes


# ---------------------------------------------------------------- leaks


class leaky_model(nn.Module):
    def __init__(self, leak):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
        self.cache = nn.Linear(512, 512)
        self.head = nn.Linear(512, 10)
        self.leak = leak
        self.kept = []

    def forward(self, x):
        h = self.encoder(x)
        c = self.cache(h)
        if self.leak:
            self.kept.append(c.detach())  # the bug: every step's activations stay alive
        return self.head(h + c)


def leak(kind, history):
    model = leaky_model(kind == "leaky").cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    streamalloc.attribute(model)
    if history:
        torch.cuda.memory._record_memory_history(max_entries=10000)
    steps = 5
    flagged_at = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with streamalloc.watch(steps=steps, call_sites=history) as w:
            for i in range(12):
                optimizer.zero_grad(set_to_none=True)
                x = torch.randn(256, 512, device="cuda")
                loss = model(x).square().mean()
                loss.backward()
                optimizer.step()
                for finding in w.step():
                    flagged_at.setdefault(finding.name, i + 1)
            findings = [f.as_dict() for f in w.findings]
    result["steps"] = steps
    result["flagged_at"] = flagged_at
    result["findings"] = findings
    result["warnings"] = [str(c.message) for c in caught if issubclass(c.category, streamalloc.LeakWarning)]
    result["kept_bytes_per_step"] = 256 * 512 * 4


def watch_steps(step, steps=12):
    with warnings.catch_warnings(record=True):
        with streamalloc.watch(steps=5, warn=False) as w:
            for _ in range(steps):
                step()
                w.step()
            return [f.as_dict() for f in w.findings]


def steady_gpt2():
    sys.path.insert(0, BENCH_WORKLOADS)
    from gpt2_model import gpt2, gpt2_config, training_step

    model = gpt2(gpt2_config(n_layer=4)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    streamalloc.attribute(model)
    tokens = torch.randint(0, model.config.vocab_size, (4, 257), device="cuda")
    return watch_steps(lambda: training_step(model, optimizer, tokens[:, :-1], tokens[:, 1:]))


def steady_resnet50():
    import torchvision

    net = torchvision.models.resnet50(weights=None).cuda()
    sgd = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    streamalloc.attribute(net)
    images = torch.randn(16, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (16,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(net(images), labels)
        loss.backward()
        sgd.step()
        sgd.zero_grad(set_to_none=True)

    return watch_steps(step)


def steady_hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=8192, n_positions=256)).cuda()
    adam = torch.optim.AdamW(hf.parameters(), lr=1e-4)
    streamalloc.attribute(hf)
    ids = torch.randint(0, 8192, (8, 256), device="cuda")

    def step():
        hf(input_ids=ids, labels=ids).loss.backward()
        adam.step()
        adam.zero_grad(set_to_none=True)

    return watch_steps(step)


def steady_workloads():
    found = {}
    for name, run in (("gpt2", steady_gpt2), ("resnet50", steady_resnet50), ("hf_gpt2", steady_hf_gpt2)):
        try:
            found[name] = run()
        except ImportError as error:  # torchvision or transformers missing
            result[f"{name}_skipped"] = str(error)
        gc.collect()
        torch.cuda.empty_cache()
    result["findings"] = found


# ---------------------------------------------------------------- out of memory


FIRST_SENTENCE = re.compile(r"CUDA out of memory\. Tried to allocate [0-9.]+ [KMG]iB\.")


def oom():
    cap_memory(2 * GiB)
    model, optimizer, step = make_step("mlp")
    streamalloc.attribute(model)
    with streamalloc.tag("big_buffer"):
        hoard = torch.empty(int(1.4 * GiB), dtype=torch.uint8, device="cuda")
    try:
        step(65536)
        result["raised"] = False
    except torch.cuda.OutOfMemoryError as error:
        result["raised"] = True
        result["message"] = str(error)
    result["first_sentence"] = bool(FIRST_SENTENCE.search(result.get("message", "")))
    report = streamalloc.last_oom_report()
    result["report"] = report
    result["pid"] = os.getpid()
    del hoard
    # The process goes on: a step that fits still runs.
    result["after_loss"] = step(64)


def oom_fragmentation():
    streamalloc.enable_tagging()
    with streamalloc.tag("holes"):
        big = [torch.empty(100 * MiB, dtype=torch.uint8, device="cuda") for _ in range(10)]
        del big
        # Each 60 MiB request splits a cached 100 MiB block: 40 MiB holes.
        kept = [torch.empty(60 * MiB, dtype=torch.uint8, device="cuda") for _ in range(10)]
    cap_memory(torch.cuda.memory_reserved() + 40 * MiB)
    try:
        torch.empty(80 * MiB, dtype=torch.uint8, device="cuda")
        result["raised"] = False
    except torch.cuda.OutOfMemoryError as error:
        result["raised"] = True
        result["message"] = str(error)
    result["report"] = streamalloc.last_oom_report()
    del kept


# ---------------------------------------------------------------- max batch


def fits(step, batch):
    gc.collect()
    torch.cuda.empty_cache()
    try:
        step(batch)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def max_batch(kind):
    limit = 2 * GiB
    cap_memory(limit)
    _, _, step = make_step(kind)
    low, high = (2, 1 << 16) if kind != "transformer" else (1, 4096)
    found = streamalloc.max_batch_size(step, low, high)
    result["result"] = found.as_dict()
    batch = found.batch
    if batch is None:
        return
    result["fits"] = fits(step, batch)
    next_power = 1 << math.ceil(math.log2(batch + 1))
    result["next_power"] = next_power
    result["next_power_fits"] = fits(step, next_power)
    if result["next_power_fits"]:
        # The measured limit, by bisection (only to judge the answer).
        lo, hi = next_power, 2 * next_power
        while hi <= high and fits(step, hi):
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(step, mid) else (lo, mid)
        result["measured_limit"] = lo


if case == "attribution":
    attribution()
elif case == "sampled_attribution":
    sampled_attribution()
elif case == "leak":
    leak(sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "history")
elif case == "steady_workloads":
    steady_workloads()
elif case == "oom":
    oom()
elif case == "oom_fragmentation":
    oom_fragmentation()
elif case == "max_batch":
    max_batch(sys.argv[2])
else:
    sys.exit(f"unknown case {case!r}")
emit(result)
