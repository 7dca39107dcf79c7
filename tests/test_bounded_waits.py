"""No test, example or script of the project waits without a bound (a hung peer then fails the
run, it does not stall CI). In the Python of tests/, examples/ and scripts/: every subprocess.run
(and check_output, check_call, call), every join, result, wait, get, communicate or acquire
called with no argument (a thread's, process's, future's, queue's), and every Barrier is given a
timeout, or says on its line what bounds it otherwise, in a comment starting "bounded:". Calls
with arguments are taken for what else those names are (str.join, dict.get); the shell scripts
bound theirs with timeout(1), and pytest.ini bounds every test as a whole."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parent.parent
FOLDERS = ("tests", "examples", "scripts")
RUNS = {"run", "check_output", "check_call", "call"}  # subprocess's, which wait for the child's end
WAITS = {"communicate", "join", "result", "wait", "get", "acquire"}  # blocking unless given a timeout
MARK = "# bounded:"


def unbounded(source: str) -> list:
    """(line, call) of every wait in `source` with no timeout and no MARK on its line."""
    lines, found = source.splitlines(), []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or any(k.arg == "timeout" for k in node.keywords):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "subprocess":
            waits = name in RUNS
        elif name == "Barrier":
            waits = True
        else:  # str.join(parts), dict.get(key), ddp.join(enable=...): arguments mean it is something else
            waits = name in WAITS and not node.args and not node.keywords
        if waits and MARK not in lines[node.lineno - 1]:
            found.append((node.lineno, name))
    return found


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_wait_has_a_bound(folder):
    found = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in sorted((ROOT / folder).rglob("*.py"))
             for line, name in unbounded(path.read_text())]
    assert not found, "waits without a timeout (or a '# bounded:' comment saying what bounds them):\n" + "\n".join(found)


def test_the_check_finds_what_it_looks_for():
    """Each kind of wait it looks for, found without a timeout and passed with one."""
    waits = ["subprocess.run(cmd)", "thread.join()", "future.result()", "proc.wait()", "queue.get()",
             "proc.communicate()", "threading.Barrier(2)", "lock.acquire()"]
    assert len(unbounded("\n".join(waits))) == len(waits)
    bounded = [w.replace("()", "(timeout=1)").replace("(cmd)", "(cmd, timeout=1)").replace("(2)", "(2, timeout=1)")
               for w in waits]
    assert unbounded("\n".join(bounded)) == []
    others = ["', '.join(parts)", "d.get('key')", "ddp.join(enable=True)", f"pool.join()  {MARK} terminated"]
    assert unbounded("\n".join(others)) == []
