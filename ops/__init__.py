"""The codec's kernel sources (fpcodec.h, host.c, kernels.cu), shipped inside the wheel as
hvd_aps.ops: the CuPy engine compiles kernels.cu from here at run time. A regular package, so an
editable install (scripts/install.sh) finds it too, which setuptools' editable finder does not do
for a namespace package mapped beside its parent."""
