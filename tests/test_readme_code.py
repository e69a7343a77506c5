"""The code the chapter READMEs show is the code the scripts run.

A README marks a snippet with the script it comes from, on the line just before the block::

    <!-- code: 02-fsdp/fsdp_basics.py -->
    ```python
    ...
    ```

and a diff with the two scripts it compares (``-`` lines from the first, ``+`` lines from the
second, context lines from both)::

    <!-- diff: 01-ddp-basics/ddp_mnist.py 02-fsdp/fsdp_transformer.py -->
    ```diff
    ...
    ```

Paths are relative to the repository root. A snippet's lines, stripped, must be whole lines of its
script, in the script's order; a line that is only ``...`` (or a diff hunk header ``@@ ...``) elides
and blank lines are skipped. So a snippet cannot drift from its script unseen: renaming a call in a
script, or editing a snippet by hand, fails here. Pure text, no launches.
"""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHAPTER_READMES = sorted(REPO.glob("0*/README.md"))
# Chapters whose sections open with their scripts' code: each must show at least one marked block.
SHOWS_CODE = {"01-ddp-basics", "02-fsdp", "03-deepspeed", "04-nccl-operations", "05-advanced"}
_MARKED = re.compile(r"<!-- (code|diff): ([^\n]*?) -->\n```(\w*)\n(.*?)^```", re.S | re.M)
_ANY_BLOCK = re.compile(r"^```(python|diff)\n", re.M)


def _elided(line: str) -> bool:
    return not line.strip() or line.strip() == "..." or line.startswith("@@")


def missing_in_order(lines: list[str], script: str) -> str | None:
    """The first of ``lines`` (stripped) that is not a line of ``script`` after the previous one
    found; None when every line is there, in this order."""
    text = [line.strip() for line in script.splitlines()]
    at = 0
    for line in lines:
        try:
            at = text.index(line.strip(), at) + 1
        except ValueError:
            return line
    return None


def check_snippet(snippet: str, script: str) -> str | None:
    """None when a ```python snippet is copied from ``script``, else the line that is not."""
    return missing_in_order([line for line in snippet.splitlines() if not _elided(line)], script)


def check_diff(diff: str, old: str, new: str) -> str | None:
    """None when a ```diff block's ``-`` and context lines are ``old``'s and its ``+`` and context
    lines are ``new``'s, each side in order; else what is wrong."""
    minus, plus = [], []
    for line in diff.splitlines():
        if _elided(line[1:] if line[:1] in "+- " else line) or line.startswith(("--- ", "+++ ")):
            continue
        if line[:1] not in "+- ":
            return f"not a diff line: {line!r}"
        if line[0] in "- ":
            minus.append(line[1:])
        if line[0] in "+ ":
            plus.append(line[1:])
    bad = missing_in_order(minus, old)
    if bad is not None:
        return f"'-' or context line not in the first script: {bad!r}"
    bad = missing_in_order(plus, new)
    if bad is not None:
        return f"'+' or context line not in the second script: {bad!r}"
    return None


def marked_blocks(readme: Path) -> list[tuple[str, list[str], str, str]]:
    """(kind, paths, fence language, body) of every marked block of a README."""
    return [(m.group(1), m.group(2).split(), m.group(3), m.group(4))
            for m in _MARKED.finditer(readme.read_text())]


def check_block(kind: str, paths: list[str], language: str, body: str) -> str | None:
    if kind == "code":
        if language != "python" or len(paths) != 1:
            return f"a code mark names one script and precedes a ```python block: {paths} ```{language}"
        return check_snippet(body, (REPO / paths[0]).read_text())
    if language != "diff" or len(paths) != 2:
        return f"a diff mark names two scripts and precedes a ```diff block: {paths} ```{language}"
    return check_diff(body, (REPO / paths[0]).read_text(), (REPO / paths[1]).read_text())


@pytest.mark.parametrize("readme", CHAPTER_READMES, ids=lambda p: p.parent.name)
def test_every_marked_block_is_copied_from_its_script(readme):
    blocks = marked_blocks(readme)
    assert blocks or readme.parent.name not in SHOWS_CODE, f"{readme} shows no code marked with its script"
    for kind, paths, language, body in blocks:
        for path in paths:
            assert (REPO / path).is_file(), f"{readme.parent.name}: {kind} mark names {path}, not a file"
        problem = check_block(kind, paths, language, body)
        assert problem is None, f"{readme.parent.name}: {kind} block from {paths}: {problem}"


@pytest.mark.parametrize("readme", CHAPTER_READMES, ids=lambda p: p.parent.name)
def test_every_diff_is_marked(readme):
    """A diff always compares two scripts, so each one says which (a ```python block may be an
    example to run rather than a script's text, and stays unmarked)."""
    text = readme.read_text()
    marked = {m.start(3) - 3 for m in _MARKED.finditer(text)}
    for m in _ANY_BLOCK.finditer(text):
        if m.group(1) == "diff":
            line = text.count(chr(10), 0, m.start()) + 1
            assert m.start() in marked, f"{readme.parent.name}: unmarked diff at line {line}"


SCRIPT = "import torch\nmodel = Net()\nfor step in range(10):\n    loss = model(x).sum()\n    loss.backward()\n"
NEW = SCRIPT.replace("model = Net()", "model = fully_shard(Net())")


def test_the_checker_rejects_code_that_is_not_in_the_script():
    """Negative controls: the same checker refuses a line the script does not have, lines out of
    order, and a diff whose sides are swapped or whose context is in one script only."""
    assert check_snippet("model = Net()\n...\n    loss.backward()\n", SCRIPT) is None
    assert check_snippet("model = Net()\nloss = model(x).mean()\n", SCRIPT) == "loss = model(x).mean()"
    assert check_snippet("loss.backward()\nmodel = Net()\n", SCRIPT) == "model = Net()"
    good = "-model = Net()\n+model = fully_shard(Net())\n for step in range(10):\n"
    assert check_diff(good, SCRIPT, NEW) is None
    assert check_diff("+model = Net()\n-model = fully_shard(Net())\n", SCRIPT, NEW) is not None
    assert check_diff(" model = Net()\n", SCRIPT, NEW) is not None
    assert check_diff("-model = Net()\n+model = shard(Net())\n", SCRIPT, NEW) is not None
    mark = "<!-- code: 01-ddp-basics/ddp_mnist.py -->\n```python\nimport torch\nthis line is in no script\n```\n"
    (kind, paths, language, body), = [(m.group(1), m.group(2).split(), m.group(3), m.group(4))
                                      for m in _MARKED.finditer(mark)]
    assert check_block(kind, paths, language, body) == "this line is in no script"
