"""Bad input ends with one clear `error:` line and a non-zero exit: no hang, no traceback wall."""
import pytest

from distkit.runtime import UsageError, choose_backend_and_device
from launch import REPO, assert_one_line_error, job_env, torchrun

SCRIPT = REPO / "01-ddp-basics" / "ddp_mnist.py"


def test_choose_backend_and_device_unit():
    """A unit test of the choice function: GPU count and NCCL availability are its arguments."""
    def choose(backend, device, ranks, gpus, nccl=True):
        return choose_backend_and_device(backend, device, ranks, gpu_count=gpus, nccl_available=nccl)

    assert choose("auto", "auto", 4, gpus=0) == ("gloo", "cpu")
    assert choose("auto", "auto", 4, gpus=4) == ("nccl", "cuda")
    assert choose("auto", "auto", 1, gpus=8) == ("nccl", "cuda")
    assert choose("gloo", "auto", 4, gpus=4) == ("gloo", "cpu")  # forced by flag
    assert choose("auto", "cpu", 4, gpus=4) == ("gloo", "cpu")
    assert choose("gloo", "cuda", 2, gpus=2) == ("gloo", "cuda")  # gloo can move GPU tensors
    assert choose("auto", "auto", 4, gpus=2) == ("gloo", "cpu")  # does not fit: fall back
    assert choose("auto", "auto", 4, gpus=4, nccl=False) == ("gloo", "cpu")  # CPU-only build
    with pytest.raises(UsageError, match="--backend nccl: 4 local ranks need 4 GPUs but this machine has 2"):
        choose("nccl", "auto", 4, gpus=2)
    with pytest.raises(UsageError, match="--device cuda: 2 local ranks need 2 GPUs but this machine has 0"):
        choose("auto", "cuda", 2, gpus=0, nccl=False)
    with pytest.raises(UsageError, match="needs --device cuda"):
        choose("nccl", "cpu", 1, gpus=1)
    with pytest.raises(UsageError, match="no NCCL"):
        choose("nccl", "auto", 1, gpus=0, nccl=False)


def test_deepspeed_launcher_local_size_counts_as_local_world_size(monkeypatch):
    """The deepspeed launcher says LOCAL_SIZE where torchrun says LOCAL_WORLD_SIZE."""
    from distkit.runtime import local_world_size_from_env

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert local_world_size_from_env() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_world_size_from_env() == 2
    with pytest.raises(UsageError, match="4 local ranks need 4 GPUs but this machine has 1"):
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        choose_backend_and_device("nccl", "auto", gpu_count=1, nccl_available=True)


# The first two run under the real torchrun: its agent adds its own summary to a failed rank's output,
# and they show that summary holds no traceback either. A data-path error is the same clean exit of
# every rank, so the rest start through the fork launcher (tests/launch.py), which costs no interpreter
# start per rank.
def test_nccl_on_this_machine_is_one_line(tmp_path):
    # CPU build: no NCCL at all. On a GPU box with fewer GPUs than ranks the line names the counts.
    result = torchrun(SCRIPT, "--backend", "nccl", nproc=2, launcher="torchrun", tmp_path=tmp_path,
                      check=False, timeout=120)
    assert_one_line_error(result, "nccl")


def test_unknown_flag_is_one_line(tmp_path):
    result = torchrun(SCRIPT, "--no-such-flag", nproc=2, launcher="torchrun", tmp_path=tmp_path,
                      check=False, timeout=120)
    assert_one_line_error(result, "unrecognized arguments: --no-such-flag")


@pytest.mark.parametrize("make_dir, expected", [
    (lambda tmp: tmp.joinpath("a-file").write_text("x") and tmp / "a-file", "is not a directory"),
    (lambda tmp: "/proc/no-such-dir/mnist", "cannot be created"),
])
def test_wrong_data_dir_is_one_line(tmp_path, make_dir, expected):
    data_dir = make_dir(tmp_path)
    result = torchrun(SCRIPT, "--data-dir", data_dir, "--offline", nproc=2, tmp_path=tmp_path, check=False,
                      timeout=120)
    assert_one_line_error(result, expected)


def test_no_network_and_no_offline_sample_is_one_line(tmp_path):
    env = job_env(tmp_path, DISTKIT_MNIST_SAMPLE=str(tmp_path / "missing.csv.gz"))
    result = torchrun(SCRIPT, "--data-dir", tmp_path / "data", "--offline", nproc=2, env=env, check=False,
                      timeout=120)
    assert_one_line_error(result, "offline sample is missing")


def test_busy_rendezvous_port_in_the_launcher_is_one_line(tmp_path):
    import socket
    import subprocess

    with socket.socket() as holder:  # something already listens on the rendezvous port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            ["bash", str(REPO / "01-ddp-basics" / "launch_ddp.sh"), "--nnodes", "2", "--node-rank", "0",
             "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT)],
            cwd=REPO, env=job_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is already in use (or not an address of this node); "
        "pick another --master-port"]


@pytest.mark.parametrize("flag, value, expected", [
    ("--max-steps", "0", "argument --max-steps: must be a positive integer, got 0"),  # was a ZeroDivisionError
    ("--epochs", "-1", "argument --epochs: must be a positive integer, got -1"),
    ("--batch-size", "0", "argument --batch-size: must be a positive integer, got 0"),
    ("--lr", "-1", "argument --lr: must be a positive number, got -1"),
    ("--num-workers", "-2", "argument --num-workers: must be an integer >= 0, got -2"),
    ("--timeout-s", "0", "argument --timeout-s: must be a positive number, got 0"),
])
def test_out_of_range_numbers_are_one_line(flag, value, expected):
    # argparse rejects them before anything starts: the script's own parser, in this process
    from launch import load_script, parse_args_result

    result = parse_args_result(load_script(SCRIPT), flag, value, "--offline")
    assert result.returncode == 2
    assert_one_line_error(result, expected)


@pytest.mark.parametrize("script, steps, need, what", [
    ("03-deepspeed/zero_offload.py", 3, 4, "a timed step"),
    ("05-advanced/gradient_accumulation.py", 2, 3, "the instrumented step"),
    ("05-advanced/expert_parallel.py", 1, 3, "the instrumented step"),
])
def test_too_few_steps_for_what_a_script_reports_are_one_line(script, steps, need, what):
    """A script whose report needs the harness's instrumented step (bytes, routed tokens) or a timed
    step after it (a step time) refuses fewer ``--steps`` in one line before it starts, where it
    ended in a traceback from its own report (a step time of None, a missing collective, an empty
    list). Control: the fewest steps it names pass the parser."""
    from launch import load_script, parse_args_result

    module = load_script(REPO / script)
    result = parse_args_result(module, "--steps", steps)
    assert result.returncode == 2
    assert_one_line_error(result, f"--steps {steps} is too few for")
    assert f"it needs {what}, at least --warmup-steps 2 + {need - 2} = {need} steps" in result.stdout
    assert parse_args_result(module, "--steps", need).returncode == 0
