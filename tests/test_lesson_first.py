"""Every chapter script reaches the call that IS its lesson in the first screen of its main path.

A reader opens a chapter script at ``main`` and should meet the mechanism the chapter teaches
(``DDP(...)``, ``fully_shard(...)``, ``deepspeed.initialize(...)``, ``parallelize_module(...)``, the
pipeline schedule, the ring, the all-to-all) before any evidence code. ``LESSONS`` names, per script,
the calls that are its lesson; the check is static (the source's syntax tree, nothing runs).

How lines are counted: from the first statement of ``main``'s body to the line of the lesson call.
When ``main`` reaches the lesson through one function of the same file (``train``, ``train_one``,
...), the count is the line of that call in ``main`` plus the lesson call's line in that function's
body: the lines a reader reads following the path. One level only: the path must be visible from
``main``. ``SCREEN`` lines is the limit.

Every chapter script with a ``main`` is either in ``LESSONS`` or in ``EXEMPT`` (tools that teach no
distributed mechanism of their own), so a new script fails here until its lesson is named.
Negative controls: the same check on a source whose lesson call is pushed down a screen, and on one
that never makes it, fails.
"""
from __future__ import annotations

import ast

import pytest

from launch import REPO

SCREEN = 40
CHAPTERS = ("01-ddp-basics", "02-fsdp", "03-deepspeed", "04-nccl-operations", "05-advanced")
# script -> the calls that are its lesson (any of them, the first reached counts)
LESSONS: dict[str, tuple[str, ...]] = {
    "01-ddp-basics/ddp_mnist.py": ("DDP",),
    "01-ddp-basics/ddp_training.py": ("DDP",),
    "01-ddp-basics/ddp_from_scratch.py": ("broadcast_parameters", "average_gradients"),
    "01-ddp-basics/ddp_spawn.py": ("spawn",),
    "01-ddp-basics/ddp_benchmark.py": ("measure",),  # one world size's DDP step times
    "01-ddp-basics/inject_faults.py": ("instrument",),
    "01-ddp-basics/validate_distributed.py": ("init_distributed", "check_collectives"),
    "02-fsdp/fsdp_basics.py": ("fully_shard",),
    "02-fsdp/fsdp_transformer.py": ("shard_model", "DDP"),
    "02-fsdp/fsdp_checkpoint.py": ("load_dcp", "save_dcp"),
    "02-fsdp/fsdp_hf_checkpoint.py": ("set_model_state_dict",),
    "02-fsdp/fsdp_lora.py": ("build_sharded",),  # adapters added, then fully_shard
    "03-deepspeed/deepspeed_train.py": ("initialize",),
    "03-deepspeed/zero_memory.py": ("initialize",),
    "03-deepspeed/zero_offload.py": ("initialize",),
    "03-deepspeed/deepspeed_inference.py": ("init_inference",),
    "04-nccl-operations/collective_ops.py": ("all_reduce", "broadcast"),
    "04-nccl-operations/point_to_point.py": ("send", "recv"),
    "04-nccl-operations/bandwidth_test.py": ("all_reduce",),
    "04-nccl-operations/debug_lab.py": ("SCENARIOS",),  # the table of broken runs it plays
    "05-advanced/tensor_parallel.py": ("parallelize_module",),
    "05-advanced/hybrid_parallelism.py": ("tensor_parallel_blocks", "fully_shard"),
    "05-advanced/pipeline_parallel.py": ("make_stage_module", "TimedStage"),  # the stages, then the schedule
    "05-advanced/context_parallel.py": ("RingSelfAttention", "RingLlamaAttention", "context_parallel"),
    "05-advanced/expert_parallel.py": ("shard",),  # each MoE layer keeps its ep group's experts
    "05-advanced/gradient_accumulation.py": ("no_sync",),
    "05-advanced/activation_checkpointing.py": ("apply_ac_and_compile",),
    "05-advanced/communication_overlap.py": ("DDP",),
}
# scripts that report on, draw or tabulate what the lesson scripts recorded: no mechanism of their own
EXEMPT = {"01-ddp-basics/recovery_report.py", "02-fsdp/make_strategies_table.py", "05-advanced/plot_results.py"}


def _calls(function: ast.FunctionDef) -> list[tuple[int, str]]:
    """(line, name) of every call in ``function``, ``a.b.name(...)`` as ``name``, in line order; a
    name read without a call (a table of scenarios) counts too, where the table is the lesson."""
    found = []
    for node in ast.walk(function):
        target = node.func if isinstance(node, ast.Call) else node if isinstance(node, ast.Name) else None
        if isinstance(target, ast.Attribute):
            found.append((node.lineno, target.attr))
        elif isinstance(target, ast.Name):
            found.append((node.lineno, target.id))
    return sorted(found)


def lines_to_lesson(source: str, lessons: tuple[str, ...]) -> int | None:
    """Lines a reader reads from ``main``'s first statement to the first lesson call, following at
    most one same-file function from ``main`` (see the module docstring); None if never reached."""
    functions = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    main = functions["main"]
    start = main.body[0].lineno
    best = None
    for line, name in _calls(main):
        if name in lessons:
            reached = line - start
        elif name in functions and name != "main":
            inner = functions[name]
            hits = [at for at, called in _calls(inner) if called in lessons]
            reached = line - start + hits[0] - inner.body[0].lineno if hits else None
        else:
            continue
        if reached is not None and (best is None or reached < best):
            best = reached
    return best


def chapter_scripts() -> list[str]:
    """Every chapter script with a ``main`` (notebooks' percent sources have none)."""
    found = []
    for chapter in CHAPTERS:
        for path in sorted((REPO / chapter).glob("*.py")):
            tree = ast.parse(path.read_text())
            if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
                found.append(f"{chapter}/{path.name}")
    return found


def test_every_chapter_script_is_named():
    scripts = set(chapter_scripts())
    assert scripts - set(LESSONS) - EXEMPT == set(), "name the new script's lesson calls in LESSONS"
    assert set(LESSONS) | EXEMPT <= scripts, "LESSONS or EXEMPT names a script that is gone"


@pytest.mark.parametrize("script", sorted(LESSONS))
def test_the_lesson_comes_in_the_first_screen_of_main(script):
    reached = lines_to_lesson((REPO / script).read_text(), LESSONS[script])
    assert reached is not None, f"{script}: main never reaches {LESSONS[script]}"
    assert reached <= SCREEN, f"{script}: the lesson ({LESSONS[script]}) comes {reached} lines into main, over {SCREEN}"


PADDED = '''
def shard(model):
    return fully_shard(model)


def main():
    args = parse_args()
{padding}    shard(model)
'''


def test_negative_controls_a_late_or_missing_lesson_fails():
    on_time = PADDED.format(padding="    evidence()\n" * 10)
    assert lines_to_lesson(on_time, ("fully_shard",)) == 11
    late = PADDED.format(padding="    evidence()\n" * 60)
    assert lines_to_lesson(late, ("fully_shard",)) > SCREEN
    assert lines_to_lesson(on_time, ("parallelize_module",)) is None
