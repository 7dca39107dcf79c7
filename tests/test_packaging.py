"""The Dockerfiles may only install OS packages and call the project's installer, which CI runs."""
import pathlib
import re
import os
import sys
import zipfile

import pytest

from horovod_run import bounded

ROOT = pathlib.Path(__file__).parent.parent
WHEEL_S = 600  # pip building the wheel (it compiles ops/host.c)
IMPORT_S = 120  # an interpreter's imports


def test_dockerfiles_only_call_the_installer_and_cache_the_dependencies():
    """OS packages (make among the build tools: slim images have none), then the installer alone
    (dependencies and Horovod, a layer no source edit invalidates), then the source; both installs
    for running only (--runtime), else the second would add the test dependencies to the image."""
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (ROOT / "docker" / name).read_text()
        runs = re.findall(r"^RUN (.*?)(?<!\\)$", text, flags=re.M | re.S)
        assert runs, name
        installs = [run for run in runs if not run.startswith("apt-get")]
        assert [re.fullmatch(r"bash scripts/install.sh( --deps-only)? --runtime", run) is not None
                for run in installs] == [True, True], installs
        assert all(tool in runs[0].split() for tool in ("g++", "make", "cmake")), name
        assert text.index("--deps-only") < text.index("COPY . .") < text.rindex("bash scripts/install.sh --runtime\n")
    assert "ARG TORCH_INDEX_URL" in (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert ".venv" in (ROOT / ".dockerignore").read_text()


def test_wheel_holds_the_kernel_sources_and_the_host_engine(tmp_path):
    bounded([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", tmp_path, ROOT],
            WHEEL_S, dict(os.environ))
    (wheel,) = tmp_path.glob("hvd_aps-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = {f"hvd_aps/ops/{name}" for name in ("__init__.py", "fpcodec.h", "host.c", "kernels.cu")}
    assert sources <= set(names), names
    assert {"hvd_aps/gpu_projection.json", "hvd_aps/fidelity.json"} <= set(names), names  # what plan reads
    assert any(re.fullmatch(r"hvd_aps/_hostcodec\..*so", n) for n in names), names


def test_the_installed_package_finds_the_kernel_sources(tmp_path):
    """Where the CuPy engine reads kernels.cu (the package hvd_aps.ops), from outside the checkout
    through the installer's editable install: a namespace package there was not found, so a GPU
    machine installed by scripts/install.sh (the Docker image too) could not compile its kernels."""
    code = "import importlib.resources as r; print((r.files('hvd_aps.ops') / 'kernels.cu').read_text().count('hvd_'))"
    run = bounded([sys.executable, "-c", code], IMPORT_S, dict(os.environ), check=False, cwd=tmp_path)
    assert run.returncode == 0 and int(run.stdout) > 5, run.stderr


def _build_horovod():
    import importlib.util
    spec = importlib.util.spec_from_file_location("build_horovod", ROOT / "scripts" / "build_horovod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_installer_unpacks_without_the_tar_filter_and_refuses_what_it_would(tmp_path, monkeypatch):
    """Pythons before 3.11.4 (Debian 12's own 3.11.2) have no tarfile filter: the installer then
    checks the members itself, unpacking plain files and refusing links and paths outside."""
    import tarfile
    build = _build_horovod()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "setup.py").write_text("print(1)\n")
    good, bad = tmp_path / "good.tar.gz", tmp_path / "bad.tar.gz"
    with tarfile.open(good, "w:gz") as tar:
        tar.add(tmp_path / "src", arcname="horovod-x")
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(tmp_path / "src" / "setup.py", arcname="../escaped.py")
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    build.extract(good, tmp_path / "out")
    assert (tmp_path / "out" / "horovod-x" / "setup.py").read_text() == "print(1)\n"
    with pytest.raises(SystemExit):
        build.extract(bad, tmp_path / "out2")
    assert not (tmp_path / "escaped.py").exists()


def test_every_patch_says_why_and_the_wheel_cache_follows_the_patches():
    build = _build_horovod()
    assert all(len(p) == 4 and p[3] for p in build.PATCHES + build.GPU_PATCHES)
    assert any("Keras 3" in p[3] for p in build.PATCHES)
    before = build.cache_dir("2.13.0", None).name
    build.PATCHES.append(("x", "y", "z", "a new patch"))
    assert build.cache_dir("2.13.0", None).name != before


def test_gpu_patches_change_the_wheel_of_cuda_builds_alone(monkeypatch):
    """A patch to code compiled only with GPU operations must not rebuild every CPU machine's Horovod."""
    build = _build_horovod()
    keys = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setenv("HVD_APS_DEVICE", device)
        before = build.cache_dir("2.13.0", "2.21.0").name
        build.GPU_PATCHES.append(("x", "y", "z", "a new GPU patch"))
        keys[device] = (before, build.cache_dir("2.13.0", "2.21.0").name)
        build.GPU_PATCHES.pop()
    assert keys["cpu"][0] == keys["cpu"][1] and keys["cuda"][0] != keys["cuda"][1], keys


# Import names whose package on PyPI is named otherwise; the frameworks install.sh installs apart
# from its dependency lists (keras comes with TensorFlow, cupy with the CUDA builds).
PYPI_NAMES = {"sklearn": "scikit-learn", "yaml": "pyyaml"}
FRAMEWORKS = {"torch", "tensorflow", "keras", "horovod", "cupy"}
# what an integration module integrates with, which its users have (hvd_aps.lightning: Lightning)
INTEGRATED = {"lightning", "pytorch_lightning"}


def _module_level_imports(path):
    """Third-party packages a file imports when it is loaded (not inside functions: those are the
    optional ones, such as the plots' matplotlib)."""
    import ast
    local = {p.stem for p in (ROOT / "examples").glob("*.py")} | {"hvd_aps"}
    stack = list(ast.parse(path.read_text()).body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        for name in (n.split(".")[0] for n in names):
            if name not in sys.stdlib_module_names and name not in local:
                yield PYPI_NAMES.get(name, name)
        stack.extend(ast.iter_child_nodes(node))


def test_the_images_runtime_install_has_what_the_package_and_the_examples_import():
    """The images install with --runtime (no test, docs or plotting packages): a module-level import
    of anything else in hvd_aps or an example would fail only inside an image."""
    text = (ROOT / "scripts" / "install.sh").read_text()
    runtime = set(re.search(r'^DEPS="(.*)"$', text, flags=re.M).group(1).split())
    files = sorted(ROOT.glob("hvd_aps/**/*.py")) + sorted((ROOT / "examples").glob("*.py"))
    imported = {name: path.relative_to(ROOT) for path in files for name in _module_level_imports(path)}
    assert {"numpy", "tqdm", "scikit-learn"} <= set(imported), imported  # the scan sees imports
    missing = {name: str(path) for name, path in imported.items() if name not in runtime | FRAMEWORKS | INTEGRATED}
    assert not missing, f"imported at module level but not installed by install.sh --runtime: {missing}"


def test_the_package_has_no_import_circle():
    """No module of hvd_aps imports (at module level or inside a function) one that imports it
    back, directly or through others: each can be read, and loaded, on its own."""
    import ast
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (ROOT / "hvd_aps").rglob("*.py")}
    imports = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [node.module or ""])
                base = base.rstrip(".")
                targets = [base] if node.module else []
                targets += [f"{base}.{alias.name}" for alias in node.names]
                imports[name] |= {t for t in targets if t in modules and t != name}
    def reaches(start, goal, seen):
        return any(t == goal or (t not in seen and not seen.add(t) and reaches(t, goal, seen)) for t in imports[start])
    circles = [name for name in modules if reaches(name, name, set())]
    assert not circles, f"modules in an import circle: {circles}"
