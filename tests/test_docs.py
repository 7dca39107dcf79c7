"""The pages users read, checked against the code: every code block of README.md runs as written
under 2 real ranks (workers/readme_checks.py), the `plan` output it shows is what `plan` prints, every
test a page cites exists, and the docs with their API reference (generated from the docstrings)
build without a warning."""
import ast
import fnmatch
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from horovod_run import horovodrun, load, torchrun
from workers.readme_checks import README, blocks

ROOT = README.parent
# a gradient's error after an 8-bit encode, a sum and a re-encode: under 2**-4 of its norm
E4M3_BOUND = 0.07
RUNS = {"horovod-torch": ("horovod-torch", "codes-optimizer"), "horovod-tensorflow": ("horovod-tensorflow",),
        "torchrun": ("ddp", "fsdp")}
README_LINES = 120  # the product page's bound: what is longer belongs in docs/
# a cited test file (`test_x.py`, `tests/test_x.py`), a test in one (`test_x.py::pattern`), a
# test pattern alone (`test_a_*`, `*words*`: a test of the file cited last before it on its line)
CITED_FILE = re.compile(r"(?:tests/)?(test_\w+\.py)(?:::(\S+))?")
CITED_TEST = re.compile(r"\*?test_[\w*]+|\*[\w*]+\*")


def test_every_code_block_of_the_readme_is_run_by_a_test():
    fences = re.findall(r"^```", README.read_text(), re.M)
    tagged = blocks()
    assert len(fences) == 2 * len(tagged), "a fenced block in README.md without its <!-- readme-test: NAME --> line"
    assert set(tagged) == {name for names in RUNS.values() for name in names} | {"keras", "plan"}


def test_the_readme_stays_a_product_page():
    assert len(README.read_text().splitlines()) <= README_LINES


def test_the_plan_the_readme_shows_is_what_plan_prints():
    lines = blocks()["plan"].splitlines()
    command = ""
    while not command or command.endswith("\\"):
        command = command.rstrip("\\") + lines.pop(0).lstrip("$ ")
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "hvd_aps"]
    run = subprocess.run([sys.executable] + argv[1:], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "\n".join(lines).strip()


def defined_tests():
    """{test file name: the names of the test functions in it}."""
    names = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        names[path.name] = {node.name for node in ast.walk(tree)
                            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    return names


def cited_tests(text):
    """(test file or None, pattern) for every test a page cites, in `backticks`: a pattern
    without a file of its own belongs to the file cited last before it on its line. Parameter ids
    (`[two_levels-*]`) are left out: they are not names."""
    for line in text.splitlines():
        file = None
        for token in re.findall(r"`([^`]+)`", line):
            cited = CITED_FILE.fullmatch(token)
            if cited:
                file, pattern = cited.groups()
                yield file, pattern and re.sub(r"\[.*\]$", "", pattern)
            elif CITED_TEST.fullmatch(token):
                yield file, token


CALL = re.compile(r"\bhvd_aps\.(\w+)\.(\w+)\(")  # a call of hvd_aps.<module or class>.<name>(...)


def code_lines(text: str) -> str:
    """The lines of a page's code blocks, fenced or indented."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            out.append(line)
    return "\n".join(out)


def test_every_call_a_pages_code_makes_resolves_after_a_plain_import():
    """A snippet written as `hvd_aps.step_profile.measure(...)` must run after `import hvd_aps`
    alone, in a fresh interpreter (a module another test imported would hide a missing one)."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    calls = sorted({m.groups() for page in pages for m in CALL.finditer(code_lines(page.read_text()))})
    assert ("step_profile", "measure") in calls  # the scan reads indented blocks too
    check = "import hvd_aps\nfor owner, name in %r:\n    getattr(getattr(hvd_aps, owner), name)" % calls
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr


def test_every_test_a_page_cites_exists():
    names = defined_tests()
    every = set().union(*names.values())
    missing = []
    for page in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        for file, pattern in cited_tests(page.read_text()):
            pool = every if file is None else names.get(file)
            if pool is None or pattern and not fnmatch.filter(pool, pattern):
                missing.append(f"{page.relative_to(ROOT)}: {file}::{pattern}")
    assert not missing, f"cited tests that do not exist: {missing}"


def readme_torchrun(tmp_path):
    torchrun("readme_checks.py", "torchrun", tmp_path)


@pytest.fixture(scope="module", params=list(RUNS))
def launched(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "torchrun":
        readme_torchrun(tmp)
    else:
        horovodrun("readme_checks.py", tmp, args=(request.param,))
    return request.param, load(tmp, f"readme_{request.param}")


def test_each_block_averages_the_ranks_gradients_in_codes_alike_on_every_rank(launched):
    launch, ranks = launched
    for name in RUNS[launch]:
        grads = [r[f"{name}_grads"] for r in ranks]
        mean = np.mean([r[f"{name}_own"].astype(np.float64) for r in ranks], axis=0)
        np.testing.assert_array_equal(grads[0].view(np.uint32), grads[1].view(np.uint32), err_msg=name)
        error = np.linalg.norm(grads[0] - mean) / np.linalg.norm(mean)
        assert 0 < error < E4M3_BOUND, f"{name}: {error} from the float32 mean (0: not compressed)"
    if launch == "horovod-tensorflow":  # Keras: the ranks' data differ, their trained weights may not
        np.testing.assert_array_equal(ranks[0]["keras_weights"], ranks[1]["keras_weights"])
        assert not np.array_equal(ranks[0]["keras_weights"], ranks[0]["keras_before"])


def test_the_docs_and_the_api_reference_build_without_a_warning(tmp_path):
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html", "docs", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert run.returncode == 0, run.stderr[-4000:]
    assert "APSCompressor.state_dict" in (tmp_path / "reference.html").read_text()


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and MyST (myst_heading_anchors) make it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_into_the_docs_lead_somewhere():
    for page, anchor in re.findall(r"\]\((docs/[\w./-]+)(?:#([\w-]+))?\)", README.read_text()):
        target = ROOT / page
        assert target.exists(), page
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, f"{page}#{anchor}"
