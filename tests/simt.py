"""CUDA kernels run on the CPU: the SIMT layer under tests/simt/ built, loaded and launched.

`KERNELS` is ops/kernels.cu compiled for the CPU (`Module`); `KERNELS.launch(name, grid, block,
arguments)` runs one of its kernels as cudaLaunchKernel would, on host memory: a pointer argument
is a `Span` of the array handed over (None: a null pointer), a scalar a NumPy scalar of the
parameter's C type. The counting CuPy stand-in launches every kernel through it.

`Recording` keeps launches (each array argument's bytes before and after) in the format of
tests/simt/replay.cc, and `Module.replay` replays them in a binary built with ThreadSanitizer or
AddressSanitizer: the same kernels on exact-size heap copies of their arrays, the results compared
byte for byte with the recorded ones.

Builds are cached under tests/simt/.build by a digest of their sources and flags; processes that
build at once (torchrun's ranks) each write a file of their own and rename it into place.
"""
import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import struct
import subprocess
import tempfile
import threading

import numpy as np

HERE = pathlib.Path(__file__).parent / "simt"
OPS = HERE.parent.parent / "ops"
BUILD = HERE / ".build"
HEADERS = [HERE / "cuda_on_host.h", OPS / "fpcodec.h"]
UNITS = [HERE / "simt.cc", HERE / "kernels.cc"]  # the runtime, and the source's kernels with their table
FLAGS = ["-std=c++20", "-Wall", "-Wextra", "-Wno-unused-parameter", "-ffp-contract=off", "-pthread",
         f"-I{HERE}", f"-I{OPS}"]
# What the checked builds add: a sanitizer, and replay.cc's main
SANITIZERS = {"thread": ["-fsanitize=thread", "-O1", "-g"],
              "address": ["-fsanitize=address", "-fno-omit-frame-pointer", "-O1", "-g"]}
SANITIZER_OPTIONS = {
    "thread": {"TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0"},
    "address": {"ASAN_OPTIONS": "halt_on_error=1:exitcode=66:detect_leaks=0"},
}
SANITIZER_FAILED = 66
# Arrays a kernel reaches in whole aligned 32-bit words (its atomics on the bytes it shares with
# other blocks: hvd_store_bits): their spans are rounded out to words, as the device's atomics reach
WORDS = {("hvd_table_encode", "message")}

_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)')
_PARAMETER = re.compile(r"\s*(?:const\s+)?([\w\s]+?)\s*(\*?)\s*(\w+)\s*")
C_TYPES = {"float": np.float32, "double": np.float64, "unsigned char": np.uint8, "unsigned short": np.uint16,
           "int": np.int32, "unsigned int": np.uint32, "long long": np.int64, "unsigned long long": np.uint64}
_CTYPES = {np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
           np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
           np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
           np.dtype(np.uint8): ctypes.c_uint8, np.dtype(np.uint16): ctypes.c_uint16}


@dataclasses.dataclass(frozen=True)
class Parameter:
    name: str
    dtype: np.dtype  # the C type, or the pointee's
    pointer: bool


def signatures(code: str) -> dict:
    """Every `extern "C"` kernel of CUDA source: name -> its Parameters."""
    kernels = {}
    for name, parameters in _KERNEL.findall(code):
        parsed = []
        for text in parameters.split(","):
            c_type, star, parameter = _PARAMETER.fullmatch(text).groups()
            parsed.append(Parameter(parameter, np.dtype(C_TYPES[" ".join(c_type.split())]), bool(star)))
        kernels[name] = tuple(parsed)
    return kernels


@dataclasses.dataclass(frozen=True)
class Span:
    """What a pointer argument reaches: the bytes of the array handed over (a strided view's from
    its lowest to its highest byte), `offset` the pointer's place among them."""
    low: int
    size: int
    offset: int

    @classmethod
    def of(cls, array: np.ndarray) -> "Span":
        low, high = np.lib.array_utils.byte_bounds(array)
        return cls(low, high - low, array.__array_interface__["data"][0] - low)

    @property
    def address(self) -> int:
        return self.low + self.offset

    def words(self) -> "Span":
        """The span rounded out to aligned 32-bit words."""
        low, high = self.low & ~3, -(-(self.low + self.size) // 4) * 4
        return Span(low, high - low, self.address - low)

    def bytes(self) -> bytes:
        return ctypes.string_at(self.low, self.size) if self.size else b""


def _dims(shape) -> ctypes.Array:
    dims = tuple(int(d) for d in np.atleast_1d(shape))
    return (ctypes.c_uint * 3)(*(dims + (1,) * (3 - len(dims))))


class Module:
    """A CUDA source's kernels compiled for the CPU with the SIMT layer."""

    def __init__(self, source: pathlib.Path):
        self.source = source
        self.kernels = signatures(source.read_text())  # name -> Parameters

    def _build(self, target: str, flags: list, sources: list, suffix: str, counted: tuple = ()) -> pathlib.Path:
        """g++ `sources` with `flags` into BUILD, once per digest of the sources' text and the flags;
        `counted` sources compiled apart with the instrumentation count.cc answers."""
        listed = "".join(f"X({name})" for name in sorted(self.kernels))
        command = ["g++", *FLAGS, *flags, f'-DHVD_SIMT_SOURCE="{self.source.resolve()}"',
                   f"-DHVD_SIMT_KERNELS={listed}"]
        digest = hashlib.sha256(repr((command, [str(c) for c in counted])).encode())
        for source in HEADERS + [self.source] + sources + list(counted):
            digest.update(source.read_bytes())
        path = BUILD / f"{target}-{self.source.stem}-{digest.hexdigest()[:16]}{suffix}"
        if path.exists():
            return path
        BUILD.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=BUILD) as scratch:
            objects = []
            for source in counted:
                objects.append(f"{scratch}/{source.stem}.o")
                self._compile([*command, "-fsanitize=thread", "-c", str(source), "-o", objects[-1]], target)
            partial = f"{scratch}/{path.name}"
            self._compile([*command, *map(str, sources), *objects, "-o", partial], target)
            os.replace(partial, path)
        return path

    @staticmethod
    def _compile(command: list, target: str) -> None:
        run = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if run.returncode:
            raise RuntimeError(f"building {target} failed:\n{' '.join(command)}\n{run.stderr}")

    @functools.cached_property
    def library(self) -> ctypes.CDLL:
        """The kernels and the SIMT runtime as a shared library, loaded once a process."""
        path = self._build("libsimt", ["-O2", "-fPIC", "-shared", "-fvisibility=hidden"], UNITS, ".so")
        lib = ctypes.CDLL(str(path))
        lib.hvd_simt_launch.restype = ctypes.c_char_p
        lib.hvd_simt_launch.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint),
                                        ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_void_p)]
        return lib

    @functools.cached_property
    def counting(self) -> ctypes.CDLL:
        """The kernels built to count the memory they reach (count.cc): hvd_simt_watch, launch,
        hvd_simt_traffic."""
        path = self._build("libsimt-count", ["-O2", "-fPIC", "-shared", "-fvisibility=hidden"],
                           [HERE / "simt.cc", HERE / "count.cc"], ".so", counted=(HERE / "kernels.cc",))
        lib = ctypes.CDLL(str(path))
        lib.hvd_simt_launch.restype = ctypes.c_char_p
        lib.hvd_simt_launch.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint),
                                        ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_void_p)]
        return lib

    def checked(self, sanitizer: str) -> pathlib.Path:
        """replay.cc's binary with the kernels built under `sanitizer` ("thread" or "address")."""
        return self._build(f"replay-{sanitizer}", ["-DHVD_SIMT_CHECKED", *SANITIZERS[sanitizer]],
                           UNITS + [HERE / "replay.cc"], "")

    def span(self, name: str, parameter: Parameter, array: np.ndarray) -> Span:
        """What `array` handed to `name`'s `parameter` lets the kernel reach."""
        reach = Span.of(array)
        return reach.words() if (name, parameter.name) in WORDS else reach

    def launch(self, name: str, grid, block, arguments: list) -> None:
        """Run kernel `name` over `grid` x `block`. arguments: per parameter, a Span (None for a
        null pointer) or a NumPy scalar of the parameter's C type."""
        parameters = self.kernels[name]
        if len(arguments) != len(parameters):
            raise TypeError(f"{name} takes {len(parameters)} arguments, got {len(arguments)}")
        values = [ctypes.c_void_p(a.address if a is not None else 0) if p.pointer else _CTYPES[p.dtype](a.item())
                  for p, a in zip(parameters, arguments)]
        argv = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        recording, traffic = Recording.active, Traffic.active
        before = recording.before(name, parameters, arguments) if recording is not None else None
        if traffic is None:
            why = self.library.hvd_simt_launch(name.encode(), _dims(grid), _dims(block), argv)
        else:
            why = traffic.launch(self.counting, name, _dims(grid), _dims(block), argv, parameters, arguments)
        if why is not None:
            raise RuntimeError(f"emulated launch failed: {why.decode()}")
        if recording is not None:
            recording.add(name, grid, block, parameters, arguments, before)

    def replay(self, path, sanitizer: str, timeout: float) -> subprocess.CompletedProcess:
        """Recorded launches replayed under `sanitizer`: the binary's exit code and output."""
        binary = self.checked(sanitizer)
        env = dict(os.environ, **SANITIZER_OPTIONS[sanitizer])
        env.pop("LD_PRELOAD", None)
        return subprocess.run([str(binary), str(path)], capture_output=True, text=True, timeout=timeout, env=env)


KERNELS = Module(OPS / "kernels.cu")


@dataclasses.dataclass(frozen=True)
class Moved:
    """One counted launch: the bytes of global memory it read and wrote, by parameter (32-byte
    sectors, each counted once a launch: count.cc)."""
    name: str
    thread: str  # the launching thread's name
    blocks: int
    read: dict
    written: dict

    @property
    def bytes(self) -> int:
        return sum(self.read.values()) + sum(self.written.values())


class Traffic:
    """Launches made inside `with Traffic() as t:` run on the counting build, one at a time, and
    leave what each moved in `t.launches` (Moved)."""
    active = None

    def __init__(self):
        self.launches, self._lock = [], threading.Lock()

    def __enter__(self) -> "Traffic":
        Traffic.active = self
        return self

    def __exit__(self, *exc):
        Traffic.active = None

    def launch(self, lib, name, grid, block, argv, parameters, arguments):
        watched = [(p.name, a) for p, a in zip(parameters, arguments) if p.pointer and a is not None]
        lows = (ctypes.c_uint64 * len(watched))(*[a.low for _, a in watched])
        sizes = (ctypes.c_uint64 * len(watched))(*[a.size for _, a in watched])
        read, written = (ctypes.c_uint64 * len(watched))(), (ctypes.c_uint64 * len(watched))()
        with self._lock:
            lib.hvd_simt_watch(lows, sizes, len(watched))
            why = lib.hvd_simt_launch(name.encode(), grid, block, argv)
            lib.hvd_simt_traffic(read, written)
        names = [n for n, _ in watched]
        self.launches.append(Moved(name, threading.current_thread().name, int(np.prod(list(grid))),
                                   dict(zip(names, read)), dict(zip(names, written))))
        return why


_FLOATS = {np.dtype(np.float32): 4, np.dtype(np.float64): 8}  # replay.cc compares these NaN for NaN


class Recording:
    """Launches made inside `with Recording() as r:`, in replay.cc's format: per launch its name,
    grid, block and arguments, each array's bytes before and after (and for float arrays their
    element size: a NaN matches any NaN there, as cuda_on_host.h says why)."""
    active = None

    def __init__(self):
        self.launches = []

    def __enter__(self) -> "Recording":
        Recording.active = self
        return self

    def __exit__(self, *exc):
        Recording.active = None

    @staticmethod
    def before(name: str, parameters, arguments) -> list:
        spans = sorted((a.low, a.low + a.size) for p, a in zip(parameters, arguments)
                       if p.pointer and a is not None and a.size)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            raise ValueError(f"{name}: arguments overlap in memory; a replay cannot reproduce that")
        return [a.bytes() if p.pointer and a is not None else None for p, a in zip(parameters, arguments)]

    def add(self, name, grid, block, parameters, arguments, before) -> None:
        parts = [struct.pack("<I", len(name)), name.encode(), bytes(_dims(grid)), bytes(_dims(block)),
                 struct.pack("<I", len(arguments))]
        for parameter, argument, was in zip(parameters, arguments, before):
            if not parameter.pointer:
                value = bytes(_CTYPES[parameter.dtype](argument.item()))
                parts += [struct.pack("<BI", 0, len(value)), value]
            elif argument is None:
                parts.append(struct.pack("<B", 2))
            else:
                element = _FLOATS.get(parameter.dtype, 0)
                parts += [struct.pack("<BQQB", 1, argument.size, argument.offset, element), was, argument.bytes()]
        self.launches.append(b"".join(parts))

    def write(self, path) -> None:
        with open(path, "wb") as out:
            out.write(b"HVDSIMT1" + struct.pack("<I", len(self.launches)))
            for launch in self.launches:
                out.write(launch)
