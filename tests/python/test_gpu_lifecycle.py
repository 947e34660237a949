"""streamalloc over a process's whole life on a GPU: DataLoader workers
forked while other threads allocate (no deadlock, parent blocks untouched),
exiting with memory in use (with and without empty_cache, several times
over), and many threads allocating and running autograd at once. Each
scenario runs in its own process (scripts/)."""

import pytest

pytestmark = pytest.mark.gpu

CRASH_TEXT = ("could not free", "terminate called", "Segmentation fault", "core dumped", "Fatal Python error", "Traceback")


def assert_clean_stderr(run):
    for text in CRASH_TEXT:
        assert text not in run.stderr, run.describe()


def test_dataloader_workers_fork_while_threads_allocate(scripts):
    run = scripts.run("dataloader_fork.py", timeout=300)
    assert run.returncode == 0, run.describe()
    assert_clean_stderr(run)
    result = run.result
    assert result["allocator"] == "streamalloc"
    assert result["batches"] == 4 * 12
    assert result["items"] == 4 * 96
    assert result["max_error"] < 1e-9
    assert result["background_steps"] > 0
    # The workers' frees of their inherited copy never reached the parent's block.
    assert result["parent_tensor_intact"] is True


@pytest.mark.parametrize("mode", ["keep", "empty_cache"])
def test_exit_with_live_tensors_is_clean_every_time(scripts, mode):
    for attempt in range(5):
        run = scripts.run("exit_with_tensors.py", mode, timeout=120)
        assert run.returncode == 0, f"attempt {attempt}: {run.describe()}"
        assert run.result == {"mode": mode, "live": 4, "graph_output": 256, "allocator": "streamalloc"}, run.describe()
        assert_clean_stderr(run)


def test_threads_allocate_and_backpropagate_concurrently(scripts):
    run = scripts.run("threads.py", timeout=300)
    assert run.returncode == 0, run.describe()
    assert_clean_stderr(run)
    result = run.result
    assert result["allocator"] == "streamalloc"
    assert result["errors"] == []
    # 60 gradient checks per thread plus one per tensor it kept alive.
    assert result["checks"] == result["threads"] * (60 + 60)
    assert result["allocated_after"] == result["allocated_before"]
    assert result["num_ooms"] == 0


def test_fork_after_install_leaves_cuda_to_the_child(scripts):
    # install() asks NVML, not the CUDA driver, whether a GPU is there.
    result = scripts.run_ok("fork_after_install.py")
    assert result["child_answer"] == 10.0, result["child_answer"]
    assert result["child_exit"] == 0
    assert result["installed"] is True
    assert result["parent_can_use_cuda"] == 4.0
