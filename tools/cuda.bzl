"""cuda_library: CUDA C++ (.cu) compiled by the toolkit's nvcc, as a cc_library.

Bazel 4.2.3 has no CUDA rules we can use offline, so each .cu file becomes one
genrule that runs nvcc (from @local_cuda's CUDA_PATH, host compiler
/usr/bin/g++) and writes a position-independent object, and a cc_library
wraps the objects with the headers and links the CUDA runtime.

Where the toolkit is absent (HAS_CUDA = False) the same target is a
cc_library holding only the headers; nvcc is never referenced, so the CPU
build analyses and builds without the toolkit. Code that includes such a
header must itself sit behind WEIGHTSYNC_HAS_CUDA (see
//backends/cuda:cuda_support).

What a .cu file may include: CUDA's own headers, the files in `hdrs` and the
headers (.h, .cuh, .hpp) in `srcs`, by their repository-rooted paths
("backends/cuda/scatter.h"), including generated ones. Headers of `deps` are
NOT visible to nvcc (a genrule can't see a cc_library's headers); keep .cu
files self-contained and put the C++ glue that needs other libraries in .cc
files of an ordinary cc_library.
"""

load("@local_cuda//:defs.bzl", "CUDA_PATH", "HAS_CUDA")

# Hopper (H100/H200): SASS for sm_90 plus compute_90 PTX so a newer GPU can
# JIT it. Extend here when other GPUs must run the code natively.
CUDA_GENCODE = [
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]

CUDA_COPTS = [
    "-std=c++17",
    "-O3",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-Wall",
]

_CUDA_HEADER_EXTS = (".h", ".hh", ".hpp", ".cuh", ".inc")
_CC_HEADER_EXTS = (".h", ".hh", ".hpp", ".inc")

def cuda_library(name, srcs = [], hdrs = [], deps = [], copts = [], **kwargs):
    """A cc_library `name` whose .cu sources are compiled by nvcc.

    Args:
      name: target name.
      srcs: .cu files, plus private headers (.h/.cuh) they include.
      hdrs: public headers (plain C++: includable from .cc files).
      deps: cc_library deps of the wrapper (linked; not seen by nvcc).
      copts: extra nvcc flags, after CUDA_COPTS and CUDA_GENCODE.
      **kwargs: passed to the cc_library (visibility, testonly, tags, ...);
        testonly, tags and compatible_with also reach the genrules.
    """
    cu_srcs = [s for s in srcs if s.endswith(".cu")]
    private_hdrs = [s for s in srcs if s.endswith(_CUDA_HEADER_EXTS)]
    others = [s for s in srcs if s not in cu_srcs and s not in private_hdrs]
    if others:
        fail("cuda_library %s: srcs must be .cu or headers, got %s" % (name, others))

    if not HAS_CUDA:
        native.cc_library(
            name = name,
            hdrs = hdrs,
            srcs = [h for h in private_hdrs if h.endswith(_CC_HEADER_EXTS)],
            deps = deps,
            **kwargs
        )
        return

    genrule_kwargs = {k: kwargs[k] for k in ("testonly", "tags", "compatible_with") if k in kwargs}
    nvcc = CUDA_PATH + "/bin/nvcc"
    flags = CUDA_COPTS + CUDA_GENCODE + copts
    objs = []
    for src in cu_srcs:
        # One object per .cu, named after the target so two cuda_library
        # targets in one package may share a source file name.
        obj = "_cuda_objs/%s/%s.pic.o" % (name, src[:-len(".cu")])
        objs.append(obj)
        native.genrule(
            name = "%s_nvcc_%s" % (name, src[:-len(".cu")].replace("/", "_")),
            srcs = [src] + hdrs + private_hdrs,
            outs = [obj],
            # nvcc writes its intermediate files under TMPDIR; keep them in
            # the action's own output directory so the sandbox needs no
            # writable /tmp, and remove them whether nvcc succeeds or not.
            cmd = ("export TMPDIR=$$(mktemp -d \"$${{PWD}}/$(@D)/nvcc_tmp.XXXXXX\"); " +
                   "trap 'rm -rf \"$${{TMPDIR}}\"' EXIT; " +
                   "{nvcc} -ccbin /usr/bin/g++ {flags} -I. -I$(GENDIR) " +
                   "-c $(location {src}) -o $@").format(
                nvcc = nvcc,
                flags = " ".join(flags),
                src = src,
            ),
            message = "Compiling CUDA %s" % src,
            **genrule_kwargs
        )

    native.cc_library(
        name = name,
        srcs = objs + [h for h in private_hdrs if h.endswith(_CC_HEADER_EXTS)],
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cuda_runtime"],
        **kwargs
    )
