"""Exposes the CUDA toolkit and NCCL found on the machine, or nothing.

Where /usr/local/cuda (or $CUDA_PATH) holds cuda_runtime.h and nccl.h the
repository offers :cuda_runtime and :nccl with headers and link options, and
defs.bzl says HAS_CUDA = True. Elsewhere the same targets exist but are empty
and HAS_CUDA = False, so GPU code compiles to a "built without CUDA" stub.
"""

def _cuda_configure_impl(rctx):
    cuda = rctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    has_cuda = (rctx.path(cuda + "/include/cuda_runtime.h").exists and
                rctx.path(cuda + "/include/nccl.h").exists)
    if has_cuda:
        rctx.symlink(cuda + "/include", "include")
        rctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
)

cc_library(
    name = "cuda_runtime",
    linkopts = ["-L{cuda}/lib64", "-Wl,-rpath,{cuda}/lib64", "-lcudart"],
    deps = [":cuda_headers"],
)

cc_library(
    name = "nccl",
    linkopts = ["-L{cuda}/lib64", "-lnccl"],
    deps = [":cuda_headers"],
)
""".format(cuda = cuda))
    else:
        rctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(name = "cuda_headers")
cc_library(name = "cuda_runtime")
cc_library(name = "nccl")
""")
    rctx.file("defs.bzl", "HAS_CUDA = {}\nCUDA_PATH = \"{}\"\n".format(has_cuda, cuda if has_cuda else ""))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH"],
    local = True,
)
