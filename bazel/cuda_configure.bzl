"""Repository rule that finds the CUDA toolkit (nvcc) or records that there is none.

Looks at $TQKV_CUDA_PATH, else /usr/local/cuda. If `bin/nvcc` exists there, @local_cuda exposes
the headers, static cudart and cuBLAS, and `defs.bzl` says CUDA_ENABLED = True. Otherwise the same
targets exist but are empty, and every CUDA source is left out of the build (CPU-only build).
Set TQKV_CUDA_PATH=/nonexistent to force a CPU-only build on a machine that has CUDA.
"""

_BUILD_WITH_CUDA = """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "config",
    defines = ["TQKV_HAVE_CUDA=1"],
)

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
)

cc_library(
    name = "cudart_static",
    srcs = ["lib64/libcudart_static.a"],
    linkopts = ["-ldl", "-lpthread", "-lrt"],
    deps = [":cuda_headers"],
)

# cuBLAS ships only as a shared library in this toolkit; the rpath makes binaries run here and on
# the GPU machine (same path) without LD_LIBRARY_PATH.
cc_library(
    name = "cublas",
    linkopts = [
        "-L{path}/lib64",
        "-Wl,-rpath,{path}/lib64",
        "-lcublas",
        "-lcublasLt",
    ],
    deps = [":cuda_headers"],
)
"""

_BUILD_WITHOUT_CUDA = """
package(default_visibility = ["//visibility:public"])

cc_library(name = "config")

cc_library(name = "cuda_headers")

cc_library(name = "cudart_static")

cc_library(name = "cublas")
"""

def _cuda_configure_impl(ctx):
    path = ctx.os.environ.get("TQKV_CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(path + "/bin/nvcc")
    enabled = nvcc.exists
    if enabled:
        ctx.symlink(path + "/include", "include")
        ctx.symlink(path + "/lib64", "lib64")
        ctx.file("BUILD", _BUILD_WITH_CUDA.replace("{path}", path))
    else:
        ctx.file("BUILD", _BUILD_WITHOUT_CUDA)
    ctx.file("defs.bzl", "\n".join([
        "CUDA_ENABLED = %s" % enabled,
        "CUDA_PATH = %r" % path,
        "NVCC = %r" % (str(nvcc) if enabled else ""),
        "",
    ]))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["TQKV_CUDA_PATH"],
    local = True,
)
