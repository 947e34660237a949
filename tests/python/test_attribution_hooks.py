"""streamalloc.attribute()'s hooks on the CPU, with torch but without a
GPU or the compiled extension: a stand-in for streamalloc._C keeps the
thread tags, and a dispatch mode notes the tag in force when each aten
operation of the forward and the backward pass runs. The GPU tests
(test_diagnosis.py) check the same through real allocations."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import streamalloc  # noqa: E402
from streamalloc import diagnosis  # noqa: E402


class fake_extension:
    """The tag functions of streamalloc._C, in Python."""

    def __init__(self):
        self.names = ["untagged"]
        self.local = threading.local()
        self.inherited = 0
        self.options = None
        self.set_calls = 0

    def tagging_options(self):
        return self.options

    def enable_tagging(self, sample_every, always_record_bytes):
        self.options = {"sample_every": sample_every, "always_record_bytes": always_record_bytes}

    def intern_tag(self, name):
        if name not in self.names:
            self.names.append(name)
        return self.names.index(name)

    def thread_tag(self):
        return getattr(self.local, "tag", 0)

    def set_thread_tag(self, tag_id):
        self.set_calls += 1
        previous = self.thread_tag()
        self.local.tag = tag_id
        return previous

    def set_inherited_tag(self, tag_id):
        previous, self.inherited = self.inherited, tag_id
        return previous

    def restore_inherited_tag(self, expected, previous):
        if self.inherited == expected:
            self.inherited = previous

    def current(self):
        return self.names[self.thread_tag() or self.inherited]


class tag_log(TorchDispatchMode):
    """(operation, tag) for every aten operation run under it."""

    def __init__(self, extension):
        super().__init__()
        self.extension = extension
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func.overloadpacket.__name__, self.extension.current()))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def extension(monkeypatch):
    fake = fake_extension()
    monkeypatch.setattr(streamalloc, "_extension", lambda: fake)
    monkeypatch.setattr(diagnosis, "_interned", {})
    return fake


class mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.norm(h + self.layers(h)))


def _tags_of(ops, name):
    return {tag for op, tag in ops if op == name}


def test_forward_and_backward_operations_run_under_their_module(extension):
    torch.manual_seed(0)
    model = mlp()
    handle = streamalloc.attribute(model)
    assert extension.options is not None  # attribute() turned tagging on
    x = torch.randn(5, 8)
    with tag_log(extension) as forward:
        out = model(x)
    loss = nn.functional.cross_entropy(out, torch.tensor([0, 1, 2, 3, 0]))
    with tag_log(extension) as backward:
        loss.backward()

    # Forward: each module's operations under its qualified name; the
    # residual add under the model itself.
    assert _tags_of(forward.ops, "addmm") == {"embed", "layers.0", "layers.2", "head"}
    assert _tags_of(forward.ops, "gelu") == {"layers.1"}
    assert _tags_of(forward.ops, "native_layer_norm") == {"norm"}
    assert _tags_of(forward.ops, "add") == {"mlp"}
    assert extension.thread_tag() == 0

    # Backward: the weight gradients (mm) under the owning Linear, the
    # loss's own backward under no module.
    mm_tags = _tags_of(backward.ops, "mm")
    assert {"embed", "layers.0", "layers.2", "head"} <= mm_tags
    assert mm_tags <= {"embed", "layers.0", "layers.2", "head"}
    assert _tags_of(backward.ops, "gelu_backward") == {"layers.1"}
    assert _tags_of(backward.ops, "native_layer_norm_backward") == {"norm"}
    assert _tags_of(backward.ops, "nll_loss_backward") == {"untagged"}
    assert extension.thread_tag() == 0  # nothing left over for the next backward pass

    # A second pass: the loss's backward is not charged to the module the
    # first pass ended in.
    model.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 3, 0]))
    with tag_log(extension) as second:
        loss.backward()
    assert _tags_of(second.ops, "nll_loss_backward") == {"untagged"}
    assert _tags_of(second.ops, "mm") == mm_tags

    handle.remove()
    with tag_log(extension) as after:
        model(x)
    assert {tag for _, tag in after.ops} == {"untagged"}


def test_tag_scopes_nest_and_inherit(extension):
    with streamalloc.tag("outer"):
        assert extension.current() == "outer"
        with streamalloc.tag("inner", inherit=False):
            assert extension.current() == "inner"
            assert extension.names[extension.inherited] == "outer"
        assert extension.current() == "outer"
        seen = []
        thread = threading.Thread(target=lambda: seen.append(extension.current()))
        thread.start()
        thread.join()
        assert seen == ["outer"]  # a thread without a tag of its own inherits
    assert extension.current() == "untagged"
    with pytest.raises(ValueError):
        with streamalloc.tag(""):
            pass


def test_inplace_relu_after_batchnorm_still_trains(extension):
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
    with streamalloc.attribute(net, prefix="student"):
        with tag_log(extension) as backward:
            net(torch.randn(2, 3, 8, 8)).sum().backward()
    assert net[0].weight.grad is not None
    assert "student.0" in _tags_of(backward.ops, "convolution_backward")
    assert extension.thread_tag() == 0


class RaisingModel(nn.Module):
    """Runs a submodule, then raises: hooks and tags must be put back."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def forward(self, x):
        self.inner(x)
        raise RuntimeError("boom")


def test_a_forward_that_raises_restores_the_tag(extension):
    model = RaisingModel()
    streamalloc.attribute(model)
    with streamalloc.tag("outside"):
        with pytest.raises(RuntimeError):
            model(torch.randn(1, 2))
        assert extension.current() == "outside"


# ---------------------------------------------------------------- sample_passes

MODULES = {"embed", "layers.0", "layers.2", "head"}


def _submodule_hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules() if m is not model)


def _thread_state_is_clear():
    state = diagnosis._thread_state()
    return not state.stack and not state.claimed_inputs and not state.claimed_outputs


def test_sample_passes_hooks_modules_in_one_pass_in_n(extension):
    torch.manual_seed(0)
    model = mlp()
    handle = streamalloc.attribute(model, sample_passes=3)
    assert _submodule_hooks(model) == 0
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == (1, 1)  # the pass counter
    x, target = torch.randn(5, 8), torch.tensor([0, 1, 2, 3, 0])
    hooked = []  # per submodule call: whether it had a hook of its own
    with nn.modules.module.register_module_forward_pre_hook(
            lambda module, _args: hooked.append(bool(module._forward_pre_hooks)) if module is not model else None):
        for i in range(7):
            hooked.clear()
            set_calls = extension.set_calls
            with tag_log(extension) as forward:
                loss = nn.functional.cross_entropy(model(x), target)
            with tag_log(extension) as backward:
                loss.backward()
            model.zero_grad(set_to_none=True)
            if i % 3 == 0:
                assert set(hooked) == {True}, i
                assert _tags_of(forward.ops, "addmm") == MODULES, i
                assert _tags_of(backward.ops, "mm") == MODULES, i
            else:
                # No hook but the counter: no tag change, all under the thread's tag.
                assert set(hooked) == {False}, i
                assert extension.set_calls == set_calls, i
                assert {tag for _, tag in forward.ops + backward.ops} == {"untagged"}, i
            assert _tags_of(backward.ops, "nll_loss_backward") == {"untagged"}, i
            assert _submodule_hooks(model) == 0, i
            assert extension.thread_tag() == 0 and _thread_state_is_clear(), i
    assert (handle.passes, handle.sampled_passes) == (7, 3)


@pytest.mark.parametrize("no_backward", [torch.no_grad, torch.inference_mode])
def test_a_sampled_pass_without_backward_cleans_up(extension, no_backward):
    torch.manual_seed(0)
    model = mlp()
    handle = streamalloc.attribute(model, sample_passes=2)
    x = torch.randn(5, 8)
    with no_backward():
        with tag_log(extension) as inference:
            model(x)
    # Inference mode runs linear undecomposed.
    assert _tags_of(inference.ops, "addmm") | _tags_of(inference.ops, "linear") == MODULES
    assert _submodule_hooks(model) == 0
    assert extension.thread_tag() == 0 and _thread_state_is_clear()
    model(x)
    # A sampled pass whose output is dropped: its node hooks go with the graph.
    model(x).sum()
    assert _submodule_hooks(model) == 0 and _thread_state_is_clear()
    model(x)
    with tag_log(extension) as forward:
        out = model(x)
    with tag_log(extension) as backward:
        out.sum().backward()
    assert _tags_of(forward.ops, "addmm") == MODULES
    assert _tags_of(backward.ops, "mm") == MODULES
    assert extension.thread_tag() == 0
    assert (handle.passes, handle.sampled_passes) == (5, 3)


def test_a_sampled_pass_backward_after_later_passes(extension):
    """Gradient accumulation: the sampled pass's backward runs after the
    next (unsampled) forward and is still attributed; that pass's is not."""
    torch.manual_seed(0)
    model = mlp()
    streamalloc.attribute(model, sample_passes=2)
    sampled, unsampled = model(torch.randn(5, 8)), model(torch.randn(5, 8))
    with tag_log(extension) as first:
        sampled.sum().backward()
    with tag_log(extension) as second:
        unsampled.sum().backward()
    assert _tags_of(first.ops, "mm") == MODULES
    assert {tag for _, tag in second.ops} == {"untagged"}


def test_a_sampled_pass_that_raises_removes_its_hooks(extension):
    model = RaisingModel()
    handle = streamalloc.attribute(model, sample_passes=2)
    with streamalloc.tag("outside"):
        for _ in range(3):
            with pytest.raises(RuntimeError):
                model(torch.randn(1, 2))
            assert extension.current() == "outside"
            assert _submodule_hooks(model) == 0 and _thread_state_is_clear()
    assert (handle.passes, handle.sampled_passes) == (3, 2)


def test_the_model_called_inside_its_own_sampled_pass(extension):
    class recursive(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x, again=True):
            h = self.inner(x)
            return self(h, again=False) + 1 if again else h

    model = recursive()
    handle = streamalloc.attribute(model, sample_passes=2)
    with tag_log(extension) as forward:
        model(torch.randn(3, 4)).sum().backward()
    # Both calls of `inner` keep their hooks until the outer call returns.
    assert [tag for op, tag in forward.ops if op == "addmm"] == ["inner", "inner"]
    assert _tags_of(forward.ops, "add") == {"recursive"}
    assert handle.sampled_passes == 1 and _submodule_hooks(model) == 0
    assert extension.thread_tag() == 0 and _thread_state_is_clear()


def test_remove_takes_out_the_pass_counter_too(extension):
    model = mlp()
    handle = streamalloc.attribute(model, sample_passes=4)
    model(torch.randn(5, 8))
    handle.remove()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    with tag_log(extension) as after:
        model(torch.randn(5, 8))
    assert {tag for _, tag in after.ops} == {"untagged"}
    assert handle.passes == 1

    # Removed inside a sampled pass, the hooks of that pass go too (in a
    # thread of its own: the pass never ends, and leaves its tag there).
    handle = streamalloc.attribute(model, sample_passes=4)
    norm = model.norm.forward

    def remove_then_norm(h):
        handle.remove()
        return norm(h)

    model.norm.forward = remove_then_norm
    thread = threading.Thread(target=model, args=(torch.randn(5, 8),))
    thread.start()
    thread.join()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_sample_passes_must_be_a_positive_integer(extension, bad):
    with pytest.raises(ValueError, match="sample_passes"):
        streamalloc.attribute(mlp(), sample_passes=bad)
