"""Diagnosis on a GPU, each case in a fresh process (scripts/diagnosis.py):
attribution sums against torch.cuda.memory_allocated(), tags of forward,
backward, optimizer and user scopes, attribution of one pass in N, leak
watch on a leaking and a steady model (and steady real workloads), the
out-of-memory message and last_oom_report(), and max_batch_size on an
MLP, a CNN and a transformer."""

import re

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20
FIRST_SENTENCE = re.compile(r"CUDA out of memory\. Tried to allocate [0-9.]+ [KMG]iB\.")


@pytest.fixture(scope="module")
def attribution(scripts):
    return scripts.run_ok("diagnosis.py", "attribution")


def test_attribution_sums_equal_memory_allocated(attribution):
    for label, check in attribution["checks"].items():
        assert check["report_sum"] == check["memory_allocated"], label
        assert check["before_tagging"] == 0, label  # tagging was on from the start
    assert attribution["by_size_sum"] == attribution["report_allocated"]


def test_forward_backward_and_scopes_are_tagged(attribution):
    assert {"embed", "layers.0.0", "layers.2.2", "norm", "head"} <= set(attribution["forward_tags"])
    # Gradients are made in backward, under the module owning the parameter.
    tagged, total = attribution["grad_bytes_tagged_with_owner"], attribution["grad_bytes"]
    assert tagged >= 0.9 * total, attribution["grad_tags_sample"]
    # AdamW's two moments per parameter were made under tag("optimizer").
    assert attribution["optimizer_bytes"] >= 2 * attribution["param_bytes"]
    assert attribution["data_bytes"] == 256 * 1024 * 4
    assert attribution["extra_tag"] == "data"
    assert attribution["snapshot_has_tags"]


def test_tag_scopes_reach_autograd_threads_and_hooks_come_out(attribution):
    assert attribution["inherited_grad_tags"] == ["backward"]
    assert attribution["after_remove_output_tag"] == "untagged"


def test_attribute_keeps_inplace_relu_after_batchnorm_working(attribution):
    assert attribution["cnn_backward_ok"]
    assert attribution["cnn_conv_grad_tag"] == "features.0.0"


def test_sampling_estimates_and_disabling(attribution):
    assert attribution["sampled"]
    estimate, actual = attribution["sampled_estimate"], attribution["sampled_allocated"]
    assert abs(estimate - actual) <= 0.1 * actual
    assert attribution["disabled_report_tagging"] is False


def test_sample_passes_attributes_one_pass_in_n_and_hooks_no_other(scripts):
    run = scripts.run_ok("diagnosis.py", "sampled_attribution")
    every, passes = run["every"], run["passes"]
    assert (run["handle_passes"], run["handle_sampled_passes"]) == (len(passes), 3)
    for i, p in enumerate(passes):
        # Every allocation is recorded, sampled pass or not.
        assert p["report_sum"] == p["memory_allocated"] and p["before_tagging"] == 0, i
        assert p["submodule_hooks"] == 0, i  # the sampled pass took its hooks out
        if i % every == 0:
            assert {"embed", "layers.0.0", "layers.2.2", "norm", "head"} <= set(p["forward_module_tags"]), i
            assert p["grad_bytes_tagged_with_owner"] >= 0.9 * p["grad_bytes"], i
            assert p["tag_changes"] > 0, i
        else:
            assert p["forward_module_tags"] == [], i
            assert p["grad_tags"] == ["untagged"], i
            assert p["tag_changes"] == 0, i  # no module hook ran, forward or backward


@pytest.fixture(scope="module")
def leaks(scripts):
    return {kind: scripts.run_ok("diagnosis.py", "leak", kind) for kind in ("leaky", "steady")}


def test_a_leak_is_flagged_within_n_steps(leaks):
    leaky = leaks["leaky"]
    steps = leaky["steps"]
    assert "cache" in leaky["flagged_at"], leaky["findings"]
    assert leaky["flagged_at"]["cache"] <= steps
    (finding,) = [f for f in leaky["findings"] if f["name"] == "cache"]
    assert finding["growth_per_step"] == [leaky["kept_bytes_per_step"]] * steps
    assert any("'cache'" in w and "grew in each of the last" in w for w in leaky["warnings"])


def test_the_same_model_without_the_leak_is_not_flagged(leaks):
    assert leaks["steady"]["findings"] == []
    assert leaks["steady"]["warnings"] == []


def test_a_leak_is_flagged_by_call_site_with_memory_history(scripts):
    leaky = scripts.run_ok("diagnosis.py", "leak", "leaky", "history")
    sites = [f for f in leaky["findings"] if f["kind"] == "call_site"]
    assert any("diagnosis.py" in f["name"] and "(forward)" in f["name"] for f in sites), leaky["findings"]


def test_real_training_loops_stay_silent(scripts):
    run = scripts.run_ok("diagnosis.py", "steady_workloads", timeout=900)
    for workload, findings in run["findings"].items():
        assert findings == [], workload


def test_oom_message_keeps_torch_wording_and_adds_holders_and_a_suggestion(scripts):
    run = scripts.run_ok("diagnosis.py", "oom")
    assert run["raised"]
    message = run["message"]
    assert FIRST_SENTENCE.search(message)
    assert message.index("CUDA out of memory.") < message.index("Top holders by tag")
    assert "big_buffer 1.40 GiB" in message
    assert "Suggestion: Live tensors take" in message
    assert "reduce the batch size by at least" in message
    report = run["report"]
    assert report["case"] == "near_limit"
    assert report["holders"][0]["tag"] == "big_buffer"
    assert report["requested_bytes"] > 0 and report["limit_bytes"] <= 2 * (1 << 30) + MiB
    assert report["text"] in message
    # Each process the driver lists is named as torch names it.
    for process in report["processes"]:
        sentence = "this process has" if process["pid"] == run["pid"] else f"Process {process['pid']} has"
        assert sentence in message, (process, message)
    assert run["after_loss"] > 0


def test_oom_from_fragmentation_suggests_expandable_segments(scripts):
    run = scripts.run_ok("diagnosis.py", "oom_fragmentation")
    assert run["raised"]
    report = run["report"]
    assert report["case"] == "fragmentation", report
    assert report["unallocated_bytes"] >= 80 * MiB
    assert report["largest_free_block_bytes"] < 80 * MiB
    assert "expandable_segments:True" in run["message"]


@pytest.mark.parametrize("model", ["mlp", "cnn", "transformer"])
def test_max_batch_size_fits_and_beats_bisection(scripts, model):
    run = scripts.run_ok("diagnosis.py", "max_batch", model, timeout=900)
    found = run["result"]
    assert found["batch"] is not None and run["fits"], found
    if run["next_power_fits"]:
        assert found["batch"] >= 0.95 * run["measured_limit"], (found, run["measured_limit"])
    assert found["steps"] < found["bisection_steps"], found
    assert found["predicted_batch"] is not None
    assert found["measured_peak_allocated"] > 0 and found["predicted_peak_allocated"] > 0
