"""cuda_library: compiles each .cu file with nvcc (a genrule per file) into a cc_library.

This is the only place nvcc flags live. Targets Hopper: sm_90a machine code plus compute_90 PTX.
Every header a .cu file includes must reach the genrule: list the package's own headers in `hdrs`
and headers of other packages in `cuda_hdrs` (labels of files or filegroups).
Without a CUDA toolkit (see cuda_configure.bzl) the .cu files are left out and the library holds
only its C++ sources and headers.
"""

load("@local_cuda//:defs.bzl", "CUDA_ENABLED", "NVCC")

NVCC_FLAGS = [
    "-std=c++20",
    "-O3",
    "-lineinfo",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
    "-DTQKV_HAVE_CUDA=1",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
]

def cuda_library(name, srcs = [], hdrs = [], cuda_hdrs = [], deps = [], copts = [], nvcc_flags = [], **kwargs):
    cu_srcs = [s for s in srcs if s.endswith(".cu")]
    cc_srcs = [s for s in srcs if not s.endswith(".cu")]
    objs = []
    if CUDA_ENABLED:
        for src in cu_srcs:
            obj = "_objs_cuda/%s/%s.o" % (name, src[:-len(".cu")])
            native.genrule(
                name = "%s_nvcc_%s" % (name, src[:-len(".cu")].replace("/", "_")),
                srcs = [src] + hdrs + cuda_hdrs,
                outs = [obj],
                cmd = " ".join([NVCC] + NVCC_FLAGS + nvcc_flags + [
                    "-I.",
                    "-I$(GENDIR)",
                    "-c $(location %s)" % src,
                    "-o $@",
                ]),
                message = "nvcc %s" % src,
            )
            objs.append(obj)
    native.cc_library(
        name = name,
        srcs = cc_srcs + objs,
        hdrs = hdrs,
        copts = copts,
        deps = deps + ["@local_cuda//:config", "@local_cuda//:cudart_static"],
        **kwargs
    )
