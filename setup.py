"""hvd_aps: Horovod gradient compression into tiny custom float formats with Auto-Precision Scaling."""
import re

from setuptools import Extension, setup

# one version source: hvd_aps/__init__.py
VERSION = re.search(r'^__version__ = "(.+)"$', open("hvd_aps/__init__.py").read(), re.M)[1]

setup(
    name="hvd_aps",
    version=VERSION,
    description=__doc__,
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    # ops/ (the kernel sources) ships inside the wheel as hvd_aps/ops.
    packages=["hvd_aps", "hvd_aps.torch", "hvd_aps.tensorflow", "hvd_aps.ops"],
    package_dir={"hvd_aps.ops": "ops"},
    python_requires=">=3.10",
    install_requires=["numpy>=1.24", "tqdm>=4.60"],
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow>=2.16"],
        "cupy": ["cupy-cuda13x>=14"],
        "test": ["pytest", "pytest-timeout", "hypothesis", "ml_dtypes>=0.5"],
    },
    # The CPU engine: ops/host.c as a plain shared library, loaded through ctypes.
    ext_modules=[Extension("hvd_aps._hostcodec", sources=["ops/host.c"], depends=["ops/fpcodec.h"],
                           extra_compile_args=["-O3", "-std=c11", "-fno-trapping-math"], py_limited_api=True)],
    package_data={"hvd_aps.ops": ["*.h", "*.c", "*.cu"], "hvd_aps": ["gpu_projection.json", "fidelity.json"]},
)
