"""Exposes the CUDA toolkit and NCCL found on the machine, or nothing.

The toolkit: $CUDA_PATH, else /usr/local/cuda (cuda_runtime.h in include/).
NCCL: $NCCL_HOME (include/nccl.h, lib/libnccl.so), else the toolkit's
include/ and lib64/, else Debian's libnccl-dev (/usr/include/nccl.h and the
system library path). With both, the repository offers :cuda_runtime and
:nccl with headers and link options, and defs.bzl says HAS_CUDA = True.
Without the toolkit the same targets exist but are empty and HAS_CUDA =
False, so GPU code compiles to a "built without CUDA" stub. A toolkit
without NCCL fails the build, naming where it looked: it used to drop CUDA
silently, and the nccl and ipc backends then answered UNIMPLEMENTED at run
time. `--repo_env=WEIGHTSYNC_CUDA=off` builds without CUDA on purpose.
"""

_NO_CUDA_BUILD = """
package(default_visibility = ["//visibility:public"])

cc_library(name = "cuda_headers")
cc_library(name = "cuda_runtime")
cc_library(name = "nccl")
"""

def _find_nccl(rctx, cuda):
    """(include dir to expose or None, linkopts) of NCCL, or None."""
    home = rctx.os.environ.get("NCCL_HOME", "")
    if home:
        if not rctx.path(home + "/include/nccl.h").exists:
            fail("NCCL_HOME=%s has no include/nccl.h" % home)
        return (home + "/include", ["-L%s/lib" % home, "-Wl,-rpath,%s/lib" % home, "-lnccl"])
    if rctx.path(cuda + "/include/nccl.h").exists:
        return (None, ["-L%s/lib64" % cuda, "-lnccl"])
    if rctx.path("/usr/include/nccl.h").exists:
        return (None, ["-lnccl"])  # Debian's libnccl-dev: system paths
    return None

def _cuda_configure_impl(rctx):
    cuda = rctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    off = rctx.os.environ.get("WEIGHTSYNC_CUDA", "") == "off"
    has_cuda = not off and rctx.path(cuda + "/include/cuda_runtime.h").exists
    nccl = _find_nccl(rctx, cuda) if has_cuda else None
    if has_cuda and nccl == None:
        fail(("CUDA toolkit found at %s but no NCCL: looked for $NCCL_HOME/include/nccl.h, " +
              "%s/include/nccl.h and /usr/include/nccl.h. Install NCCL (Debian: libnccl-dev), " +
              "set NCCL_HOME, or build without CUDA with --repo_env=WEIGHTSYNC_CUDA=off.") %
             (cuda, cuda))
    if not has_cuda:
        rctx.file("BUILD", _NO_CUDA_BUILD)
        rctx.file("defs.bzl", "HAS_CUDA = False\nCUDA_PATH = \"\"\n")
        return
    rctx.symlink(cuda + "/include", "include")
    nccl_include, nccl_linkopts = nccl
    nccl_headers = ""
    if nccl_include:
        rctx.symlink(nccl_include, "nccl_include")
        nccl_headers = """
cc_library(
    name = "nccl_headers",
    hdrs = glob(["nccl_include/**"]),
    includes = ["nccl_include"],
)
"""
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
{nccl_headers}
cc_library(
    name = "nccl",
    linkopts = {linkopts},
    deps = [":cuda_headers"]{nccl_dep},
)
""".format(
        cuda = cuda,
        nccl_headers = nccl_headers,
        linkopts = repr(nccl_linkopts),
        nccl_dep = ' + [":nccl_headers"]' if nccl_include else "",
    ))
    rctx.file("defs.bzl", "HAS_CUDA = True\nCUDA_PATH = \"{}\"\n".format(cuda))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH", "NCCL_HOME", "WEIGHTSYNC_CUDA"],
    local = True,
)
